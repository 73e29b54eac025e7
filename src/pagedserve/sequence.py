"""Per-request and per-sequence state.

A ``Request`` is what a user sent: one prompt and its parameters. It owns one or more
``Sequence``s: one for n=1, n after the first sampled token for parallel sampling (forked from
the prompt's sequence, sharing its blocks), up to beam_width live beams for beam search.

Invariants of a Sequence: ``token_ids`` = prompt + generated tokens; ``block_tables`` has one
table per KV group (kv/spec.py ``KVLayout``), or none before the first allocation; in every
group the K/V of ``token_ids[:num_computed_tokens]`` sit in the slots of its table (position p
at ``table[p // block_size] * block_size + p % block_size``), except that a sliding-window
group's entries the window no longer reaches are ``NULL_BLOCK``; ``block_hashes[i]`` is the
prefix-cache hash of full block i of ``token_ids``; the first ``num_cached_blocks`` entries of
every table are registered in the prefix cache (null ones excepted). While swapped out,
``swap_tables`` holds the host blocks and ``block_tables`` is empty. Draft tokens
(``spec_token_ids``) are computed after ``token_ids`` in a step that verifies them; only
those the target accepts join ``token_ids``, and the slots of the others are rolled back.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.outputs import Logprob, RequestMetrics, SampleLogprobs
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from pagedserve.beam_search import BeamSearchState


class SequenceStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Sequence:
    """One token stream of a request, the unit that owns a block table."""

    seq_id: int
    request: Request
    index: int
    token_ids: list[int]
    detokenizer: IncrementalDetokenizer | None = None
    seed: int | None = None  # a seeded request's sequence_seed (sampler.py)
    num_computed_tokens: int = 0
    block_tables: list[list[int]] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    swap_tables: list[list[int]] = field(default_factory=list)
    # A quantized cache's open-block rows (kv/quant.py), device and host; -1: none held.
    open_row: int = -1
    host_open_row: int = -1
    status: SequenceStatus = SequenceStatus.WAITING
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float = 0.0
    # (tokens, characters) already returned in RequestOutputKind.DELTA outputs.
    delta_offsets: tuple[int, int] = (0, 0)
    # Speculative decoding: the draft tokens proposed to follow ``token_ids`` (not part of
    # them until verified), and the drafter's per-sequence state (acceptance history).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_state: Any = None
    # With structured outputs: the grammar matcher (llguidance) that has consumed this
    # sequence's output tokens; it survives preemption, since those tokens stay.
    matcher: Any = None

    @property
    def block_table(self) -> list[int]:
        """The first KV group's table (a model with one kind of attention has only it)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


@dataclass(eq=False)
class Request:
    """A prompt with its parameters and its sequences.

    ``max_tokens`` is resolved (never None). ``root_hash`` seeds the prefix-cache hash chain of
    this request's blocks; it depends on the ``cache_salt`` so that different salts never
    share blocks. ``beam`` is the beam-search state for beam requests, else None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    max_tokens: int
    eos_token_ids: frozenset[int]
    metrics: RequestMetrics
    root_hash: bytes = b""
    arrival_index: int = 0
    seqs: list[Sequence] = field(default_factory=list)
    beam: BeamSearchState | None = None
    num_cached_tokens: int = 0
    # With params.prompt_logprobs: one entry per prompt token, None for the first (and for
    # positions not computed yet).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False  # a DELTA stream sends them once
    error: str | None = None  # why the request failed (finish_reason "error")
    grammar: Any = None  # structured outputs: the compiled Grammar its sequences follow
    bad_words_ids: list[list[int]] = field(default_factory=list)  # SamplingParams.bad_words

    @property
    def max_num_seqs(self) -> int:
        """Sequences this request may run at once: n, or the beam width."""
        if isinstance(self.params, BeamSearchParams):
            return self.params.beam_width
        return self.params.n

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def is_finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return bool(self.seqs) and all(s.is_finished for s in self.seqs)

    def finish(self, status: SequenceStatus) -> None:
        """End every live sequence with ``status`` (aborted, failed); frees are the
        scheduler's."""
        for s in self.live_seqs:
            s.status = status
        if self.beam is not None:
            self.beam.done = True
        self.metrics.finished_time = time.time()
