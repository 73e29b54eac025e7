"""Iteration-level scheduler (continuous batching, Orca, Yu et al., OSDI 2022) with chunked
prefill, prefix-cache hits and preemption by recompute or swap, and the one writer of request
progress after each step (``update_from_output``: computed tokens, sampled tokens, forks,
beams, stops, frees).

Each step forms a new batch under two bounds: the running requests' sequences fit in
``max_num_seqs`` (a request counts n, or its beam width) and at most ``max_num_batched_tokens``
tokens are computed. Running requests go first, in admission order; then swapped-out requests
come back (oldest first) before any new request is admitted; then waiting requests are admitted
first-come-first-served while blocks and budget last. When a running request cannot get its
blocks, the newest running request is preempted with all its sequences: swapped to host memory
(``preemption_mode="swap"``, if the host pool has room) or freed and re-prefilled later
(``"recompute"``, reusing whatever the prefix cache still holds).

With ``itl_target_ms`` set, prompt tokens get only what is left of a time budget once the
decoding sequences are in (times the ratio of sequences waiting for a first token to those
decoding, when they are more): Sarathi-Serve's stall-free batching (Agrawal et al., OSDI
2024, §4.2), with the token budget derived from the latency target by the engine's own recent
step times (``StepCost``) instead of an offline profile, since on a CPU the cost per token
moves with the machine, the dtype and whatever else runs on the cores.
"""

from __future__ import annotations

import bisect
import logging
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from pagedserve.config import SchedulerConfig
from pagedserve.core.block_manager import NULL_BLOCK, BlockManager, OpenRowOps, cdiv
from pagedserve.sequence import Request, Sequence, SequenceStatus

if TYPE_CHECKING:
    from pagedserve.output_processor import OutputProcessor
    from pagedserve.sampler import SampledRows, SamplerOutput
    from pagedserve.stats import StatsTracker

logger = logging.getLogger("pagedserve")

# Makes a request's next sequence: (request, index, token ids) -> Sequence.
NewSequence = Callable[[Request, int, list[int]], Sequence]
# Finishes a request whose handling raised, with that error.
Fail = Callable[[Request, BaseException], None]


class ScheduledChunk(NamedTuple):
    """A sequence and how many of its tokens this step computes."""

    seq: Sequence
    num_tokens: int


@dataclass
class SchedulerOutput:
    """One step's batch: each scheduled sequence with the number of tokens it computes, and
    the block copies the runner performs first (swap out, swap in, copy-on-write)."""

    scheduled: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    open_rows: OpenRowOps = field(default_factory=OpenRowOps)
    # rows that end a sequence (its last token and drafts), and every other row (prompt or
    # recompute tokens): what StepCost learns from
    num_decode_rows: int = 0
    num_prefill_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in
                    or self.open_rows)


MAX_ERROR_CHARS = 300  # of a grammar engine's error, in a request's error message
# Under an ITL target a step still computes this many prompt tokens, so prompts keep moving
# however slow the decodes alone are.
MIN_PREFILL_TOKENS = 16


