"""Who the quality benchmark's inputs are: content hashes, library versions, the machine, and the
settings under which they are computed bit-reproducibly.

``reproducible()`` is the context every input of the benchmark (the target's weights, the target's
greedy continuations in ``train.jsonl``) is computed in: a fixed torch thread count
(:data:`BUILD_THREADS`), ``torch.use_deterministic_algorithms`` and the caller's seeds. Inside it two
builds on one machine give the same bits (``tests/e2e/test_quality_target_reproducible.py``).
``environment()`` names what else the bits depend on: torch / transformers / tokenizers versions and
the CPU's instruction set (its kernels round differently) or the GPU. Not a benchmark itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

BUILD_THREADS = 1
"""Torch threads of every input's computation, whatever ``--threads`` says. One thread: a reduction
split over more threads adds its partial sums in another order (docs/benchmarks.md, "Inputs that
reproduce"), and one is the benchmark's default and fastest setting on a shared machine anyway."""

LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "zarr")

KERNELS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}, "native": {}}
"""``--kernels``: the CPU code paths every step runs. ``avx2`` (the default) makes torch's own
kernels and MKL's take their AVX2 paths on any x86-64 CPU that has AVX2, so another machine computes
the same bits; ``native`` lets each use the widest the CPU has (AVX-512, AMX: faster, other bits).
The first kernel whose result differs between the two on one input is the softmax inside the
attention (``_scaled_dot_product_flash_attention_for_cpu``; ``_softmax`` with eager attention):
its exponentials and lane sums (docs/benchmarks.md, "Inputs that reproduce")."""


def pin_kernels(kernels: str) -> dict:
    """Set the environment of :data:`KERNELS` ``[kernels]`` for this process and its children.
    Must run before torch is imported (torch and MKL read it once, at load): when torch already is,
    nothing is changed and the kernels torch runs are what :func:`environment` records. Returns the
    variables set."""
    wanted = KERNELS[kernels]
    if "torch" in sys.modules:
        return {}
    for name, value in wanted.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in wanted}


def sha256_file(path: Path) -> str:
    """The file's sha256, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _cpu_flags() -> set[str]:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def environment(device: str = "cpu") -> dict:
    """Library versions and the machine that computed a result: ``python``, each of
    :data:`LIBRARIES`, ``isa`` (the kernel set torch runs: ``AVX512``, ``AVX2``, ...; with ``+AMX``
    when the CPU has it, which oneDNN uses for bf16), ``mkl_cbwr`` (MKL's pinned code path, or null),
    ``cpu`` (the model name), ``gpu`` (the CUDA device's name, or null)."""
    import torch

    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    isa = torch.backends.cpu.get_cpu_capability()
    if isa.startswith("AVX512") and "amx_tile" in _cpu_flags():
        isa += "+AMX"
    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") and torch.cuda.is_available() else None
    return {
        "python": sys.version.split()[0],
        **versions,
        "isa": isa,
        "mkl_cbwr": os.environ.get("MKL_CBWR"),
        "cpu": _cpu_model(),
        "gpu": gpu,
    }


BUILD_KEYS = ("python", "torch", "transformers", "tokenizers", "isa", "mkl_cbwr", "gpu")
"""The fields of :func:`environment` a target's bits depend on (the Python version names the
standard library it is trained on; the rest compute it). Two CPUs of one model name are not needed:
two machines that agree on these run the same kernels on the same code."""


def build_key(env: dict) -> dict:
    """The :data:`BUILD_KEYS` part of an :func:`environment` record."""
    return {k: env.get(k) for k in BUILD_KEYS}


def build_key_digest(env: dict) -> str:
    """8 hex digits naming :func:`build_key` (part of a cached target's directory name)."""
    return hashlib.sha256(json.dumps(build_key(env), sort_keys=True).encode()).hexdigest()[:8]


def build_differences(built_with: dict, env: dict) -> dict:
    """``field: [built with, here]`` for each :data:`BUILD_KEYS` field where a target's record and
    this environment differ (empty: this machine would build the same bits)."""
    return {k: [built_with.get(k), env.get(k)] for k in BUILD_KEYS if built_with.get(k) != env.get(k)}


@contextlib.contextmanager
def reproducible(device: str = "cpu") -> Iterator[dict]:
    """Compute inside with :data:`BUILD_THREADS` torch threads and deterministic algorithms (on CUDA
    warn-only, with ``CUBLAS_WORKSPACE_CONFIG`` set: a kernel without a deterministic version warns
    instead of stopping the benchmark); the previous settings come back on exit. Yields the
    settings, for the record."""
    import torch

    threads = torch.get_num_threads()
    was = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    cuda = device.startswith("cuda")
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(BUILD_THREADS)
    torch.use_deterministic_algorithms(True, warn_only=cuda)
    try:
        yield {"threads": BUILD_THREADS, "deterministic_algorithms": "warn_only" if cuda else True}
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)
        torch.set_num_threads(threads)


def input_hashes(target_facts: dict, train_jsonl: Path, eval_jsonl: Path) -> dict:
    """The sha256 of every input a quality figure depends on besides the code: the target's weights
    (as its record says; :func:`quality_target.target_facts` checked them), ``train.jsonl`` (the
    prompts and the target's continuations the drafts train on) and ``eval.jsonl``."""
    return {
        "target_weights_sha256": target_facts["weights_sha256"],
        "train_jsonl_sha256": sha256_file(train_jsonl),
        "eval_jsonl_sha256": sha256_file(eval_jsonl),
    }
