"""Engine statistics, gathered in one place after each step.

``StatsTracker.record_step`` is the only code that reads the scheduler and the block pool for
statistics; what it gathers leaves as ``EngineStats`` (the server's Prometheus metrics read
only that) and as ``KVCacheStats`` (``LLM.kv_cache_stats()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagedserve.core.block_manager import NULL_BLOCK, BlockManager
from pagedserve.core.scheduler import Scheduler
from pagedserve.kv.spec import KVLayout
from pagedserve.outputs import KVCacheStats, KVGroupStats, RequestMetrics, RequestOutput
from pagedserve.spec_decode import SpecDecodeStats


@dataclass
class FinishedRequestStats:
    """Latencies (seconds) of a request that finished: arrival to its end, arrival to its
    first token and mean time per output token after the first (None where not defined)."""

    e2e_latency: float | None
    ttft: float | None
    tpot: float | None
    failed: bool


@dataclass
class EngineStats:
    """A snapshot after a step: gauges now, counters since start, and the requests that got
    their first token (``ttfts``, seconds) or finished since the previous snapshot."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    kv_group_used_blocks: list[int] = field(default_factory=list)  # per KV group
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding: its counters
    ttfts: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatsTracker:
    """Counts per step what the KV cache and the batch did."""

    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, block_size: int,
                 kv_bytes_per_token: int, layout: KVLayout, debug_checks: bool = False,
                 spec=None):
        self.scheduler = scheduler
        self.spec = spec  # a SpecDecoder, whose counters the snapshots copy
        self.layout = layout
        self.block_manager = block_manager
        self.block_size = block_size
        self.kv_bytes_per_token = kv_bytes_per_token
        self.debug_checks = debug_checks
        self.num_prompt_tokens = 0  # prompts of requests that produced a first token
        self.num_generation_tokens = 0  # tokens sampled (every sequence, every beam)
        self.peak_used_blocks = 0
        self.kv_token_utilization = 0.0
        self.max_num_running = 0
        self._block_steps = [0, 0]  # sums over steps of (physical, logical) blocks in use
        self._slot_steps = [0, 0]  # sums over steps of (slots holding K/V, slots reserved)
        self._peak_reserved = (0, 0.0)  # (reserved slots, utilization) at the peak
        # Per-request events are kept only once someone takes snapshots (the server), so an
        # offline run does not accumulate them.
        self.collect_events = False
        self._ttfts: list[float] = []
        self._finished: list[FinishedRequestStats] = []

    # ---- events -----------------------------------------------------------------------------

    def first_token(self, metrics: RequestMetrics, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens += num_prompt_tokens
        if self.collect_events:
            self._ttfts.append(metrics.first_token_time - metrics.arrival_time)

    def finished(self, outputs: list[RequestOutput]) -> None:
        if not self.collect_events:
            return
        for out in outputs:
            m = out.metrics
            if not out.finished or m is None:
                continue
            generated = m.num_generation_tokens
            tpot = None
            if m.first_token_time is not None and m.last_token_time is not None \
                    and generated > 1:
                tpot = (m.last_token_time - m.first_token_time) / (generated - 1)
            self._finished.append(FinishedRequestStats(
                e2e_latency=None if m.finished_time is None else m.finished_time - m.arrival_time,
                ttft=m.time_to_first_token, tpot=tpot, failed=out.error is not None))

    def record_step(self) -> None:
        """Block and slot usage of the batch just run (O(batch), not O(blocks))."""
        pool = self.block_manager.pool
        live = [s for r in self.scheduler.running for s in r.live_seqs]
        self.max_num_running = max(self.max_num_running, len(self.scheduler.running))
        bs = self.block_size
        # Slots holding K/V: the used blocks are exactly the running sequences' blocks, all
        # full but the last of each table; a shared last block counts once, at its fullest.
        short: dict[int, int] = {}  # last block -> empty slots in it
        for s in live:
            for table in s.block_tables:
                if table:
                    b = table[-1]
                    empty = len(table) * bs - s.num_computed_tokens
                    short[b] = min(short.get(b, bs), empty)
        filled = bs * pool.num_used_blocks - sum(short.values())
        if self.debug_checks:
            held: dict[int, int] = {}
            for s in live:
                for table in s.block_tables:
                    for i, b in enumerate(table):
                        if b != NULL_BLOCK:
                            held[b] = max(held.get(b, 0),
                                          min(bs, s.num_computed_tokens - i * bs))
            assert filled == sum(held.values()), (filled, sum(held.values()))
        reserved = bs * getattr(self.block_manager, "num_reserved_blocks", pool.num_used_blocks)
        self._slot_steps[0] += filled
        self._slot_steps[1] += reserved
        if reserved > self._peak_reserved[0]:
            self._peak_reserved = (reserved, filled / reserved)
        used = pool.num_used_blocks
        self._block_steps[0] += used
        self._block_steps[1] += sum(len(t) - t.count(NULL_BLOCK)
                                    for s in live for t in s.block_tables)
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used
            self.kv_token_utilization = filled / (used * bs)

    # ---- snapshots --------------------------------------------------------------------------

    def snapshot(self) -> EngineStats:
        """The stats now; the first tokens and finished requests since the last snapshot."""
        self.collect_events = True
        sched, pool = self.scheduler, self.block_manager.pool
        stats = EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped),
            kv_cache_usage=pool.num_used_blocks / pool.num_blocks,
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits, num_preemptions=sched.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            kv_group_used_blocks=self._group_used_blocks(),
            spec_decode=None if self.spec is None else replace(
                self.spec.stats, accepted_per_pos=list(self.spec.stats.accepted_per_pos)),
            ttfts=self._ttfts, finished=self._finished)
        self._ttfts, self._finished = [], []
        return stats

    def _group_used_blocks(self) -> list[int]:
        used = self.block_manager.pool.used_by_tag
        return [used.get(g, 0) for g in range(len(self.layout.groups))]

    def kv_cache_stats(self) -> KVCacheStats:
        bm = self.block_manager
        pool = bm.pool
        physical, logical = self._block_steps
        return KVCacheStats(
            num_blocks=pool.num_blocks, block_size=self.block_size,
            num_free_blocks=pool.num_free_blocks - pool.num_cached_blocks,
            num_used_blocks=pool.num_used_blocks,
            peak_used_blocks=max(self.peak_used_blocks, pool.peak_used),
            num_preemptions=self.scheduler.num_preemptions,
            kv_token_utilization=self.kv_token_utilization,
            kv_bytes_per_token=self.kv_bytes_per_token,
            num_cached_blocks=pool.num_cached_blocks,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            num_swapped_out_blocks=bm.num_swapped_out_blocks,
            num_swapped_in_blocks=bm.num_swapped_in_blocks,
            kv_sharing_saving=1 - physical / logical if logical else 0.0,
            reserved_slot_utilization=(self._slot_steps[0] / self._slot_steps[1]
                                       if self._slot_steps[1] else 0.0),
            reserved_slot_utilization_at_peak=self._peak_reserved[1],
            peak_reserved_slots=self._peak_reserved[0],
            max_num_running=self.max_num_running,
            kv_groups=self._group_stats(),
        )

    def _group_stats(self) -> list[KVGroupStats]:
        layout = self.layout
        num_layers = sum(len(g.layers) for g in layout.groups)
        slot_bytes = self.kv_bytes_per_token // num_layers * layout.slots
        return [KVGroupStats(g.window, g.layers, slot_bytes, n)
                for g, n in zip(layout.groups, self._group_used_blocks())]
