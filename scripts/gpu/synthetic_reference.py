#!/usr/bin/env python
"""A synthetic verifier directory and hidden-state store at a given shape, for a real ``spectrain train``.

Writes ``OUT/verifier`` (a Qwen3 ``config.json`` and ``model.safetensors`` holding random
``embed_tokens``, final ``norm`` and ``lm_head`` in bf16: all ``spectrain train`` reads of a
verifier) and ``OUT/store`` (``--samples`` random samples of ``--tokens`` tokens, layers
2, 18, 33 and 36 at ``--hidden``, bf16). The reference shape (Qwen3-8B) is the default;
``--tiny`` makes a CPU-sized one. Prints one JSON line with the two paths and the bytes written.

At the reference shape it writes 5.2 GB (the heads 2.5, the store 2.7): too much to carry to the
GPU machine (64 MiB), so run_all.sh writes it there, on the host's cores while the GPU parts run.
Nothing random is drawn per element beyond one block per matrix (2 x 622M normals took 43 s of
81 here): the heads are a random block of ``BLOCK_ROWS`` rows tiled, the store one block rolled.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REFERENCE = dict(hidden=4096, vocab=151936, heads=32, kv=8, head_dim=128, inter=12288, layers=36)
TINY = dict(hidden=64, vocab=1024, heads=4, kv=2, head_dim=16, inter=128, layers=36)
LAYER_IDS = (2, 18, 33, 36)
BLOCK_ROWS = 8192


def write_verifier(path: Path, shape: dict, seed: int = 0) -> None:
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "_name_or_path": "synthetic/qwen3",
        "hidden_size": shape["hidden"], "vocab_size": shape["vocab"], "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv"], "head_dim": shape["head_dim"],
        "intermediate_size": shape["inter"], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 40960, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(seed)
    V, H = shape["vocab"], shape["hidden"]

    def matrix() -> torch.Tensor:
        block = (torch.randn(min(V, BLOCK_ROWS), H, generator=g) * 0.02).to(torch.bfloat16)
        return block.repeat(-(-V // block.shape[0]), 1)[:V].contiguous()

    save_file({
        "model.embed_tokens.weight": matrix(),
        "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
        "lm_head.weight": matrix(),
    }, str(path / "model.safetensors"))  # fmt: skip


def write_store(path: Path, verifier: Path, hidden: int, samples: int, tokens: int, vocab: int) -> int:
    """``samples`` samples: one block of normal bf16 states rolled by a random offset per sample
    (drawing 4 x hidden normals per token for each sample would take longer than writing them)."""
    from hsgen.store import HiddenStateStore, StoreHeader
    from hsgen.store.header import LOGICAL_DTYPES

    header = StoreHeader(verifier=str(verifier), layer_ids=LAYER_IDS, hidden_size=hidden, dtype="bfloat16")
    store = HiddenStateStore.create(path, header)
    rng = np.random.default_rng(0)
    block = rng.standard_normal((tokens, header.num_layers, hidden), dtype=np.float32)
    block = block.astype(LOGICAL_DTYPES["bfloat16"]).view(header.storage_dtype)
    written = 0
    with store.writer("synthetic") as w:
        for i in range(samples):
            states = np.roll(block, int(rng.integers(0, tokens)), axis=0)
            ids = rng.integers(0, vocab, tokens, dtype=np.int64)
            mask = (rng.random(tokens) < 0.6).astype(np.uint8)
            w.add(f"r{i:05d}", states, ids, mask)
            written += states.nbytes
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per sample")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized shape (hidden 64, vocab 1024)")
    args = ap.parse_args()
    shape = TINY if args.tiny else REFERENCE
    t0 = time.perf_counter()
    write_verifier(args.out / "verifier", shape)
    nbytes = write_store(args.out / "store", args.out / "verifier", shape["hidden"], args.samples, args.tokens,
                         min(shape["vocab"], 32000))  # fmt: skip
    print(f"synthetic reference written in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(json.dumps({"verifier": str(args.out / "verifier"), "store": str(args.out / "store"),
                      "hidden_bytes": int(nbytes), "tokens": args.samples * args.tokens,
                      "seconds": round(time.perf_counter() - t0, 1)}))  # fmt: skip


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
