"""Online and mixed training data: read what a store holds, fetch the rest from vLLM ahead of the trainer.

:class:`OnlineSource` is a :class:`spectrain.data.sources.SampleSource`. Its epoch plan comes from the
prompt files (stable ids, the same split and shuffle as offline training). For each planned
sample it reads the offline store when the sample is there (the store may still be filling:
another ``hsgen generate`` can be writing into it), and otherwise asks the vLLM servers for
the hidden states through :class:`hsgen.client.fetch.HiddenStateClient`, on a background asyncio
thread, a bounded window ahead of the trainer. With ``delete_consumed`` (the default
``persist_fetched``), a fetched sample is read once, from the server's file straight into its
batch, and held until its step completes; otherwise (or with ``persist_fetched=True``) fetched
samples are committed to a scratch store (``/dev/shm`` when it fits) and read back like cached
ones, so the trainer never sees a half-written sample.

It is ``hsgen generate`` (prompt -> request -> file -> shard -> manifest) plus the loader
(shard -> batch): the units are named for what they hold (``prompts``, ``fetcher``, ``landing``,
``stores``, ``ledger``, ``reading``, ``retention``, ``run_lease``) and ``source`` wires them;
see docs/design.md.

Scratch space (held samples and scratch shards) stays under ``scratch_bytes`` with
``delete_consumed``: a held sample is released, and a generated shard deleted once every sample
in it was consumed, i.e. once the optimizer step that used them completed. Samples of the user's offline store are never deleted unless ``delete_cached`` is
set. After a crash, anything deleted but not covered by the last checkpoint is simply fetched
again on resume (the plan position the trainer resumes from is the first ``get``).
"""

from spectrain.online.config import OnlineConfig
from spectrain.online.metrics import OnlineMetrics
from spectrain.online.scratch import PER_SAMPLE_OVERHEAD, SCRATCH_MARKER, choose_scratch_dir, dir_bytes
from spectrain.online.source import OnlineSource

__all__ = [
    "OnlineConfig",
    "OnlineMetrics",
    "OnlineSource",
    "choose_scratch_dir",
    "dir_bytes",
    "PER_SAMPLE_OVERHEAD",
    "SCRATCH_MARKER",
]
