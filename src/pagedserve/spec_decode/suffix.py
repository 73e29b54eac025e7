"""Suffix decoding (Oliaro et al., "SuffixDecoding", 2024; Snowflake's Arctic Inference): drafts
from earlier token streams, with no model. Two are searched: the request's own prompt and
output, and the outputs of recent requests (agents and repeated tasks produce the same spans
request after request). The longest suffix of the sequence (at most ``depth`` - 1 tokens) that
occurred before is followed along its most frequent continuation, while that continuation's
estimated probability (its share of the occurrences) stays at least ``min_prob`` and for at
most ``spec_factor`` x the match length; the draft with the larger expected number of accepted
tokens wins.

The paper keeps suffix trees; here the same queries run over the token arrays themselves
(numpy: the occurrences of the last token, narrowed one token further back at a time), which
gives the same drafts and keeps memory at the tokens: the global stream holds the outputs of
at most ``max_requests`` requests.
"""

from __future__ import annotations

from collections import deque

import numpy as np

SEPARATOR = -1  # between requests' outputs in the global stream; never matches


def suffix_draft(tokens: np.ndarray, context: list[int], k: int, depth: int, spec_factor: float,
                 min_prob: float) -> tuple[list[int], float]:
    """(draft, expected accepted tokens) for a sequence ending in ``context``, from the
    occurrences of its suffixes in ``tokens`` (int64; an occurrence ending at the last token
    is not one: nothing follows it)."""
    if not context or tokens.size < 2:
        return [], 0.0
    ends = np.flatnonzero(tokens[:-1] == context[-1])  # last index of each occurrence
    m = 1
    while ends.size and m < min(len(context), depth - 1):
        before = ends - m
        ok = before >= 0
        longer = ends[ok][tokens[before[ok]] == context[-1 - m]]
        if longer.size == 0:
            break
        ends, m = longer, m + 1
    if ends.size == 0:
        return [], 0.0
    limit = min(k, max(1, int(spec_factor * m)), depth - m)
    pos = ends + 1  # each occurrence's next token
    draft: list[int] = []
    prob, score = 1.0, 0.0
    while len(draft) < limit:
        pos = pos[pos < tokens.size]
        nxt = tokens[pos]
        pos, nxt = pos[nxt != SEPARATOR], nxt[nxt != SEPARATOR]
        if pos.size == 0:
            break
        values, counts = np.unique(nxt, return_counts=True)
        best = int(counts.argmax())
        prob *= counts[best] / pos.size
        if prob < min_prob:
            break
        draft.append(int(values[best]))
        score += prob
        pos = pos[nxt == values[best]] + 1
    return draft, score


class SuffixProposer:
    """Args are speculative_config's ``suffix_decoding_*`` options."""

    def __init__(self, depth: int, max_requests: int, spec_factor: float, min_prob: float):
        self.depth, self.spec_factor, self.min_prob = depth, spec_factor, min_prob
        self.max_requests = max_requests
        self.outputs: deque[np.ndarray] = deque()
        self._stream: np.ndarray | None = None  # the outputs joined, rebuilt when they change

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` drafts to follow ``token_ids``."""
        context = token_ids[-(self.depth - 1):]
        own = suffix_draft(np.asarray(token_ids, dtype=np.int64), context, k, self.depth,
                           self.spec_factor, self.min_prob)
        if self._stream is None and self.outputs:
            self._stream = np.concatenate(
                [np.asarray(x) for out in self.outputs for x in (out, [SEPARATOR])])
        other = ([], 0.0) if self._stream is None else suffix_draft(
            self._stream, context, k, self.depth, self.spec_factor, self.min_prob)
        return (own if own[1] >= other[1] else other)[0]

    def forget(self) -> None:
        """Forget every remembered output."""
        self.outputs.clear()
        self._stream = None

    def add_output(self, tokens: list[int]) -> None:
        """Remember a finished request's output for later requests (the oldest beyond
        ``max_requests`` are forgotten)."""
        if tokens:
            self.outputs.append(np.asarray(tokens, dtype=np.int64))
            while len(self.outputs) > self.max_requests:
                self.outputs.popleft()
            self._stream = None
