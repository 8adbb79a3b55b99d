"""A closer look at a store: length and loss-mask statistics, and one sample token by token.

:func:`store_details` reads the manifests and every live shard's ``loss_mask`` array (zarr,
one small array per shard; no hidden state is read). :func:`show_sample` reads one sample
and decodes its tokens with the verifier's tokenizer.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hsgen.store.store import HiddenStateStore

log = logging.getLogger(__name__)

LENGTH_EDGES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
"""Upper bounds (inclusive) of the token-length histogram's bins; longer samples fall in a last bin."""


def _shard_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(FileNotFoundError):  # deleted by gc meanwhile
                total += os.stat(os.path.join(root, f)).st_size
    return total


def _loss_mask(shard_dir: Path) -> np.ndarray:
    import zarr
    from zarr.storage import LocalStore

    return np.asarray(
        zarr.open_array(store=LocalStore(shard_dir, read_only=True), path="loss_mask", mode="r")[:]
    )


def length_histogram(lengths: np.ndarray) -> list[dict[str, int]]:
    """Counts per bin ``(lo, hi]`` of :data:`LENGTH_EDGES`, trimmed to the bins that hold samples."""
    bins, lo = [], 0
    top = int(lengths.max()) if lengths.size else 0
    for hi in LENGTH_EDGES:
        bins.append({"min": lo + 1, "max": hi, "samples": int(((lengths > lo) & (lengths <= hi)).sum())})
        lo = hi
        if hi >= top:
            break
    if top > LENGTH_EDGES[-1]:
        bins.append({"min": lo + 1, "max": top, "samples": int((lengths > lo).sum())})
    while len(bins) > 1 and bins[0]["samples"] == 0:
        bins.pop(0)
    return bins


@dataclass
class _Group:
    samples: int = 0
    tokens: int = 0
    trained: int = 0
    shards: set[str] = field(default_factory=set)
    bytes: int = 0


def store_details(store: HiddenStateStore) -> dict[str, Any]:
    """Token lengths, loss-mask coverage and the split over writers and shards of ``store``.

    Returns a JSON-ready dict: ``samples``, ``tokens``, ``trained_tokens``, ``loss_mask_coverage``
    (trained / all tokens), ``samples_without_loss`` (mask all zero: they teach nothing),
    ``length`` (min, mean, p50, p90, p99, max), ``length_histogram``, ``writers`` and ``shards``
    (samples, tokens, trained tokens, bytes on disk each). A duplicated sample id counts once.
    """
    by_shard: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for sid in store.sample_ids():
        rec = store.record(sid)
        by_shard[rec.shard].append((rec.offset, rec.length))
    lengths, trained = [], []
    shards: dict[str, _Group] = {}
    writers: dict[str, _Group] = defaultdict(_Group)
    for name in sorted(by_shard):
        rows = by_shard[name]
        mask = _loss_mask(store.path / name)
        g = shards[name] = _Group(shards={name}, bytes=_shard_bytes(store.path / name))
        for offset, length in rows:
            t = int(mask[offset : offset + length].sum())
            lengths.append(length)
            trained.append(t)
            g.samples += 1
            g.tokens += length
            g.trained += t
        w = writers[Path(name).parts[1] if len(Path(name).parts) > 2 else name]
        w.samples += g.samples
        w.tokens += g.tokens
        w.trained += g.trained
        w.shards.add(name)
        w.bytes += g.bytes
    ln = np.asarray(lengths, dtype=np.int64)
    tr = np.asarray(trained, dtype=np.int64)
    tokens = int(ln.sum())

    def pct(q: float) -> int:
        return int(np.percentile(ln, q, method="nearest")) if ln.size else 0

    def group(g: _Group) -> dict[str, Any]:
        return {"samples": g.samples, "tokens": g.tokens, "trained_tokens": g.trained, "bytes": g.bytes}

    return {
        "path": str(store.path),
        "samples": int(ln.size),
        "tokens": tokens,
        "trained_tokens": int(tr.sum()),
        "loss_mask_coverage": float(tr.sum() / tokens) if tokens else 0.0,
        "samples_without_loss": int((tr == 0).sum()),
        "length": {
            "min": int(ln.min()) if ln.size else 0,
            "mean": float(ln.mean()) if ln.size else 0.0,
            "p50": pct(50),
            "p90": pct(90),
            "p99": pct(99),
            "max": int(ln.max()) if ln.size else 0,
        },
        "length_histogram": length_histogram(ln),
        "writers": {k: {**group(v), "shards": len(v.shards)} for k, v in sorted(writers.items())},
        "shards": {k: group(v) for k, v in shards.items()},
    }


