"""Typed configuration of the reference server and the vLLM-version behaviour rows."""

from __future__ import annotations

import re
from dataclasses import dataclass

from hsgen.protocol import extraction as protocol
from hsgen.serve.capacity import CapacityModel
from hsgen.serve.faults import FaultPlan

DEFAULT_VLLM_VERSION = "0.24"


@dataclass(frozen=True)
class VersionBehaviour:
    """How the file and its lock are produced, per vLLM version row (see docs/serve.md).

    Attributes:
        version: the vLLM version imitated, e.g. ``"0.24"``.
        write_mode: ``"sync"`` (0.18-0.21: written inside the forward pass, before the
            response), ``"pool"`` (0.22-0.23: handed to a writer pool as soon as the forward
            ends, so it may finish before or after the response) or ``"after_response"``
            (0.24+: started only after the request finished and its response was sent).
        use_lock: whether ``<path>.lock`` is held with ``flock(LOCK_EX)`` during the write.
        supports_output_tokens: whether ``kv_transfer_params.include_output_tokens`` is honoured.
        supports_custom_save_path: whether ``kv_transfer_params.hidden_states_path`` can be
            honoured at all (it also needs ``allow_custom_save_path``).
    """

    version: str
    write_mode: str
    use_lock: bool
    supports_output_tokens: bool
    supports_custom_save_path: bool

    @classmethod
    def for_version(cls, version: str) -> VersionBehaviour:
        """The behaviour row of a vLLM version string like ``"0.22"`` or ``"0.24.1"``.

        Raises:
            ValueError: for a malformed version or one older than 0.18 (no extraction).
        """
        m = re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.\d+)?\S*\s*", version)
        if not m:
            raise ValueError(f"--vllm-version {version!r} is not a version like 0.24 or 0.24.1")
        major, minor = int(m.group(1)), int(m.group(2))
        key = (major, minor)
        if key < (0, 18):
            raise ValueError(f"--vllm-version {version}: hidden-state extraction needs vLLM >= 0.18")
        if key < (0, 22):
            return cls(version, "sync", False, False, False)
        if key < (0, 24):
            return cls(version, "pool", True, False, False)
        return cls(version, "after_response", True, True, True)


@dataclass
class ServeConfig:
    """Everything ``hsgen serve`` needs; the CLI options map one to one onto these fields.

    Attributes:
        model: ``"tiny"`` (the built-in model, see ``hsgen.hf.tiny``), a local Hugging Face
            causal-LM directory, or a model id resolved through the hub cache (:mod:`hsgen.hf.hub`).
        revision: branch, tag or commit of a model id (default ``main``).
        layer_ids: vLLM layer ids to extract (sorted, unique; ``L`` = last layer before the norm).
        shared_storage_path: directory the files are written to (vLLM's ``shared_storage_path``).
        host: interface to bind.
        port: TCP port; 0 picks a free one.
        served_model_name: the id in ``GET /v1/models`` and the accepted ``model`` field
            (default: ``model`` as given, like vLLM).
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>``.
        max_model_len: context length; a prompt must fit ``max_model_len - 1`` (default:
            the model's ``max_position_embeddings``).
        max_num_seqs: the most sequences in one forward step; others wait (vLLM's flag).
        max_num_batched_tokens: token budget of one forward step (padded tokens count);
            a longer single prompt still runs, alone.
        dtype: ``auto`` (the checkpoint's dtype), ``bfloat16``, ``float16`` or ``float32``.
        device: torch device, e.g. ``cpu`` or ``cuda``.
        vllm_version: which vLLM row of the file/lock behaviour to imitate.
        allow_custom_save_path: honour ``kv_transfer_params.hidden_states_path`` (vLLM's
            ``kv_connector_extra_config.allow_custom_save_path``).
        num_writer_threads: threads writing files (vLLM's ``num_writer_threads``).
        torch_threads: ``torch.set_num_threads`` for the forward (0 = leave torch's default).
        tiny_cache_dir: where ``--model tiny`` is built (default ``$HSGEN_CACHE``).
        capacity: optional GPU-like time model (benchmarks); None = run as fast as possible.
        faults: optional fault injection plan (tests); None = no faults.
        enable_admin: expose ``/hsgen/*`` endpoints that change faults and capacity at run time.
        enable_scale_out: serve ``POST /v1/chat/completions/render`` (vLLM's ``--enable-scale-out``;
            without it the endpoint answers 403, as vLLM's does).
    """

    model: str
    layer_ids: list[int]
    revision: str | None = None
    shared_storage_path: str = protocol.DEFAULT_SHARED_STORAGE_PATH
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    dtype: str = "auto"
    device: str = "cpu"
    vllm_version: str = DEFAULT_VLLM_VERSION
    allow_custom_save_path: bool = False
    num_writer_threads: int = 4
    torch_threads: int = 0
    tiny_cache_dir: str | None = None
    capacity: CapacityModel | None = None
    faults: FaultPlan | None = None
    enable_admin: bool = False
    enable_scale_out: bool = False

    @property
    def behaviour(self) -> VersionBehaviour:
        return VersionBehaviour.for_version(self.vllm_version)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def validate(self) -> None:
        """Raise ``ValueError`` naming the option for a setting that cannot work."""
        self.behaviour  # noqa: B018 - validates the version
        if not self.layer_ids:
            raise ValueError("--layers must name at least one layer id")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.dtype not in (
            "auto",
            "bfloat16",
            "float16",
            "float32",
            "bf16",
            "fp16",
            "fp32",
            "half",
            "float",
        ):
            raise ValueError(f"--dtype {self.dtype!r}: use auto, bfloat16, float16 or float32")
        if self.num_writer_threads < 1:
            raise ValueError(f"--num-writer-threads must be >= 1, got {self.num_writer_threads}")
