"""``--dtype auto`` as vLLM resolves it, so the reference server writes what vLLM would write.

vLLM serves a checkpoint in its own dtype, except float32 (or no recorded dtype), which it
serves in the platform's first supported half type: bfloat16 where the device computes in it
(CPUs, CUDA compute capability >= 8.0), float16 otherwise. A bfloat16 checkpoint on a device
without bfloat16 is served in float16.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hsgen.protocol.dtypes import ALIASES


def checkpoint_dtype(config: dict[str, Any]) -> str:
    """The dtype a HF ``config.json`` records (``torch_dtype`` or ``dtype``; text_config too), else float32."""
    for source in (config, config.get("text_config") or {}):
        for key in ("torch_dtype", "dtype"):
            value = source.get(key)
            if isinstance(value, str) and value.removeprefix("torch.") in ALIASES:
                return ALIASES[value.removeprefix("torch.")]
    return "float32"


def device_supports_bf16(device: str) -> bool:
    """bfloat16 compute: on CPUs (as vLLM's CPU platform), on CUDA when the GPU supports it."""
    import torch

    kind = device.split(":", 1)[0]
    if kind == "cpu":
        return True
    if kind == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return False


def resolve_auto_dtype(model_dir: str | Path, device: str) -> str:
    """vLLM's choice for ``--dtype auto`` of the checkpoint in ``model_dir`` on ``device``."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    dtype = checkpoint_dtype(config)
    if dtype == "float32" or (dtype == "bfloat16" and not device_supports_bf16(device)):
        return "bfloat16" if device_supports_bf16(device) else "float16"
    return dtype
