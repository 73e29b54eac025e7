"""Iteration-level scheduler (continuous batching, Orca, Yu et al., OSDI 2022) with chunked
prefill, prefix-cache hits and preemption by recompute or swap.

Each step forms a new batch under two bounds: the running requests' sequences fit in
``max_num_seqs`` (a request counts n, or its beam width) and at most ``max_num_batched_tokens``
tokens are computed. Running requests go first, in admission order; then swapped-out requests
come back (oldest first) before any new request is admitted; then waiting requests are admitted
first-come-first-served while blocks and budget last. When a running request cannot get its
blocks, the newest running request is preempted with all its sequences: swapped to host memory
(``preemption_mode="swap"``, if the host pool has room) or freed and re-prefilled later
(``"recompute"``, reusing whatever the prefix cache still holds).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from pagedserve.config import SchedulerConfig
from pagedserve.core.block_manager import BlockManager
from pagedserve.sequence import Request, Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """One step's batch: each scheduled sequence with the number of tokens it computes, and
    the block copies the runner performs first (swap out, swap in, copy-on-write)."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in)


class Scheduler:
    """Owns the waiting, running and swapped queues and the block manager."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 preemption_mode: str = "recompute"):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', "
                             f"got {preemption_mode!r}")
        self.config = config
        self.block_manager = block_manager
        self.preemption_mode = preemption_mode
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []  # in arrival order
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of which found

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_seats(self) -> int:
        return sum(r.max_num_seqs for r in self.running)

    def _plan(self, request: Request, budget: int) -> list[tuple[Sequence, int, list[int]]]:
        """(sequence, tokens to compute, prefix hits) for the request's live sequences within
        ``budget``. A beam search request computes the last token of all its beams in one step
        (their logits are compared), so a partial step stops each beam one token short."""
        bm = self.block_manager
        live = request.live_seqs
        planned = []  # (seq, n, hits, tokens left to compute)
        for seq in live:
            if budget <= 0:
                break
            hits = bm.find_cached_prefix(seq)
            start = len(hits) * bm.block_size if hits else seq.num_computed_tokens
            left = seq.num_tokens - start
            n = min(left, budget)
            if n > 0:
                planned.append((seq, n, hits, left))
                budget -= n
        if request.beam is not None and len(live) > 1:
            complete = len(planned) == len(live) and all(n == left for _, n, _, left in planned)
            if not complete:
                planned = [(s, min(n, left - 1), h, left) for s, n, h, left in planned]
        return [(s, n, h) for s, n, h, _ in planned if n > 0]

    def _allocate(self, items, out: SchedulerOutput) -> None:
        for seq, n, hits in items:
            if hits or (seq.num_computed_tokens == 0 and not seq.block_table):
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += len(hits) * self.block_manager.block_size
                if seq.request.metrics.num_preemptions == 0 and seq.index == 0:
                    seq.request.num_cached_tokens = len(hits) * self.block_manager.block_size
            self.block_manager.allocate(seq, n, hits, out.blocks_to_copy)
            out.scheduled.append((seq, n))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            items = self._plan(request, budget)
            while items and not bm.can_allocate(items):
                victim = self.running.pop()  # newest admitted
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                self._allocate(items, out)
                budget -= sum(n for _, n, _ in items)
                i += 1
                continue
            break
        if out.preempted:
            return out  # memory is short right now: admit nothing new
        while self.swapped:  # swapped requests come back before new ones are admitted
            request = self.swapped[0]
            seqs = request.live_seqs
            if (self.num_seats() + request.max_num_seqs > self.config.max_num_seqs
                    or not bm.can_swap_in(seqs)):
                return out
            self.swapped.pop(0)
            out.blocks_to_swap_in += bm.swap_in(seqs)
            for s in seqs:
                s.status = SequenceStatus.RUNNING
            self.running.append(request)
            items = self._plan(request, budget)
            if items and bm.can_allocate(items):
                self._allocate(items, out)
                budget -= sum(n for _, n, _ in items)
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if self.num_seats() + request.max_num_seqs > self.config.max_num_seqs:
                break
            items = self._plan(request, budget)
            if not items or not bm.can_allocate(items):
                break  # FCFS: later requests wait behind the head of the queue
            self.waiting.popleft()
            for s in request.live_seqs:
                s.status = SequenceStatus.RUNNING
            self.running.append(request)
            self._allocate(items, out)
            budget -= sum(n for _, n, _ in items)
        return out

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        seqs = request.live_seqs
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(request)
        if self.preemption_mode == "swap":
            pairs = self.block_manager.swap_out(seqs)
            if pairs is not None:
                out.blocks_to_swap_out += pairs
                for s in seqs:
                    s.status = SequenceStatus.SWAPPED
                keys = [r.arrival_index for r in self.swapped]
                self.swapped.insert(bisect.bisect(keys, request.arrival_index), request)
                return
        for s in seqs:  # recompute (also the fallback when the host pool is full)
            self.block_manager.free(s)
            s.num_computed_tokens = 0
            s.status = SequenceStatus.WAITING
        self.waiting.appendleft(request)

    def finish_sequence(self, seq: Sequence) -> None:
        """Free a finished sequence's blocks now (its request may still run)."""
        self.block_manager.free(seq)

    def finish_requests(self, requests: list[Request]) -> None:
        """Remove finished or aborted requests from every queue and free all their blocks."""
        done = {id(r) for r in requests}
        self.running = [r for r in self.running if id(r) not in done]
        self.swapped = [r for r in self.swapped if id(r) not in done]
        if any(id(r) in done for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if id(r) not in done)
        for r in requests:
            for s in r.seqs:
                self.block_manager.free(s)
