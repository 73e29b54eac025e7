"""Verifying drafts: a sequence that computed k drafts has k + 1 logits rows; row i predicts
the token after its first i drafts. Each row is sampled as if those drafts were already its
output (penalties, min_tokens, bad words, a grammar and a seeded request's per-position
randomness see them), and its draft is accepted when the row samples exactly that token
(``Sampler``: speculative sampling for deterministic drafts). The sequence keeps its rows up
to the first one whose draft was not accepted: the accepted drafts, then one token of the
target's own (the correction, or a bonus token when every draft was accepted).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.sampler import SampledRows, Sampler, build_sampling_metadata
from pagedserve.sequence import Sequence


class DraftPosition:
    """``seq`` as it would be after ``extra`` (its first drafts) were appended, with a grammar
    matcher that consumed them: what the sampler reads of a sequence at one row."""

    __slots__ = ("seq", "extra", "matcher")

    def __init__(self, seq: Sequence, extra: list[int], matcher: Any):
        self.seq, self.extra, self.matcher = seq, extra, matcher

    @property
    def request(self):
        return self.seq.request

    @property
    def seed(self) -> int | None:
        return self.seq.seed

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens + len(self.extra)

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.extra

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.extra)


def draft_positions(seq: Sequence, drafts: list[int]) -> list[Sequence | DraftPosition]:
    """The sequence at rows 0 .. k. Under a grammar the drafts stop before the first one it
    refuses: that draft can never be accepted, so no later row is ever reached."""
    if seq.matcher is None:
        return [seq, *(DraftPosition(seq, drafts[:i], None) for i in range(1, len(drafts) + 1))]
    matcher = seq.matcher.deep_copy()
    positions: list[Sequence | DraftPosition] = [seq]
    for i in range(seq.matcher.validate_tokens(drafts)):
        matcher.consume_token(drafts[i])
        positions.append(DraftPosition(seq, drafts[:i + 1], matcher.deep_copy()))
    return positions


def sample_with_drafts(sampler: Sampler, rows: list[tuple[Sequence, int, int]],
                       logits: torch.Tensor, generator: torch.Generator,
                       vocab_size: int) -> SampledRows:
    """Sample ``rows`` (sequence, its first row of ``logits`` [B, vocab] float32, drafts it
    verifies). Returns, for each sequence in order, the tokens it appends: an entry
    (sequence, row) per accepted draft and one for the token after them."""
    positions: list[Sequence | DraftPosition] = []
    index: list[int] = []
    draft_ids: list[int] = []
    spans = []  # (first position, positions) of each sequence
    for seq, first, k in rows:
        drafts = seq.spec_token_ids[:k]
        pos = draft_positions(seq, drafts) if k else [seq]
        spans.append((len(positions), len(pos)))
        positions += pos
        index += range(first, first + len(pos))
        draft_ids += [*drafts[:len(pos) - 1], -1]
    md = build_sampling_metadata(positions, vocab_size, logits.device)
    if index != list(range(logits.shape[0])):
        logits = logits[index]
    out = sampler(logits, md, generator, draft_ids if len(draft_ids) > len(rows) else None)
    kept, kept_rows = [], []
    for (seq, _, _), (start, count) in zip(rows, spans):
        for j in range(start, start + count):
            kept.append(j)
            kept_rows.append((seq, index[j]))
            if out.accepted is None or not out.accepted[j]:
                break
    return SampledRows(kept_rows, out.select(kept))
