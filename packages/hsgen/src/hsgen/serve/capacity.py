"""A time model that makes the reference server spend time like a GPU doing prefill.

On a laptop the tiny model runs in microseconds, which hides every queueing effect the
client's saturation logic must handle. With a :class:`CapacityModel` each forward step
lasts at least ``step_overhead_s + prefill_tokens / prefill_tokens_per_s`` (plus
``decode_step_s`` when it carries decode tokens), and at most ``max_concurrent_seqs``
sequences run at once: the rest wait, as in vLLM's scheduler.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CapacityModel:
    """A GPU's prefill throughput and concurrency, for benchmarks.

    Attributes:
        prefill_tokens_per_s: prompt tokens one step processes per second.
        max_concurrent_seqs: sequences that may run in one step (caps ``--max-num-seqs``).
        step_overhead_s: fixed cost of every forward step (kernel launches, scheduling).
        decode_step_s: extra cost of a step that generates tokens for running sequences.
        kv_cache_tokens: tokens the simulated KV cache holds (``vllm:kv_cache_usage_perc``);
            None = ``max_concurrent_seqs * max_model_len``.
        write_bytes_per_s: storage speed: writing a file of N bytes takes at least
            ``N / write_bytes_per_s`` seconds, with its lock held (None = as fast as the disk).
    """

    prefill_tokens_per_s: float = 50_000.0
    max_concurrent_seqs: int = 64
    step_overhead_s: float = 0.002
    decode_step_s: float = 0.01
    kv_cache_tokens: int | None = None
    write_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0:
            raise ValueError(f"capacity prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}")
        if self.max_concurrent_seqs < 1:
            raise ValueError(f"capacity max_concurrent_seqs must be >= 1, got {self.max_concurrent_seqs}")
        if self.step_overhead_s < 0 or self.decode_step_s < 0:
            raise ValueError("capacity step_overhead_s and decode_step_s must be >= 0")
        if self.write_bytes_per_s is not None and self.write_bytes_per_s <= 0:
            raise ValueError(f"capacity write_bytes_per_s must be > 0, got {self.write_bytes_per_s}")

    def write_seconds(self, nbytes: int) -> float:
        """Simulated minimum duration of writing one file of ``nbytes``."""
        return nbytes / self.write_bytes_per_s if self.write_bytes_per_s else 0.0

    def step_seconds(self, prefill_tokens: int, decode_seqs: int = 0) -> float:
        """Simulated duration of one forward step."""
        t = self.step_overhead_s + prefill_tokens / self.prefill_tokens_per_s
        if decode_seqs:
            t += self.decode_step_s
        return t

    @classmethod
    def parse(cls, text: str) -> CapacityModel:
        """Parse ``"prefill_tokens_per_s=20000,max_concurrent_seqs=8"`` (short keys
        ``tokens_per_s``, ``max_seqs``, ``overhead``, ``decode`` also work)."""
        aliases = {
            "tokens_per_s": "prefill_tokens_per_s",
            "max_seqs": "max_concurrent_seqs",
            "overhead": "step_overhead_s",
            "decode": "decode_step_s",
            "write_bytes_per_s": "write_bytes_per_s",
        }
        kwargs: dict[str, float | int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = aliases.get(key.strip(), key.strip())
            if not sep or key not in cls.__dataclass_fields__:
                raise ValueError(
                    f"capacity setting {part!r}: expected one of {sorted(cls.__dataclass_fields__)}=VALUE"
                )
            try:
                kwargs[key] = (
                    int(value) if key in ("max_concurrent_seqs", "kv_cache_tokens") else float(value)
                )
            except ValueError:
                raise ValueError(f"capacity setting {part!r}: {value!r} is not a number") from None
        return cls(**kwargs)  # type: ignore[arg-type]

    def to_text(self) -> str:
        """The inverse of :meth:`parse`."""
        return ",".join(f"{k}={v}" for k, v in asdict(self).items() if v is not None)
