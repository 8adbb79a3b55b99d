"""Helpers for the reference-server tests: a client that knows only vLLM's wire protocol."""

from __future__ import annotations

import fcntl
import functools
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from hsgen.protocol import extraction as protocol

TINY_LAYERS = [0, 1, 2, 4]
"""Embeddings, two inner layers and L=4 (the tiny model has 4 layers)."""


@functools.lru_cache(maxsize=1)
def tiny_dir() -> Path:
    from hsgen.hf.tiny import ensure_tiny_model

    return Path(ensure_tiny_model())


def http(url: str, path: str, body: Any = None, *, method: str | None = None, headers=None, timeout=600):
    """One HTTP call with urllib; returns (status, parsed JSON or text)."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(
        f"{url}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def wait_lock_shared(path: str, timeout: float = 600) -> float:
    """Take and drop ``LOCK_SH`` on ``<path>.lock`` like a vLLM client; returns seconds blocked."""
    t0 = time.monotonic()
    lock = protocol.lock_path(path)
    fd = os.open(lock, os.O_RDONLY)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"{lock} still locked after {timeout} s") from None
                time.sleep(0.005)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    return time.monotonic() - t0


def lock_is_held(path: str) -> bool:
    """Whether someone holds ``flock`` on ``<path>.lock`` (False when it does not exist)."""
    lock = protocol.lock_path(path)
    if not os.path.exists(lock):
        return False
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def load_states(path: str) -> dict[str, Any]:
    """Validate the safetensors header against the file size, then load the tensors."""
    from safetensors.torch import load_file

    with open(path, "rb") as f:
        header = protocol.read_safetensors_header(f, os.path.getsize(path))
    assert set(header) == {protocol.HIDDEN_STATES_KEY, protocol.TOKEN_IDS_KEY}, header
    return load_file(path)


@functools.lru_cache(maxsize=4)
def plain_model(dtype_name: str):
    """The tiny model loaded with plain transformers (no hooks), for reference values."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, dtype_name)
    return AutoModelForCausalLM.from_pretrained(tiny_dir(), dtype=dtype, local_files_only=True).eval()


def reference_states(token_ids: list[int], layer_ids: list[int], dtype_name: str):
    """(hidden_states [T, n, H] per vLLM's layer ids, HF hidden_states tuple, greedy next token).

    Ids k < L come from HF ``output_hidden_states[k]``; id L from a forward hook on the last
    decoder layer (its pre-norm output). Tests also check ``norm(state_L) == hidden_states[L]``.
    """
    import torch

    model = plain_model(dtype_name)
    L = model.config.num_hidden_layers
    box = {}
    handle = model.model.layers[L - 1].register_forward_hook(lambda m, a, out: box.__setitem__("L", out))
    try:
        with torch.inference_mode():
            out = model(torch.tensor([token_ids]), output_hidden_states=True)
    finally:
        handle.remove()
    per_layer = [box["L"][0] if k == L else out.hidden_states[k][0] for k in layer_ids]
    return torch.stack(per_layer, dim=1), out.hidden_states, int(out.logits[0, -1].float().argmax())
