"""Hugging Face model ids where a local model directory is expected.

``--tokenizer``, ``--verifier`` and ``hsgen serve --model`` take a directory or a hub id such
as ``Qwen/Qwen3-8B``. An id is resolved by ``huggingface_hub`` into its local cache
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), cache first:
files already cached for the revision are used without asking the hub; with
``HF_HUB_OFFLINE=1`` nothing else is tried. Only the files a command reads are fetched:

- ``tokenizer``: the config, tokenizer and chat-template files;
- ``heads``: those, the safetensors index and only the shards that hold the embeddings, the
  final norm and the LM head (what ``spectrain train`` reads of a verifier);
- ``full``: every config, tokenizer and safetensors file (a server or ``spectrain eval``
  running the whole model).

The result is the snapshot directory (``.../models--org--name/snapshots/<commit>``), which
reads like any local model directory. No torch here.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

HUB_HINT = "pip install huggingface_hub"

TOKENIZER_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
"""Read by renderers and the verifier's config readers; the first and tokenizer.json are required."""
_REQUIRED = ("config.json", "tokenizer.json")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")


class HubError(ValueError):
    """A model id that cannot be resolved (not cached offline, unknown, or no hub client)."""


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set to a true value, read at call time."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return True
    return False


def cache_dir() -> Path:
    """The hub cache as ``huggingface_hub`` lays it out, from the environment at call time."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def looks_like_hub_id(name: str) -> bool:
    """``org/name`` or ``name`` that is not an existing path (and has no path-only syntax)."""
    if not name or Path(name).exists() or name.startswith((".", "/", "~")):
        return False
    return bool(_ID.match(name)) and "//" not in name


def head_tensor_files(weight_map: dict[str, str]) -> list[str]:
    """Shards of a safetensors index that hold the embeddings, the final norm and the LM head.

    The same tensors ``spectrain.models.verifier`` reads (:func:`hsgen.hf.head_tensors.head_tensor_names`);
    raises :class:`HubError` when the index has no embeddings or no final norm beside them.
    """
    from hsgen.hf.head_tensors import HeadTensorError, head_tensor_names

    try:
        heads = head_tensor_names(weight_map)
    except HeadTensorError as e:
        raise HubError(f"{INDEX}: {e}") from None
    return sorted({weight_map[n] for n in heads.all()})


def _client():
    try:
        import huggingface_hub
    except ImportError:
        raise HubError(f"a Hugging Face model id needs huggingface_hub: {HUB_HINT}") from None
    return huggingface_hub


def _download(repo: str, filename: str, revision: str | None, *, required: bool) -> Path | None:
    """One file: from the cache if there, else (online) from the hub; None if absent and optional."""
    hub = _client()
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    cache = cache_dir()
    try:
        return Path(
            hub.hf_hub_download(repo, filename, revision=revision, cache_dir=cache, local_files_only=True)
        )
    except LocalEntryNotFoundError:
        pass
    except EntryNotFoundError:  # cached knowledge that the file does not exist
        if required:
            raise HubError(f"{repo}: has no {filename} (revision {revision or 'main'})") from None
        return None
    if offline():
        if required:
            raise HubError(
                f"{repo}: {filename} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set "
                f"(download it once online, e.g. `hf download {repo} {filename}`, or pass a local directory)"
            )
        return None
    try:
        return Path(hub.hf_hub_download(repo, filename, revision=revision, cache_dir=cache))
    except RepositoryNotFoundError:
        raise HubError(
            f"{repo}: no such model on the Hugging Face hub (or no access: set HF_TOKEN)"
        ) from None
    except EntryNotFoundError:
        if required:
            raise HubError(f"{repo}: has no {filename} (revision {revision or 'main'})") from None
        return None
    except (OSError, ValueError) as e:  # connection and HTTP errors of the hub client
        raise HubError(f"{repo}/{filename}: download failed ({e})") from None


def _fetch_all(repo: str, names: Iterable[str], revision: str | None, required: Iterable[str] = ()) -> Path:
    need = set(required)
    snapshot: Path | None = None
    for name in names:
        got = _download(repo, name, revision, required=name in need)
        if got is not None:
            snapshot = got.parent
    if snapshot is None:
        raise HubError(f"{repo}: none of {sorted(names)} found")
    return snapshot


def config_file(name: str, *, revision: str | None = None, download: bool = True) -> Path | None:
    """The ``config.json`` of hub id ``name``: from the cache, else (``download``, and not offline)
    from the hub; None when ``name`` is no hub id or the file cannot be had (no error: a caller
    asking only for a model's shape goes on without it)."""
    if not looks_like_hub_id(name):
        return None
    try:
        hub = _client()
        if not download:
            return Path(hub.hf_hub_download(name, "config.json", revision=revision, cache_dir=cache_dir(),
                                            local_files_only=True))  # fmt: skip
        return _download(name, "config.json", revision, required=False)
    except Exception as e:  # not cached, unknown, no access, no network: the shape is learnt elsewhere
        log.debug("%s: no config.json (%s)", name, e)
        return None


def resolve(name_or_path: str | os.PathLike, *, revision: str | None = None, need: str = "tokenizer") -> Path:
    """A local directory for ``name_or_path``: itself when it is one, else the hub snapshot.

    Args:
        name_or_path: a directory, or a model id like ``Qwen/Qwen3-8B``.
        revision: branch, tag or commit (default ``main``); only for model ids.
        need: ``"tokenizer"``, ``"heads"`` or ``"full"`` (see the module docstring).

    Raises:
        HubError: a path that does not exist and is no valid id, an id that is not cached
            while offline, a missing file, or no ``huggingface_hub``.
    """
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if not looks_like_hub_id(text):
        raise HubError(f"{text}: no such directory (and not a Hugging Face model id like org/name)")
    if need not in ("tokenizer", "heads", "full"):
        raise ValueError(f"need must be tokenizer, heads or full, got {need!r}")
    try:
        snapshot = _fetch_all(text, TOKENIZER_FILES, revision, required=_REQUIRED)
    except HubError as e:
        raise HubError(f"{e} ({text} is no local directory either)") from None
    if need == "tokenizer":
        return snapshot
    index = _download(text, INDEX, revision, required=False)
    if index is None:
        _download(text, SINGLE, revision, required=True)
        return snapshot
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError) as e:
        raise HubError(f"{index}: not a safetensors index ({e})") from None
    shards = sorted(set(weight_map.values())) if need == "full" else head_tensor_files(weight_map)
    for shard in shards:
        _download(text, shard, revision, required=True)
    log.info("%s (%s): %d of %d weight files in %s", text, revision or "main", len(shards),
             len(set(weight_map.values())), snapshot)  # fmt: skip
    return snapshot
