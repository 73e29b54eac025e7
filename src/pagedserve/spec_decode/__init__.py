"""Speculative decoding: drafts proposed after each step, verified in the next.

After a step, ``SpecDecoder.propose`` gives each decoding sequence up to
``num_speculative_tokens`` drafts (``Sequence.spec_token_ids``). The scheduler computes them
after the sequence's last token within the token budget (core/scheduler.py), the runner returns
the target's logits at every drafted position (runner.py), the sampler accepts a prefix of the
drafts so that the output follows the target's distribution exactly (sampler.py,
spec_decode/verify.py), and the scheduler rolls back the rejected drafts' slots
(``Scheduler.settle_drafts``). Drafters: ``ngram`` (prompt lookup), ``suffix`` (suffix
decoding), ``draft_model`` (a smaller model).

Speculation costs compute (every draft is scored) to save weight reads (one forward for several
tokens), so it backs off where that trade loses: per sequence after verifications that accept
nothing; per step to DRAFT_TOKEN_BUDGET drafts, given to the sequences whose drafts were
accepted most; and for the whole batch above ``disable_by_batch_size`` sequences, where decode
is no longer bound by reading the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.config import SpeculativeConfig

if TYPE_CHECKING:
    from pagedserve.sequence import Request, Sequence

# Most draft tokens one step verifies, given first to the sequences whose drafts were
# accepted most: every draft adds a row to every matmul, and past about this many rows a
# decode step stops being bound by reading the weights (benchmarks/speculative.py).
DRAFT_TOKEN_BUDGET = 16
# A sequence whose drafts were all rejected this many verifications in a row pauses drafting
# for PAUSE_STEPS steps, doubling with each further miss up to MAX_PAUSE_STEPS.
MISSES_BEFORE_PAUSE = 3
PAUSE_STEPS = 4
MAX_PAUSE_STEPS = 64


@dataclass
class DraftState:
    """A sequence's drafting budget: ``k`` drafts next time; ``misses`` verifications in a
    row that accepted none; ``pause`` steps left without drafts."""

    k: int
    misses: int = 0
    pause: int = 0
    rate: float = 0.5  # accepted / drafted, averaged over recent verifications

    def update(self, drafted: int, accepted: int, max_k: int) -> None:
        """Grow the budget while every draft is accepted, shrink it to one past the accepted
        ones otherwise, and pause after repeated misses."""
        self.rate = 0.7 * self.rate + 0.3 * accepted / drafted
        self.k = min(max_k, 2 * drafted) if accepted == drafted else max(1, accepted + 1)
        self.misses = self.misses + 1 if accepted == 0 else 0
        if self.misses >= MISSES_BEFORE_PAUSE:
            self.pause = min(MAX_PAUSE_STEPS, PAUSE_STEPS << (self.misses - MISSES_BEFORE_PAUSE))


@dataclass
class SpecDecodeStats:
    """Counters since start, as vLLM's ``spec_decode`` metrics: verifications that had drafts
    (``num_drafts``), draft tokens verified and accepted, and accepted drafts per position
    (``accepted_per_pos[i]``: verifications whose draft i + 1 was accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying step: the accepted drafts plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecDecoder:
    """Proposes drafts and keeps the acceptance statistics. ``draft_runner``: for
    ``draft_model``, the draft model's proposer (spec_decode/draft_model.py)."""

    def __init__(self, config: SpeculativeConfig, draft_runner: Any = None):
        self.config = config
        self.draft_token_budget = DRAFT_TOKEN_BUDGET
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        if config.method == "ngram":
            from pagedserve.spec_decode.ngram import NgramProposer

            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif config.method == "suffix":
            from pagedserve.spec_decode.suffix import SuffixProposer

            self.proposer = SuffixProposer(
                config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
        else:
            self.proposer = draft_runner

    def propose(self, running: list[Request], finished: list[Request] = ()) -> None:
        """Set the drafts of every decoding sequence of ``running`` for the next step (none
        above ``disable_by_batch_size`` sequences, for beam search, or while paused), after
        the outputs of the requests just ``finished`` joined the suffix drafter's memory."""
        if hasattr(self.proposer, "add_output"):
            for r in finished:
                for s in r.seqs:
                    self.proposer.add_output(s.output_token_ids)
        seqs = [s for r in running for s in r.live_seqs]
        for s in seqs:
            s.spec_token_ids = []
        limit = self.config.disable_by_batch_size
        wanted: list[tuple[Sequence, int]] = []
        if limit and len(seqs) > limit:
            seqs = []
        for seq in seqs:
            if seq.request.beam is not None or seq.num_computed_tokens != seq.num_tokens - 1:
                continue
            state = seq.spec_state
            if state is None:
                state = seq.spec_state = DraftState(self.config.num_speculative_tokens)
            if state.pause:
                state.pause -= 1
                continue
            wanted.append((seq, state.k))
        if hasattr(self.proposer, "propose_batch"):  # a draft model: the budget first (its
            wanted = self._within_budget(wanted)      # drafts cost forwards); it also frees
            drafts = self.proposer.propose_batch(wanted)  # the mirrors of the others
        else:  # free to propose: the budget goes to drafts that exist
            drafts = [self.proposer.propose(seq.token_ids, k) for seq, k in wanted]
            wanted = self._within_budget([(s, len(d)) for (s, _), d in zip(wanted, drafts)])
            drafts = [d[:k] for (_, k), d in zip(wanted, drafts)]
        for (seq, _), d in zip(wanted, drafts):
            seq.spec_token_ids = d

    def _within_budget(self, wanted: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """``wanted`` (sequence, drafts) cut to DRAFT_TOKEN_BUDGET drafts in all, the
        sequences whose drafts were accepted most keeping theirs; the order is kept."""
        left = self.draft_token_budget
        if sum(k for _, k in wanted) <= left:
            return wanted
        cut = [0] * len(wanted)
        for i in sorted(range(len(wanted)), key=lambda i: -wanted[i][0].spec_state.rate):
            cut[i] = min(wanted[i][1], left)
            left -= cut[i]
        return [(seq, k) for (seq, _), k in zip(wanted, cut)]

    def observe(self, verified: list[tuple[Sequence, int, int]]) -> None:
        """Count each (sequence, drafts verified, drafts accepted) and adapt its budget."""
        st = self.stats
        for seq, drafted, accepted in verified:
            st.num_drafts += 1
            st.num_draft_tokens += drafted
            st.num_accepted_tokens += accepted
            for i in range(accepted):
                st.accepted_per_pos[i] += 1
            if seq.spec_state is not None:
                seq.spec_state.update(drafted, accepted, self.config.num_speculative_tokens)


def make_spec_decoder(args: Any, engine: Any) -> SpecDecoder | None:
    """The engine's SpecDecoder from ``args.speculative_config`` (None without one); a draft
    model is loaded on the engine's device and dtype."""
    config = args.spec_config
    if config is None:
        return None
    draft = None
    if config.method == "draft_model":
        from pagedserve.spec_decode.draft_model import DraftModelProposer

        sched = engine.scheduler_config
        # at most DRAFT_TOKEN_BUDGET sequences draft in one step
        seqs = min(sched.max_num_seqs, config.disable_by_batch_size or sched.max_num_seqs,
                   DRAFT_TOKEN_BUDGET)
        draft = DraftModelProposer(config.model, engine.device, engine.dtype,
                                   engine.model_config.vocab_size, sched.max_model_len, seqs,
                                   config.num_speculative_tokens, engine.cache_config.block_size,
                                   engine.cache_config.num_blocks)
    return SpecDecoder(config, draft)
