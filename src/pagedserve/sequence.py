"""Per-request state: token ids, ``num_computed_tokens``, block table and status.

Invariants: ``token_ids`` = prompt + generated tokens; the K/V of ``token_ids[:num_computed_tokens]``
sit in the slots of ``block_table`` (slot of position p: ``block_table[p // block_size] *
block_size + p % block_size``). A request with ``num_computed_tokens < num_tokens`` still has
tokens to compute (prefill, or re-prefill after preemption); one with exactly one uncomputed token
is decoding.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from pagedserve.outputs import RequestMetrics, SampleLogprobs
from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import IncrementalDetokenizer


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """One request (one sequence: n=1) moving through waiting -> running -> finished.

    ``max_tokens`` is resolved (never None); ``generator`` is set for seeded requests so their
    random draws come from their own stream; ``detokenizer`` is None when the engine runs
    without a tokenizer.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int]
    metrics: RequestMetrics
    detokenizer: IncrementalDetokenizer | None = None
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    # (tokens, characters) already returned in RequestOutputKind.DELTA outputs.
    delta_offsets: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.sampling_params.logprobs is not None:
            self.logprobs = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
