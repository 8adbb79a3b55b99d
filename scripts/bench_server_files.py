#!/usr/bin/env python
"""Reading a server's hidden-state file through its descriptor: the client's read against the alternatives.

The client opens each vLLM file without following links and checks it is a regular file
(``hsgen.client.shared_dir``); what it does with that descriptor is measured here, on files of the
reference size (8192 tokens x 4 layers x 4096, bf16: 256 MiB) in ``/dev/shm`` (the page cache,
as for a server writing to tmpfs), one thread, interleaved, median of the rounds:

- ``client``: :func:`hsgen.client.hidden_file.read_hidden_states_fd`: the header checked by
  ``hsgen.protocol.extraction``, each tensor read with ``preadv`` into a new array (one copy);
- ``mmap_view``: ``read_hidden_states_fd(fd, map_file=True)`` (``ClientConfig.map_files``): the
  same header check, the file mapped (``MAP_PRIVATE|MAP_POPULATE``) and returned as views, no
  copy (what the client did by default before: a writer that truncates the file later kills the
  reader with SIGBUS);
- ``safetensors_bytes``: the whole file read through the descriptor into ``bytes``, then
  ``safetensors.deserialize`` (header checked by the library; the data copied twice;
  ``safetensors.numpy.load`` itself has no bf16);
- ``safe_open_procfd``: ``safetensors.safe_open("/proc/self/fd/N")``, the library's own map of
  the same open file (so no path is followed again), then ``get_tensor`` (one copy; Linux only).

``<variant>_gbps``: the file's bytes over the time from the open descriptor to validated arrays
plus one pass over the hidden states (the finite check the client runs by default; it also makes
lazily mapped pages count). ``<variant>_read_only_gbps``: without that pass (the online trainer
checks while it copies into the batch). ``*_over_mmap_view``: ratios to the zero-copy read,
round by round. Each timed pass follows an untimed read of one file by the same variant.
``--quick`` uses 2 files and 3 rounds. Progress goes to stderr; the last stdout line is one
JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

from hsgen.client.hidden_file import STORAGE_DTYPES, all_finite, read_hidden_states_fd
from hsgen.protocol import extraction as protocol


def write_file(path: str, tokens: int, layers: int, hidden: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 150_000, tokens, dtype=np.int64)
    # finite bf16 bit patterns: exponent below all-ones
    states = rng.integers(0, 0x7F00, size=(tokens, layers, hidden), dtype=np.uint16)
    header, _ = protocol.safetensors_header_bytes(
        [("token_ids", "int64", (tokens,)), ("hidden_states", "bfloat16", (tokens, layers, hidden))]
    )
    with open(path, "wb") as f:
        f.write(header)
        f.write(ids.tobytes())
        f.write(states.tobytes())


def safetensors_bytes(fd: int) -> tuple[np.ndarray, np.ndarray, str]:
    import safetensors

    size = os.fstat(fd).st_size
    data = os.pread(fd, size, 0)
    out = {}
    for name, t in safetensors.deserialize(data):  # safetensors.numpy.load has no BF16
        logical = protocol.SAFETENSORS_DTYPES[t["dtype"]][0]
        out[name] = np.frombuffer(t["data"], dtype=STORAGE_DTYPES.get(logical, logical)).reshape(t["shape"])
    return out["hidden_states"], out["token_ids"], "bfloat16"


def safe_open_procfd(fd: int) -> tuple[np.ndarray, np.ndarray, str]:
    import ml_dtypes  # noqa: F401 - safetensors' numpy bf16 needs it registered
    from safetensors import safe_open

    with safe_open(f"/proc/self/fd/{fd}", framework="numpy") as f:
        return f.get_tensor("hidden_states"), f.get_tensor("token_ids"), "bfloat16"


VARIANTS = {
    "client": read_hidden_states_fd,
    "mmap_view": functools.partial(read_hidden_states_fd, map_file=True),
    "safetensors_bytes": safetensors_bytes,
    "safe_open_procfd": safe_open_procfd,
}


def one_pass(paths: list[str], read, check: bool) -> float:
    """Seconds to read (and check, if ``check``) every file once."""
    t0 = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            hidden, tokens, dtype = read(fd)
        finally:
            os.close(fd)
        assert tokens.shape[0] == hidden.shape[0]
        if check:
            assert all_finite(hidden.view(np.uint16), "bfloat16")
        del hidden, tokens
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 files, 3 rounds")
    ap.add_argument("--files", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = ap.parse_args()
    files = args.files or (2 if args.quick else 8)
    rounds = args.rounds or (3 if args.quick else 7)
    layers, hidden = 4, 4096
    file_bytes = args.tokens * (layers * hidden * 2 + 8)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-server-files-") as tmp:
        paths = [os.path.join(tmp, f"cmpl-{i}.safetensors") for i in range(files)]
        print(f"writing {files} files of {file_bytes / 2**20:.0f} MiB in {tmp} ...", file=sys.stderr)
        for i, p in enumerate(paths):
            write_file(p, args.tokens, layers, hidden, i)
        total = sum(os.path.getsize(p) for p in paths)
        res: dict[str, list[float]] = {f"{k}{m}": [] for k in VARIANTS for m in ("", "_read_only")}
        names = list(VARIANTS)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                for mode, check in (("", True), ("_read_only", False)):
                    one_pass(paths[:1], VARIANTS[name], check)
                    res[f"{name}{mode}"].append(total / one_pass(paths, VARIANTS[name], check) / 1e9)
            print(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in res.items()) + " GB/s",
                  file=sys.stderr)  # fmt: skip
    out: dict[str, object] = {f"{k}_gbps": round(statistics.median(v), 3) for k, v in res.items()}
    for k in res:
        base = "mmap_view_read_only" if k.endswith("_read_only") else "mmap_view"
        if k != base:
            ratios = [a / b for a, b in zip(res[k], res[base], strict=True)]
            out[f"{k}_over_mmap_view"] = round(statistics.median(ratios), 3)
    out.update(
        file_mib=round(file_bytes / 2**20, 1),
        files=files,
        rounds=rounds,
        load_average=round(os.getloadavg()[0], 1),
        machine=f"{platform.machine()} {os.cpu_count()} cpus, numpy {np.__version__}",
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