def _to_float32(hidden: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        import ml_dtypes

        return hidden.view(ml_dtypes.bfloat16).astype(np.float32)
    return hidden.astype(np.float32)


def load_tokenizer(store: HiddenStateStore, tokenizer: str | None, revision: str | None = None):
    """``(tokenizers.Tokenizer or None, note)``: ``tokenizer`` (a directory or hub id), else the
    store header's verifier when it names a local directory or a cached hub model.

    The note says where the tokenizer came from, or why there is none, and warns when its
    fingerprint differs from the one recorded in the store header.
    """
    from hsgen.hf.hub import HubError, resolve

    source = tokenizer or store.header.verifier
    try:
        path = resolve(source, revision=revision, need="tokenizer")
    except HubError as e:
        if tokenizer:
            raise
        return None, f"no tokenizer ({e}); pass --tokenizer"
    try:
        from tokenizers import Tokenizer

        from hsgen.inputs.render import ChatRenderer, RenderConfig

        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        fingerprint = ChatRenderer(RenderConfig(tokenizer_path=str(path))).fingerprint
    except ImportError:
        return None, "no tokenizer: decoding needs the render extra (pip install 'hsgen[render]')"
    except Exception as e:  # a broken tokenizer file: show the ids anyway
        return None, f"no tokenizer ({path}: {e})"
    note = f"tokenizer {source}"
    recorded = store.header.tokenizer_fingerprint
    if recorded and fingerprint != recorded:
        note += f" (WARNING: fingerprint {fingerprint[:12]} differs from the store's {recorded[:12]})"
    return tok, note


def show_sample(
    store: HiddenStateStore, sample_id: str, tokenizer: Any = None, *, verify: bool = True
) -> dict[str, Any]:
    """One sample: record, tokens (decoded with ``tokenizer`` when given), mask, per-layer norms.

    Returns a JSON-ready dict with ``tokens``: one ``{"i", "id", "text", "mask", "norms"}`` per
    token (``norms``: the L2 norm of the token's hidden state in each stored layer), and
    ``layers``: per layer id the mean, min and max norm over the sample.

    Raises:
        KeyError: the id is not in the store.
        StoreError: with ``verify``, a checksum mismatch.
    """
    rec = store.record(sample_id)
    sample = store.read(sample_id, verify=verify)
    hidden = _to_float32(sample.hidden_states, sample.dtype)  # [T, layers, H]
    norms = np.linalg.norm(hidden, axis=-1)  # [T, layers]
    ids = [int(t) for t in sample.token_ids]
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in ids] if tokenizer is not None else None
    tokens = [
        {
            "i": i,
            "id": t,
            **({"text": texts[i]} if texts is not None else {}),
            "mask": int(sample.loss_mask[i]),
            "norms": [round(float(x), 4) for x in norms[i]],
        }
        for i, t in enumerate(ids)
    ]
    layers = {
        str(lid): {
            "mean": float(norms[:, k].mean()),
            "min": float(norms[:, k].min()),
            "max": float(norms[:, k].max()),
        }
        for k, lid in enumerate(store.header.layer_ids)
    }
    return {
        "sample_id": sample_id,
        "shard": rec.shard,
        "offset": rec.offset,
        "length": rec.length,
        "checksum": rec.checksum,
        "verified": verify,
        "trained_tokens": int(sample.loss_mask.sum()),
        "layer_ids": list(store.header.layer_ids),
        "layers": layers,
        "text": tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else None,
        "tokens": tokens,
    }