class StepCost:
    """Recent step times, for the prompt-token budget under ``itl_target_ms``: the median
    time of the last ``window`` decode-only steps (seconds) and the median cost per prompt
    token (seconds) of the last ``window`` steps with at least MIN_PREFILL_TOKENS of them, net
    of the decode estimate when the step also decoded. Medians, so one slow step (a garbage
    collection, a neighbour's burst) does not move the budget."""

    def __init__(self, window: int = 16):
        self.decode_s: deque[float] = deque(maxlen=window)
        self.token_s: deque[float] = deque(maxlen=window)

    def observe(self, num_decode_rows: int, num_prefill_tokens: int, seconds: float) -> None:
        if num_prefill_tokens == 0:
            if num_decode_rows:
                self.decode_s.append(seconds)
        elif num_prefill_tokens >= MIN_PREFILL_TOKENS:
            base = statistics.median(self.decode_s) if num_decode_rows and self.decode_s else 0
            self.token_s.append(max(seconds - base, 0.0) / num_prefill_tokens)

    def prefill_budget(self, target_s: float) -> int | None:
        """Prompt tokens that fit beside the decodes in ``target_s`` seconds, at least
        MIN_PREFILL_TOKENS; None until both estimates exist."""
        if not self.decode_s or not self.token_s:
            return None
        per_token = statistics.median(self.token_s)
        spare = target_s - statistics.median(self.decode_s)
        if per_token <= 0:
            return None
        return max(MIN_PREFILL_TOKENS, int(min(spare / per_token, 2**31)))


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
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: list[Request] = []  # in arrival order
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of which found
        self.step_cost = StepCost()
        self._prefill_left = 0  # prompt tokens the step being scheduled may still take
        self._step_start = 0.0

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_seats(self) -> int:
        return sum(r.max_num_seqs for r in self.running)

    def num_waiting(self, num_new: int = 0) -> tuple[int, int]:
        """(requests waiting now, and after ``num_new`` more arrive), not counting those the
        next step can admit: in queue order, while a seat is free and the free KV blocks hold
        their tokens (on a CPU the cache, not the seats, is what usually runs out)."""
        seats = max(0, self.config.max_num_seqs - self.num_seats())
        bm = self.block_manager
        blocks, groups = bm.num_free_blocks, len(bm.windows)
        admitted = 0
        for request in self.waiting:
            need = sum(groups * cdiv(seq.num_tokens, bm.block_size) for seq in request.live_seqs)
            if admitted == seats or need > blocks:
                break
            blocks -= need
            admitted += 1
        return len(self.waiting) - admitted, len(self.waiting) + num_new - admitted

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
            start = bm.hit_blocks(hits) * bm.block_size if hits else seq.num_computed_tokens
            left = seq.num_tokens - start
            n = min(left, budget)
            if left > 1:  # a prefill chunk (prompt or recompute), not a decode
                n = min(n, self._prefill_left)
                cap = self.config.long_prefill_token_threshold
                if cap and start < seq.num_prompt_tokens:
                    n = min(n, cap)
            if n == left and seq.spec_token_ids:  # the drafts follow the chunk's end
                n = min(left + self._num_drafts(seq), budget)
            if n > 0:
                planned.append((seq, n, hits, left))
                budget -= n
        if request.beam is not None and len(live) > 1:
            complete = len(planned) == len(live) and all(n == left for _, n, _, left in planned)
            if not complete:
                planned = [(s, min(n, left - 1), h, left) for s, n, h, left in planned]
        return [(s, n, h) for s, n, h, _ in planned if n > 0]

    def _num_drafts(self, seq: Sequence) -> int:
        """How many of ``seq``'s drafts may be verified: within max_model_len and max_tokens,
        and, in a quantized cache, within the open block (a rollback past it would have to
        restore the open row it moved on from)."""
        k = min(len(seq.spec_token_ids), self.config.max_model_len - seq.num_tokens,
                seq.request.max_tokens - seq.num_output_tokens - 1)
        bm = self.block_manager
        if bm.open_rows is not None:
            k = min(k, bm.block_size - 1 - (seq.num_tokens - 1) % bm.block_size)
        return max(0, k)

    def _fit(self, request: Request, budget: int) -> list[tuple[Sequence, int, list[int]]]:
        """``_plan``, and if its blocks are not free, the plan without drafts: speculation
        never preempts a request nor keeps one waiting."""
        items = self._plan(request, budget)
        if items and any(s.spec_token_ids for s, _, _ in items) \
                and not self.block_manager.can_allocate(items):
            for s in request.live_seqs:
                s.spec_token_ids = []
            items = self._plan(request, budget)
        return items

    def _allocate(self, items, out: SchedulerOutput) -> None:
        now = time.time()
        bm = self.block_manager
        for seq, _, hits in items:
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
            if hits or (seq.num_computed_tokens == 0 and not seq.block_tables):
                hit_tokens = bm.hit_blocks(hits) * bm.block_size
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += hit_tokens
                if seq.request.metrics.num_preemptions == 0 and seq.index == 0:
                    seq.request.num_cached_tokens = hit_tokens
            if hits:
                # Every sequence's hits are taken before any block is allocated: allocating
                # takes free blocks from the front of the queue, which may hold a sibling's
                # cached hits (siblings under a grammar often have equal blocks).
                bm.take_hits(seq, hits)
        for seq, n, _ in items:
            if seq.num_tokens - seq.num_computed_tokens > 1:
                self._prefill_left -= n
            # the drafts this chunk computes (none unless it reaches the last token)
            del seq.spec_token_ids[max(0, seq.num_computed_tokens + n - seq.num_tokens):]
            ends = max(0, seq.num_computed_tokens + n - seq.num_tokens + 1)  # last token, drafts
            out.num_decode_rows += ends
            out.num_prefill_tokens += n - ends
            bm.allocate(seq, n, [], out.blocks_to_copy)
            out.scheduled.append(ScheduledChunk(seq, n))

    def schedule(self) -> SchedulerOutput:
        self._step_start = time.perf_counter()  # observe_step times the step from here
        out = SchedulerOutput()
        self._schedule(out)
        out.open_rows = self.block_manager.take_open_ops()
        return out

    def observe_step(self, sched: SchedulerOutput) -> None:
        """The step ``sched`` (the last ``schedule()``) is done: its time goes to StepCost
        (only under an ITL target, the one reader of StepCost)."""
        if self.config.itl_target_ms:
            self.step_cost.observe(sched.num_decode_rows, sched.num_prefill_tokens,
                                   time.perf_counter() - self._step_start)

    def _schedule(self, out: SchedulerOutput) -> None:
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        self._prefill_left = budget
        target = self.config.itl_target_ms
        if target:
            seqs = [s for r in self.running for s in r.live_seqs]
            decoding = sum(s.num_computed_tokens >= s.num_tokens - 1 for s in seqs)
            tokens = self.step_cost.prefill_budget(target / 1e3) if decoding else None
            if tokens is not None:
                # Scaled by those waiting for a first token against those decoding: one
                # arrival among many streams may not stall them, but a burst of arrivals
                # beside a few streams gets a budget as many times larger.
                reading = len(self.waiting) + len(seqs) - decoding
                self._prefill_left = tokens * max(reading, decoding) // decoding
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            items = self._fit(request, budget)
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
            return  # memory is short right now: admit nothing new
        while self.swapped:  # swapped requests come back before new ones are admitted
            request = self.swapped[0]
            seqs = request.live_seqs
            if (self.num_seats() + request.max_num_seqs > self.config.max_num_seqs
                    or not bm.can_swap_in(seqs, self.config.max_num_batched_tokens)):
                return
            self.swapped.pop(0)
            out.blocks_to_swap_in += bm.swap_in(seqs)
            for s in seqs:
                s.status = SequenceStatus.RUNNING
            self.running.append(request)
            items = self._fit(request, budget)
            if items and bm.can_allocate(items):
                self._allocate(items, out)
                budget -= sum(n for _, n, _ in items)
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if self.num_seats() + request.max_num_seqs > self.config.max_num_seqs:
                break
            items = self._fit(request, budget)
            if not items or not bm.can_allocate(items):
                break  # FCFS: later requests wait behind the head of the queue
            self.waiting.popleft()
            for s in request.live_seqs:
                s.status = SequenceStatus.RUNNING
            self.running.append(request)
            self._allocate(items, out)
            budget -= sum(n for _, n, _ in items)

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

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop these requests now and free their blocks (unknown ids are ignored)."""
        aborted = [self.requests[i] for i in request_ids if i in self.requests]
        for r in aborted:
            r.finish(SequenceStatus.FINISHED_ABORTED)
        self.finish_requests(aborted)

    def fail_request(self, request: Request, error: BaseException) -> None:
        """Finish ``request`` with ``error`` (``finish_reason="error"``) and free its blocks."""
        logger.error("request %s failed: %s: %s", request.request_id, type(error).__name__,
                     error, exc_info=error)
        request.error = f"{type(error).__name__}: {error}"
        request.finish(SequenceStatus.FINISHED_ERROR)
        self.finish_requests([request])

    def finish_requests(self, requests: list[Request]) -> None:
        """Remove finished or aborted requests from every queue and free all their blocks."""
        for r in requests:
            self.requests.pop(r.request_id, None)
        done = {id(r) for r in requests}
        self.running = [r for r in self.running if id(r) not in done]
        self.swapped = [r for r in self.swapped if id(r) not in done]
        if any(id(r) in done for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if id(r) not in done)
        for r in requests:
            for s in r.seqs:
                self.block_manager.free(s)

    def requests_of_failed_step(self, sched: SchedulerOutput) -> list[Request]:
        """The requests a failed step leaves in doubt: those it scheduled and those it swapped
        out. Blocks registered in the prefix cache this step never received their K/V, so
        their hashes are dropped."""
        requests = {id(s.request): s.request for s, _ in sched.scheduled}
        requests.update((id(r), r) for r in sched.preempted
                        if any(s.status == SequenceStatus.SWAPPED for s in r.seqs))
        for seq, _ in sched.scheduled:
            self.block_manager.forget_uncomputed(seq)
        return list(requests.values())

    def check_invariants(self) -> None:
        """Assert the block pools agree with the live sequences' block tables."""
        requests = [*self.running, *self.waiting, *self.swapped]
        seqs = [q for r in requests for q in r.seqs if not q.is_finished]
        bm = self.block_manager
        bm.pool.check_invariants([t for q in seqs for t in q.block_tables])
        if bm.swap_pool is not None:
            bm.swap_pool.check_invariants([t for q in seqs for t in q.swap_tables])
        for q in seqs:  # a window group holds only the blocks its window reaches
            for g in bm.windowed:
                table = q.block_tables[g] if q.block_tables else []
                first = min(bm.first_needed(bm.windows[g], q.num_computed_tokens), len(table))
                assert all(b == NULL_BLOCK for b in table[:first]), (
                    f"sequence {q.seq_id}: group {g} holds blocks its window passed")

    # ---- after the forward pass: the one writer of request progress -----------------------

    def update_from_output(self, sched: SchedulerOutput) -> None:
        """The scheduled tokens are computed: advance each sequence past them (past its drafts
        too, until ``settle_drafts`` rolls back the rejected ones)."""
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens <= seq.num_tokens:  # a window slides once drafts settle
                self.block_manager.slide(seq)

    def settle_drafts(self, seqs: list[Sequence], samples: list[SampledRows]
                      ) -> list[tuple[Sequence, int, int]]:
        """For each of ``seqs`` that verified drafts this step (its ``spec_token_ids``): the
        drafts accepted are those of its ``samples`` entries but the last. Rolls back the
        rejected drafts' slots (``num_computed_tokens`` moves back; blocks that held only
        rejected drafts return to the pool now), before the accepted ones are appended.
        Returns (sequence, drafts verified, drafts accepted) of the sequences still running."""
        appended = Counter(id(seq) for group in samples for seq, _ in group.rows)
        verified = []
        for seq in seqs:
            k = len(seq.spec_token_ids)
            if not k:
                continue
            seq.spec_token_ids = []
            if seq.is_finished or not appended[id(seq)]:  # failed while sampling: freed
                continue
            accepted = appended[id(seq)] - 1
            seq.num_computed_tokens -= k - accepted
            self.block_manager.trim(seq)
            self.block_manager.slide(seq)
            verified.append((seq, k, accepted))
        return verified

    def fork_parallel(self, rows: list[tuple[Sequence, int]], new_sequence: NewSequence,
                      fail: Fail) -> list[tuple[Sequence, int]]:
        """``rows`` (sequence, logits row) with the n - 1 children of each n > 1 request at
        its first token: they share the parent's blocks and sample from its row."""
        out = []
        for seq, i in rows:
            request = seq.request
            try:
                if request.params.n > 1 and len(request.seqs) == 1 and seq.num_output_tokens == 0:
                    for k in range(1, request.params.n):
                        child = new_sequence(request, k, list(seq.token_ids))
                        child.status = SequenceStatus.RUNNING
                        self.block_manager.fork(seq, child)
                        request.seqs.append(child)
                        out.append((child, i))
            except Exception as e:
                fail(request, e)
                continue
            out.append((seq, i))
        return out

    def append_sampled(self, samples: list[SampledRows],
                       outputs: OutputProcessor, stats: StatsTracker, fail: Fail) -> None:
        """Append each sampled token: metrics, logprobs, stop checks (``outputs``), and the
        sequence's blocks freed when that finished it. A request whose handling raises is
        failed; the others go on."""
        now = time.time()
        for group, out in samples:
            for j, (seq, _) in enumerate(group):
                if seq.is_finished:  # its request failed earlier in this step
                    continue
                try:
                    self._append(seq, out, j, now, outputs, stats)
                except Exception as e:
                    fail(seq.request, e)

    def _append(self, seq: Sequence, out: SamplerOutput, j: int, now: float,
                outputs: OutputProcessor, stats: StatsTracker) -> None:
        token = out.token_ids[j]
        metrics = seq.request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            stats.first_token(metrics, len(seq.request.prompt_token_ids))
        metrics.last_token_time = now
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            raise ValueError(f"the grammar refused token {token}: "
                             f"{seq.matcher.get_error()[:MAX_ERROR_CHARS]}")
        seq.append_token(token)
        stats.num_generation_tokens += 1
        metrics.num_generation_tokens = max(metrics.num_generation_tokens,
                                            seq.num_output_tokens)
        if out.sampled_logprobs is not None and seq.logprobs is not None:
            outputs.record_logprobs(seq, out, j)
        if outputs.check_stop(seq, token):
            self.block_manager.free(seq)

    def step_beams(self, seqs: list[Sequence], rows: list[int], logits: torch.Tensor,
                   new_sequence: NewSequence, stats: StatsTracker, fail: Fail) -> None:
        """The beam search requests among ``seqs`` (their rows of ``logits``: ``rows``)
        select their next beams; a request whose selection raises is failed."""
        requests = {id(s.request): s.request for s in seqs if s.request.beam is not None}
        if not requests:
            return
        row = {id(s): i for s, i in zip(seqs, rows)}
        for request in requests.values():
            if request.is_finished:  # failed earlier in this step
                continue
            try:
                self._step_beams(request, logits[[row[id(b)] for b in request.seqs]],
                                 new_sequence, stats)
            except Exception as e:
                fail(request, e)

    def _step_beams(self, request: Request, logits: torch.Tensor, new_sequence: NewSequence,
                    stats: StatsTracker) -> None:
        """Select the next beams of a beam search request (``logits`` rows in
        ``request.seqs`` order): a beam chosen again is forked (blocks shared), a beam not
        chosen is freed."""
        beams = request.seqs
        chosen = request.beam.step(logits.log_softmax(dim=-1),
                                   [b.output_token_ids for b in beams], beams[0].num_tokens)
        continued = {parent for parent, _ in chosen}
        for i, beam in enumerate(beams):  # first, so the forks never outnumber the beams
            if i not in continued:
                self.block_manager.free(beam)
        next_beams, seen = [], set()
        for parent, token in chosen:  # best first, the order transformers keeps its beams in
            if parent in seen:
                child = new_sequence(request, 0, list(beams[parent].token_ids))
                child.status = SequenceStatus.RUNNING
                self.block_manager.fork(beams[parent], child)
                next_beams.append((child, token))
            else:
                seen.add(parent)
                next_beams.append((beams[parent], token))
        for seq, token in next_beams:  # after the forks copied their parents' tokens
            seq.append_token(token)
        stats.num_generation_tokens += len(next_beams)
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = time.time()
            stats.first_token(metrics, len(request.prompt_token_ids))
        metrics.last_token_time = time.time()
        metrics.num_generation_tokens = max((b.num_output_tokens for b, _ in next_beams),
                                            default=metrics.num_generation_tokens)
        request.seqs = [seq for seq, _ in next_beams]
