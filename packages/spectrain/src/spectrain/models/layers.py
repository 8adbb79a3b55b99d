"""Building blocks shared by the drafts: RMSNorm, rotary embeddings, SwiGLU MLP, masked attention.

Attention runs on one packed sequence (no batch dimension). A :class:`MaskSpec` describes which
keys each query may see as a ``mask_mod(b, h, q_idx, kv_idx) -> bool`` written with tensor
ops only, so the same function drives FlexAttention's block mask on CUDA and a dense boolean
mask for SDPA on CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """Qwen3/Llama RMSNorm: ``w * x / rms(x)``, computed in fp32, returned in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-style (rotate-half) rotary tables ``cos, sin`` of shape ``[T, head_dim]``."""
    inv = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[heads, T, D]`` by tables ``[T, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


@dataclass
class MaskSpec:
    """Which keys each query attends to: ``mask_mod`` over ``q_len x kv_len`` indices."""

    q_len: int
    kv_len: int
    mask_mod: MaskMod
    device: torch.device

    def dense(self) -> torch.Tensor:
        """The mask as a ``[q_len, kv_len]`` bool tensor (True = attend)."""
        q = torch.arange(self.q_len, device=self.device)[:, None]
        kv = torch.arange(self.kv_len, device=self.device)[None, :]
        zero = torch.zeros((), dtype=torch.long, device=self.device)
        return self.mask_mod(zero, zero, q, kv).expand(self.q_len, self.kv_len)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def block_mask_for(spec: MaskSpec):
    """FlexAttention ``BlockMask`` for ``spec`` (built on the spec's device)."""
    from torch.nn.attention.flex_attention import create_block_mask

    compile_it = spec.device.type == "cuda"
    return create_block_mask(
        spec.mask_mod, None, None, spec.q_len, spec.kv_len, device=spec.device, _compile=compile_it
    )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: MaskSpec,
    backend: str,
    *,
    block_mask=None,
    dense_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked attention, ``q [Hq, Q, D]``, ``k/v [Hkv, K, D]`` -> ``[Hq, Q, D]``.

    ``backend``: ``"flex"`` (FlexAttention, compiled; CUDA) or ``"sdpa"`` (dense boolean mask;
    any device). ``block_mask``/``dense_mask`` reuse a mask built once for all layers.
    """
    if backend == "flex":
        if block_mask is None:
            block_mask = block_mask_for(spec)
        # inside a compiled region flex_attention is traced as is; eager CUDA calls a compiled one
        fn = _compiled_flex() if compiled_flex_for(q) else _eager_flex()
        out = fn(q[None], k[None], v[None], block_mask=block_mask, enable_gqa=q.shape[0] != k.shape[0])
        return out[0]
    if backend != "sdpa":
        raise ValueError(f"unknown attention backend {backend!r} (flex | sdpa)")
    mask = dense_mask if dense_mask is not None else spec.dense()
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, enable_gqa=q.shape[0] != k.shape[0]
    )[0]


def compiled_flex_for(q: torch.Tensor) -> bool:
    """Whether eager code calls the compiled FlexAttention for ``q`` (CUDA, outside a compiled region)."""
    return q.is_cuda and not torch.compiler.is_compiling()


def context_bucket(n: int, smallest: int = 128) -> int:
    """The padded length of a ``n``-slot context: the next power of two from ``smallest`` on.

    Compiled FlexAttention is specialised to its key length, so a decode loop whose context grows
    by a few tokens a step would compile once per step; padded to these buckets it compiles once
    per doubling (7 shapes up to 8,192 tokens, inside dynamo's default cache of 8 per function).
    """
    return max(smallest, 1 << max(0, n - 1).bit_length())


def _eager_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def default_backend(device: torch.device) -> str:
    """``flex`` on CUDA, ``sdpa`` elsewhere."""
    return "flex" if device.type == "cuda" else "sdpa"


class PreparedMask:
    """A mask built once per forward and reused by every layer, for the chosen backend."""

    def __init__(self, spec: MaskSpec, backend: str):
        self.spec = spec
        self.backend = backend
        self.block_mask = block_mask_for(spec) if backend == "flex" else None
        self.dense = spec.dense() if backend == "sdpa" else None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(q, k, v, self.spec, self.backend, block_mask=self.block_mask, dense_mask=self.dense)
