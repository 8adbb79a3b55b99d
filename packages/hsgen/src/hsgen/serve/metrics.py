"""``GET /metrics``: the vLLM Prometheus metrics the client and benchmarks read.

Names, types and labels follow vLLM's V1 metrics (counters get the ``_total`` suffix in
the exposition, as prometheus_client writes them): ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (0..1),
``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:request_success_total``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hsgen.serve.state import ServerState


def _labels(**labels: str) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return "{" + inner + "}"


def render_metrics(state: ServerState) -> str:
    """The Prometheus text exposition of the server's current state."""
    cfg = state.config
    model = cfg.model_name.replace("\\", "\\\\").replace('"', '\\"')
    base = {"engine": "0", "model_name": model}
    stats = state.engine.stats if state.engine is not None else None
    running = stats.running if stats else 0
    waiting = stats.waiting if stats else 0
    cap_seqs = state.engine.seq_cap if state.engine is not None else cfg.max_num_seqs
    kv_tokens = (cfg.capacity.kv_cache_tokens if cfg.capacity else None) or cap_seqs * state.max_model_len
    kv_usage = min(1.0, (stats.running_tokens if stats else 0) / max(1, kv_tokens))
    lines: list[str] = []

    def family(name: str, kind: str, help_: str, samples: list[tuple[str, dict[str, str], float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for sample_name, labels, value in samples:
            lines.append(f"{sample_name}{_labels(**labels)} {float(value)}")

    family(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        [("vllm:num_requests_running", base, running)],
    )
    family(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        [("vllm:num_requests_waiting", base, waiting)],
    )
    family(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        [("vllm:kv_cache_usage_perc", base, kv_usage)],
    )
    family(
        "vllm:prompt_tokens",
        "counter",
        "Number of prefill tokens processed.",
        [("vllm:prompt_tokens_total", base, stats.prompt_tokens_total if stats else 0)],
    )
    family(
        "vllm:generation_tokens",
        "counter",
        "Number of generation tokens processed.",
        [("vllm:generation_tokens_total", base, stats.generation_tokens_total if stats else 0)],
    )
    finished = stats.finished if stats else {}
    family(
        "vllm:request_success",
        "counter",
        "Count of successfully processed requests.",
        [
            ("vllm:request_success_total", {**base, "finished_reason": r}, finished.get(r, 0))
            for r in ("stop", "length", "abort")
        ],
    )
    family(
        "hsgen:engine_steps",
        "counter",
        "Forward steps run (each batches every running sequence).",
        [("hsgen:engine_steps_total", base, stats.steps_total if stats else 0)],
    )
    family(
        "hsgen:engine_busy_seconds",
        "counter",
        "Seconds spent running forward steps (the rest of the time the engine waited for work).",
        [("hsgen:engine_busy_seconds_total", base, stats.busy_seconds_total if stats else 0.0)],
    )
    writer = state.writer
    family(
        "hsgen:hidden_states_writes_inflight",
        "gauge",
        "Hidden-state files promised and not yet written.",
        [("hsgen:hidden_states_writes_inflight", base, writer.inflight if writer else 0)],
    )
    family(
        "hsgen:hidden_states_files_written",
        "counter",
        "Hidden-state files written.",
        [("hsgen:hidden_states_files_written_total", base, writer.files_written if writer else 0)],
    )
    return "\n".join(lines) + "\n"
