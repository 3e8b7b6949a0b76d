"""Prometheus text exposition (format 0.0.4) without a client library.

Counters and histograms are updated on the server's event loop; gauges (running/waiting requests,
KV pool use) and the prefix cache's figures (hit rate, evictions, host tier) are read from the
engine when /metrics is scraped.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{str(v)}"'.replace("\n", " ") for k, v in sorted(labels.items()))
    return "{" + inner + "}"


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * (len(buckets) + 1)  # last: +Inf only
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {self.sum:.6f}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class Metrics:
    PREFIX = "ktlite_"

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.start_time = time.time()
        self.requests: dict[tuple[str, str], int] = defaultdict(int)  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.aborted = 0
        self.in_flight = 0  # requests the server has accepted and not yet finished
        p = self.PREFIX
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time from request arrival to the first output token.", TTFT_BUCKETS)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between consecutive output tokens of a request.", ITL_BUCKETS)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Time from request arrival to its last token.", E2E_BUCKETS)

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, str(status))] += 1

    def render(self, engine) -> str:
        p = self.PREFIX
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[dict[str, str], float]]) -> None:
            out.append(f"# HELP {p}{name} {help_}")
            out.append(f"# TYPE {p}{name} {kind}")
            for labels, value in samples:
                out.append(f"{p}{name}{_labels(labels)} {value:g}" if isinstance(value, float) else
                           f"{p}{name}{_labels(labels)} {value}")

        metric("requests_total", "counter", "HTTP requests by endpoint and status code.",
               [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())])
        metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [({}, self.prompt_tokens)])
        metric("generation_tokens_total", "counter", "Generated tokens.", [({}, self.generation_tokens)])
        metric("aborted_requests_total", "counter", "Requests aborted because the client went away.", [({}, self.aborted)])
        for h in (self.ttft, self.itl, self.e2e):
            out.extend(h.render())
        sched = engine.scheduler
        pool = engine.runtime.runner.kv_pool
        metric("num_running_requests", "gauge", "Requests in the running batch.", [({}, sched.num_running)])
        metric("num_waiting_requests", "gauge", "Requests waiting to be scheduled.", [({}, sched.num_waiting)])
        metric("num_in_flight_requests", "gauge", "Requests accepted by the HTTP server and not finished.",
               [({}, self.in_flight)])
        metric("kv_pool_used_tokens", "gauge", "KV pool token slots in use.", [({}, pool.used_tokens)])
        metric("kv_pool_total_tokens", "gauge", "KV pool token slots in all (--max-total-tokens).", [({}, pool.num_slots)])
        metric("kv_pool_usage", "gauge", "Fraction of the KV pool in use.",
               [({}, float(pool.used_tokens / pool.num_slots if pool.num_slots else 0.0))])
        metric("preemptions_total", "counter", "Requests preempted because the KV pool was full.",
               [({}, getattr(sched, "preemptions", 0))])
        if sched.speculation is not None:
            self._render_speculation(metric, sched)
        cache = sched.cache
        if cache is not None:
            self._render_cache(metric, cache)
        metric("info", "gauge", "Served model.", [({"model": self.model_name}, 1)])
        return "\n".join(out) + "\n"

    @staticmethod
    def _render_speculation(metric, sched) -> None:
        metric("spec_draft_tokens_total", "counter", "Draft tokens verified by the model (--speculative-algorithm).",
               [({}, sched.drafted_tokens)])
        metric("spec_accepted_tokens_total", "counter", "Draft tokens the model accepted.", [({}, sched.accepted_tokens)])
        metric("spec_accept_rate", "gauge", "Fraction of verified draft tokens accepted.",
               [({}, float(sched.accepted_tokens / sched.drafted_tokens if sched.drafted_tokens else 0.0))])

    @staticmethod
    def _render_cache(metric, cache) -> None:
        st = cache.stats
        metric("cache_hit_rate", "gauge", "Fraction of admitted requests' tokens served from the prefix cache.",
               [({}, float(st.hit_tokens / st.query_tokens if st.query_tokens else 0.0))])
        metric("prefix_cache_query_tokens_total", "counter", "Tokens of admitted requests looked up in the prefix cache.",
               [({}, st.query_tokens)])
        metric("prefix_cache_hit_tokens_total", "counter", "Tokens served from the prefix cache instead of prefilled.",
               [({}, st.hit_tokens)])
        metric("prefix_cache_evicted_tokens_total", "counter", "Prefix-cache tokens evicted from the KV pool to make room.",
               [({}, st.evicted_tokens)])
        metric("prefix_cache_tokens", "gauge", "KV pool slots indexed by the prefix cache.", [({}, cache.device_tokens)])
        if cache.host is not None:
            metric("host_cache_tokens", "gauge", "Tokens held in the host-memory tier (--hicache-size).",
                   [({}, cache.host_tokens)])
            metric("host_cache_saved_tokens_total", "counter", "Tokens copied to the host-memory tier.",
                   [({}, st.host_saved_tokens)])
            metric("host_cache_loaded_tokens_total", "counter",
                   "Tokens copied back from the host-memory tier instead of recomputed.", [({}, st.host_loaded_tokens)])
