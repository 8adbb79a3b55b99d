"""Test helpers: a Hugging Face cache laid out by hand, and a model split into shards."""

from __future__ import annotations

from pathlib import Path


def lay_out_hub_cache(cache: Path, repo_id: str, files: dict[str, bytes], *, commit: str = "0" * 40,
                      ref: str = "main") -> Path:  # fmt: skip
    """Write ``files`` into ``cache`` exactly as huggingface_hub lays out a download.

    ``models--org--name/blobs/<sha256>`` holds each file's bytes,
    ``snapshots/<commit>/<name>`` is a relative symlink to its blob and ``refs/<ref>`` names
    the commit. Returns the snapshot directory.
    """
    import hashlib
    import os

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snap


def sharded_model_files(model_dir: Path) -> dict[str, bytes]:
    """A model directory's files with its weights split like a big checkpoint: the decoder layers
    in ``model-00001-of-00002.safetensors``, embeddings, final norm and LM head in ``...00002...``,
    plus ``model.safetensors.index.json``."""
    import json

    from safetensors import safe_open
    from safetensors.numpy import save

    with safe_open(str(model_dir / "model.safetensors"), framework="np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    parts: dict[str, dict] = {n: {} for n in names}
    weight_map = {}
    for k, v in tensors.items():
        fname = names[0] if ".layers." in k else names[1]
        parts[fname][k] = v
        weight_map[k] = fname
    files = {
        p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file() and p.suffix != ".safetensors"
    }
    files.update({n: save(t) for n, t in parts.items()})
    files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    return files
