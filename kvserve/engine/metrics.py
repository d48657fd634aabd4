"""Per-request latency metrics from the engine's monotonic timestamps (vLLM's definitions)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one timestamp per output token
    num_prompt_tokens: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival (tokenization included)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        end = self.finished_time if self.finished_time is not None else (self.token_times[-1] if self.token_times else None)
        return None if end is None else end - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (e2e - TTFT) / (n - 1)."""
        n = self.num_output_tokens
        if n < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive token events."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def output_tokens_per_s(self) -> float | None:
        e2e = self.e2e
        return None if not e2e else self.num_output_tokens / e2e

    def as_dict(self) -> dict:
        return {
            "ttft_s": self.ttft,
            "tpot_s": self.tpot,
            "e2e_s": self.e2e,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "output_tokens_per_s": self.output_tokens_per_s,
        }
