"""Iteration-level scheduler (continuous batching, Orca, Yu et al., OSDI 2022) with chunked prefill.

Each step forms a new batch under two bounds: at most ``max_num_seqs`` running requests and at
most ``max_num_batched_tokens`` tokens. Running requests go first, in admission order (a decode
costs one token, an unfinished prefill takes what the budget leaves); then waiting requests are
admitted first-come-first-served while blocks and budget last. A prompt longer than the budget
is prefilled in chunks over several steps. When a running request needs a block and none is
free, the newest running request is preempted by recompute: its blocks are freed and it goes
back to the front of the waiting queue, to be re-prefilled (prompt + generated tokens) later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedserve.config import SchedulerConfig
from pagedserve.core.block_manager import BlockManager
from pagedserve.sequence import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """One step's batch: each scheduled request with the number of tokens it computes."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting and running queues and the block manager."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(request, n):
                victim = self.running.pop()  # newest admitted
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, n))
                budget -= n
                i += 1
        # Admit new work only in a step without preemption: memory is short right now.
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.block_manager.allocate_slots(request, n):
                break  # FCFS: later requests wait behind the head of the queue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, n))
            budget -= n
        return out

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish_requests(self, requests: list[Request]) -> None:
        """Remove finished (or aborted) requests from the queues and free their blocks now."""
        done = {id(r) for r in requests}
        self.running = [r for r in self.running if id(r) not in done]
        if any(r in self.waiting for r in requests):
            self.waiting = deque(r for r in self.waiting if id(r) not in done)
        for r in requests:
            self.block_manager.free(r)
