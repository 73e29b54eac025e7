"""Tokenizer loading (transformers), chat template, and the incremental detokenizer.

The detokenizer turns generated token ids into text one step at a time. Invariants: it never
emits half of a multi-byte UTF-8 character (a window that decodes to a trailing U+FFFD is held
until the next token completes it, and flushed at the end); the concatenation of what it emits
equals the decode of all output tokens; a stop string is found wherever it starts (inside one
token, across tokens, at the very first character) and text after it is never returned.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Prompt tokens fed to the detokenizer as context so that the first generated token decodes
# the way it does mid-text (SentencePiece drops a leading space at the start of a decode).
_PROMPT_CONTEXT_TOKENS = 5


def load_tokenizer(path: str | Path, gguf_file: str | None = None) -> Any:
    """A transformers tokenizer from a local HF directory or (with ``gguf_file``) a GGUF
    file's embedded vocabulary; never from a hub. Raises ValueError naming the path when it
    does not exist or the tokenizer cannot be built (one line)."""
    from transformers import AutoTokenizer

    if not isinstance(path, (str, Path)) or not str(path) or not Path(path).exists():
        raise ValueError(f"tokenizer path {path!r} does not exist (a local directory with "
                         "tokenizer.json or tokenizer.model is needed)")
    try:
        if gguf_file is not None:
            return AutoTokenizer.from_pretrained(str(path), gguf_file=gguf_file)
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types; callers need one clear one
        where = Path(path) / gguf_file if gguf_file else Path(path)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"cannot load a tokenizer from {where} (it needs tokenizer.json or "
                         f"tokenizer.model, or pass tokenizer=DIR): {first}") from e


def check_text(text: str, what: str = "the prompt") -> None:
    """Raise ValueError if ``text`` cannot be encoded as UTF-8 (lone surrogates, e.g. from
    command-line bytes that were not UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid UTF-8 text (character {e.start}: "
                         f"{text[e.start:e.end]!r})") from None


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` (with the tokenizer's own BOS rule). Raises ValueError for text
    that is not valid UTF-8."""
    check_text(text)
    return tokenizer.encode(text)


def apply_chat_template(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
                        **kwargs: Any) -> tuple[str, list[int]]:
    """A conversation rendered with the tokenizer's chat template, or the Jinja template
    ``chat_template`` given in kwargs: (text, token ids).

    Raises ValueError for an empty conversation or when there is no template.
    """
    if not messages:
        raise ValueError("messages must not be empty")
    if kwargs.get("chat_template") is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model has no chat template (a base model, such as gemma3-270m, "
                         "is not tuned for chat): send a plain prompt instead (LLM.generate, "
                         "/v1/completions, pagedserve generate)")
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except Exception as e:  # jinja2 and transformers raise many types for malformed messages
        raise ValueError(f"cannot apply the chat template to these messages: {e}") from e
    # The template already writes BOS where the model wants it.
    check_text(text, "the conversation")
    return text, tokenizer.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Decodes output tokens incrementally and finds stop strings.

    Uses two decode windows over the token list (``prefix_offset:read_offset`` and
    ``prefix_offset:``); the text the second adds beyond the first is new, unless it ends in
    U+FFFD (an incomplete UTF-8 sequence), in which case it waits for more tokens.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.tokens: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""
        self.finished = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append one generated token. Returns the stop string matched, if any; then
        ``text`` is cut before it (or after it, with include_stop_str_in_output)."""
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return self._check_stop(len(full) - len(prefix))

    def flush(self) -> str | None:
        """At the end of generation, emit text still held back (a trailing U+FFFD included)."""
        self.finished = True
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) > len(prefix):
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset = len(self.tokens)
            return self._check_stop(len(full) - len(prefix))
        return None

    def _check_stop(self, num_new_chars: int) -> str | None:
        if not self.stop:
            return None
        # A stop string ending in the new text may start up to max_stop_len - 1 chars earlier.
        start = max(0, len(self.text) - num_new_chars - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        self.finished = True
        return s

    def stream_text(self) -> str:
        """The text safe to show now: while running, a tail that could still become a stop
        string is held back; once finished, all of it."""
        if self.finished or not self.stop:
            return self.text
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return self.text[: len(self.text) - hold]
