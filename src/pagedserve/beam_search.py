"""Beam search over the paged KV cache, scored exactly as transformers' ``generate(num_beams=W,
do_sample=False)`` (its length penalty, early-stopping rules and candidate counts).

Each step every live beam's next-token log-probabilities are added to its running score; the
best K = max(2, 1 + #eos) * W candidates are taken across beams. Candidates that end (EOS or
max length) among the best W enter the finished list (score = sum of logprobs /
generated_len ** length_penalty, best W kept); the best W that do not end become the live beams.
Beams are sequences that share KV blocks: a beam chosen k times forks k - 1 children (blocks
shared, copied on write); a beam not chosen is freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.sampling_params import BeamSearchParams


@dataclass
class BeamHypothesis:
    """A finished beam: its generated tokens, summed logprob and length-penalised score."""

    token_ids: list[int]
    cum_logprob: float
    score: float


@dataclass
class BeamSearchState:
    params: BeamSearchParams
    prompt_len: int
    eos_token_ids: frozenset[int]
    running_scores: list[float] = field(default_factory=lambda: [0.0])
    finished: list[BeamHypothesis] = field(default_factory=list)
    improvement_possible: bool = True
    done: bool = False

    def step(self, logprobs: torch.Tensor, outputs: list[list[int]], cur_len: int
             ) -> list[tuple[int, int]]:
        """One selection step.

        Args:
            logprobs: [num_live_beams, vocab] float32 log-softmax of each live beam's logits.
            outputs: each live beam's generated tokens so far.
            cur_len: tokens per beam (prompt + generated) before this step's token.
        Returns:
            The new live beams, best first: (index of the parent beam, token).
        """
        p = self.params
        width, vocab = p.beam_width, logprobs.shape[-1]
        eos = frozenset() if p.ignore_eos else self.eos_token_ids
        k = max(2, 1 + len(eos)) * width
        scores = logprobs + torch.tensor(self.running_scores, dtype=logprobs.dtype)[:, None]
        top_scores, top_idx = scores.flatten().topk(min(k, scores.numel()))
        top_scores, top_idx = top_scores.tolist(), top_idx.tolist()
        gen_len = cur_len + 1 - self.prompt_len
        at_max_len = gen_len >= p.max_tokens
        ends = [at_max_len or (i % vocab) in eos for i in top_idx]

        # finished: only ends among the best `width` candidates, while improvement is possible
        if self.improvement_possible and not (
                len(self.finished) == width and p.early_stopping is True):
            for rank in range(min(width, len(top_idx))):
                if ends[rank]:
                    beam, token = divmod(top_idx[rank], vocab)
                    self.finished.append(BeamHypothesis(
                        outputs[beam] + [token], top_scores[rank],
                        top_scores[rank] / gen_len ** p.length_penalty))
            self.finished.sort(key=lambda h: h.score, reverse=True)
            del self.finished[width:]

        live = [(s, i) for s, i, e in zip(top_scores, top_idx, ends) if not e][:width]
        self.running_scores = [s for s, _ in live]
        # the heuristic of transformers: can the best live beam still beat the worst finished?
        if live and len(self.finished) == width:
            if p.early_stopping == "never" and p.length_penalty > 0:
                best_len = p.max_tokens
            else:
                best_len = gen_len
            best_possible = self.running_scores[0] / best_len ** p.length_penalty
            self.improvement_possible &= best_possible > self.finished[-1].score
        self.done = (not live or not self.improvement_possible
                     or (len(self.finished) == width and p.early_stopping is True))
        return [divmod(i, vocab) for _, i in live] if not self.done else []
