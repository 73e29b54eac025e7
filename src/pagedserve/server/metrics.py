"""Prometheus metrics of the server, with vLLM's metric names under a ``pagedserve:`` prefix.

Updated in the engine thread after every step from the engine's ``EngineStats`` snapshot, the
only thing they read (so the values agree with ``kv_cache_stats``); each server has its own
registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedserve.stats import EngineStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                    160.0, 320.0, 640.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5, 5.0, 10.0)


class ServerMetrics:
    """The gauges, counters and histograms; ``update`` is the AsyncEngine's step hook."""

    def __init__(self, model_name: str, kv_groups: list | None = None):
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagedserve:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagedserve:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"pagedserve:{name}", doc, labels, buckets=buckets,
                             registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting.")
        self.num_requests_swapped = gauge("num_requests_swapped",
                                          "Requests preempted to host memory.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc",
                                         "Share of KV blocks in use (1 = all).")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Preemptions (recompute or swap).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = counter("request_success", "Requests that finished.")
        self.request_failure = counter("request_failure",
                                       "Requests the engine failed on (finish_reason error).")
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Arrival to first token.", _LATENCY_BUCKETS)
        self.time_per_output_token = histogram("time_per_output_token_seconds",
                                               "Mean time between output tokens of a request.",
                                               _TPOT_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Arrival to finish.", _LATENCY_BUCKETS)
        # per KV group (kv_cache_stats().kv_groups): a hybrid model's sliding-window groups
        # hold only their window's blocks, so their usage differs from the global layers'
        group_blocks = Gauge("pagedserve:kv_group_used_blocks",
                             "KV blocks in use per KV group of layers (a block holds "
                             "kv_cache_stats' layers of its group).",
                             ["model_name", "group", "attention"], registry=r)
        self.kv_group_used_blocks = [
            group_blocks.labels(model_name, str(i), "full" if g.window is None
                                else f"sliding_window_{g.window}")
            for i, g in enumerate(kv_groups or [])]
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts",
                                              "Verifications of drafts (speculative decoding).")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens",
                                                    "Draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                                       "Draft tokens accepted.")
        self._per_pos = Counter("pagedserve:spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted at each position of a draft (0: first).",
                                ["model_name", "position"], registry=r)
        self._model_name = model_name
        self._last = {"queries": 0, "hits": 0, "preemptions": 0, "prompt": 0, "generation": 0,
                      "drafts": 0, "draft_tokens": 0, "accepted": 0}

    def _advance(self, counter: Counter, key: str, total: int) -> None:
        if total > self._last[key]:
            counter.inc(total - self._last[key])
        self._last[key] = total

    def update(self, stats: EngineStats) -> None:
        """Move every metric to ``stats`` (the engine's snapshot after a step)."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_requests_swapped.set(stats.num_swapped)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        for gauge, used in zip(self.kv_group_used_blocks, stats.kv_group_used_blocks):
            gauge.set(used)
        self._advance(self.prefix_cache_queries, "queries", stats.prefix_cache_queries)
        self._advance(self.prefix_cache_hits, "hits", stats.prefix_cache_hits)
        self._advance(self.num_preemptions, "preemptions", stats.num_preemptions)
        self._advance(self.prompt_tokens, "prompt", stats.num_prompt_tokens)
        self._advance(self.generation_tokens, "generation", stats.num_generation_tokens)
        spec = stats.spec_decode
        if spec is not None:
            self._advance(self.spec_decode_num_drafts, "drafts", spec.num_drafts)
            self._advance(self.spec_decode_num_draft_tokens, "draft_tokens",
                          spec.num_draft_tokens)
            self._advance(self.spec_decode_num_accepted_tokens, "accepted",
                          spec.num_accepted_tokens)
            for i, total in enumerate(spec.accepted_per_pos):
                key = f"pos{i}"
                self._last.setdefault(key, 0)
                self._advance(self._per_pos.labels(self._model_name, str(i)), key, total)
        for ttft in stats.ttfts:
            self.time_to_first_token.observe(ttft)
        for done in stats.finished:
            if done.failed:
                self.request_failure.inc()
                continue
            self.request_success.inc()
            if done.e2e_latency is not None:
                self.e2e_request_latency.observe(done.e2e_latency)
            if done.tpot is not None:
                self.time_per_output_token.observe(done.tpot)
