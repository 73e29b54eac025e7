"""Prompt lookup decoding (Saxena, 2023; vLLM's "ngram" method): the drafts are the tokens that
followed the latest earlier occurrence of the sequence's last n tokens, for the longest n in
[prompt_lookup_min, prompt_lookup_max] that occurs. Costs no model: it pays off when the output
repeats spans of the prompt or of itself (code edits, quoting summaries, reformatting)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Args: ``min_n`` / ``max_n``: the n-gram lengths tried, longest first."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token_ids`` (none when no n-gram recurs)."""
        if len(token_ids) < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        earlier = tokens[:-1]  # an occurrence must have a token after it
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            starts = np.flatnonzero((sliding_window_view(earlier, n) == tokens[-n:]).all(axis=1))
            if starts.size:
                i = int(starts[-1]) + n
                return tokens[i:i + k].tolist()
        return []
