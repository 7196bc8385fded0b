"""The server's metrics in Prometheus's text format (``GET /metrics``), through the official
``prometheus-client``; names follow vLLM's (``vllm:`` there, ``llm:`` here), so dashboards built
for one read the other.

Each app has a registry of its own (two servers in one process do not share counts).
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: Histogram buckets, in seconds: time to first token and request latency span a prefill of a few
#: milliseconds to a queue wait of minutes; a step between tokens spans 1 ms to a second.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1)


class Metrics:
    """What ``/metrics`` reports.

    Args:
        running: how many sequences the engine decodes now (read at each scrape; 0 before the
            model is loaded); waiting: how many wait for a slot.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, running: Callable[[], int], waiting: Callable[[], int]):
        self.registry = r = CollectorRegistry()
        Gauge("llm:num_requests_running", "Sequences decoding now.", registry=r).set_function(running)
        Gauge("llm:num_requests_waiting", "Sequences waiting for a slot.", registry=r).set_function(waiting)
        self.responses = Counter("llm:http_responses", "Completion requests answered, by route and HTTP status.",
                                 ["route", "status"], registry=r)
        self.finished = Counter("llm:request_success", "Sequences finished, by finish reason.",
                                ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("llm:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.cached_tokens = Counter("llm:prompt_tokens_cached", "Prompt tokens taken from the prefix cache.",
                                     registry=r)
        self.generation_tokens = Counter("llm:generation_tokens", "Tokens generated.", registry=r)
        self.draft_tokens = Counter("llm:spec_decode_num_draft_tokens", "Draft tokens proposed by speculating "
                                    "rows (prompt lookup or a draft model), verified in the batch's steps.", registry=r)
        self.accepted_tokens = Counter("llm:spec_decode_num_accepted_tokens", "Draft tokens accepted: each one a "
                                       "token gained without a step of its own.", registry=r)
        self.time_to_first_token = Histogram("llm:time_to_first_token_seconds", "From a request's arrival to its "
                                             "first token.", buckets=LATENCY_BUCKETS, registry=r)
        self.time_per_output_token = Histogram("llm:time_per_output_token_seconds", "Between a sequence's "
                                               "tokens after its first.", buckets=STEP_BUCKETS, registry=r)
        self.latency = Histogram("llm:e2e_request_latency_seconds", "From a request's arrival to its last token.",
                                 buckets=LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        """The metrics in Prometheus's text exposition format."""
        return generate_latest(self.registry)


class RequestClock:
    """The timings of one request's sequences, reported to :class:`Metrics` as tokens arrive."""

    def __init__(self, metrics: Metrics, sequences: int):
        self.metrics, self.start = metrics, time.perf_counter()
        self.last: list[float | None] = [None] * sequences
        self.first_seen = False

    def tokens(self, i: int, count: int) -> None:
        """Sequence ``i`` got ``count`` new tokens now."""
        if not count:
            return
        now = time.perf_counter()
        if not self.first_seen:
            self.first_seen = True
            self.metrics.time_to_first_token.observe(now - self.start)
        if self.last[i] is not None:
            step = (now - self.last[i]) / count
            for _ in range(count):
                self.metrics.time_per_output_token.observe(step)
        self.last[i] = now
        self.metrics.generation_tokens.inc(count)

    def finished(self, reason: str) -> None:
        self.metrics.finished.labels(finished_reason=reason).inc()

    def done(self, prompt_tokens: int, cached_tokens: int, draft_tokens: int = 0, accepted_tokens: int = 0) -> None:
        """Every sequence finished."""
        self.metrics.latency.observe(time.perf_counter() - self.start)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.cached_tokens.inc(cached_tokens)
        self.metrics.draft_tokens.inc(draft_tokens)
        self.metrics.accepted_tokens.inc(accepted_tokens)
