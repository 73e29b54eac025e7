"""Grammars for constrained decoding, compiled with llguidance (Microsoft's guidance engine:
a lazily built lexer and an Earley parser over the tokenizer's byte trie, so a new schema
compiles in milliseconds; benchmarks/grammar_engines.py compares it with outlines-core).

A request's ``StructuredOutputsParams`` become one grammar, validated against the tokenizer and
compiled once per spec into a matcher at its start state (cached); each sequence of the request
then owns a copy of that matcher, which consumes the sequence's sampled tokens and yields the
bitmask of tokens allowed next.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
# Compiling recurses as deep as the grammar nests (a chain of rules or of "$ref"s): on a
# thread's default stack a 90 KB chain overflows it and kills the process. Compiles run on a
# thread with this stack, and a spec may have this many characters: at that size the deepest
# chain compiles in about a second with room to spare on the stack.
COMPILE_STACK_BYTES = 256 << 20
MAX_SPEC_CHARS = 256 * 1024
_STACK_LOCK = threading.Lock()


def _on_big_stack(fn: Any) -> Any:
    """``fn()`` on a fresh thread with a COMPILE_STACK_BYTES stack; its result or exception."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # handed to the caller
            result["error"] = e

    with _STACK_LOCK:  # the stack size applies to every thread started meanwhile
        old = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="pagedserve-grammar", daemon=True)
            thread.start()
        finally:
            threading.stack_size(old)
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar: ``start`` is an llguidance ``LLMatcher`` that has consumed nothing;
    it is only ever copied (``new_matcher``), never advanced, so one can be shared."""

    key: str
    start: Any

    def new_matcher(self) -> Any:
        """A matcher at the grammar's start state (a copy: microseconds, no compilation)."""
        return self.start.deep_copy()


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer; thread-safe, since the server
    compiles in its own worker, off the engine loop.

    Args:
        tokenizer: a transformers tokenizer. vocab_size: the model's vocabulary (the masks'
            width; it may exceed the tokenizer's, the extra ids are never allowed).
    """

    def __init__(self, tokenizer: Any, vocab_size: int):
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size
        # short errors: no parser state or grammar text echoed back to clients and logs
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: Any) -> Grammar:
        """The compiled grammar of ``params`` (a ``StructuredOutputsParams``), from the cache
        when the same spec was compiled before.

        Raises:
            ValueError: ``structured_outputs.<field>: <reason>``: a schema that is not valid
                JSON Schema, a malformed regex, a bad Lark grammar, one no text matches, a
                spec of more than MAX_SPEC_CHARS characters.
        """
        key = params.cache_key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        field, spec = params.kind()
        # the spec as the client wrote it: a regex or grammar's text, a schema's compact JSON
        size = len(spec) if isinstance(spec, str) else len(json.dumps(spec, separators=(",", ":")))
        if size > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{field}: the spec has {size} characters, "
                             f"more than the {MAX_SPEC_CHARS} a grammar may have")
        start = _on_big_stack(lambda: self._compile(field, spec))
        grammar = Grammar(key, start)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, field: str, spec: Any) -> Any:
        """The start matcher of one spec (runs on a big stack). Raises ValueError naming
        ``field`` for a spec llguidance refuses or one that no text satisfies."""
        m = self._ll.LLMatcher
        try:
            if field in ("json", "json_object"):
                # NOTE: no free whitespace: under a grammar a small model can otherwise loop
                # on spaces and newlines until max_tokens.
                text = m.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
            elif field == "regex":
                text = m.grammar_from_regex(spec)
            elif field == "choice":
                text = m.grammar_from_regex("|".join(re.escape(c) for c in spec))
            else:
                text = m.grammar_from_lark(spec)
        except (ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{field}: {e}") from None
        error = m.validate_grammar(text, self.tokenizer, limits=self._limits)
        if error:
            raise ValueError(f"structured_outputs.{field}: {error.strip()}")
        start = m(self.tokenizer, text, limits=self._limits)
        # The first mask: a grammar no text satisfies fails here (llguidance's error then
        # says "NoExtension..."), or allows nothing but the end without accepting.
        allowed = fill_allowed([start], self.vocab_size, torch.device("cpu"))[0]
        allowed[self.tokenizer.eos_token] = False
        error = start.get_error().replace("<non-verbose/>", "").strip()
        if start.is_error() and "NoExtension" not in error:
            raise ValueError(f"structured_outputs.{field}: {error}")
        if start.is_error() or (not start.is_accepting() and not bool(allowed.any())):
            raise ValueError(f"structured_outputs.{field}: no text matches it")
        return start


_EXECUTOR: list[Any] = []  # llguidance's thread pool for masks, made on first use
_SHIFTS = torch.arange(32, dtype=torch.int32)


def fill_allowed(matchers: list[Any], vocab_size: int, device: torch.device) -> torch.Tensor:
    """The tokens each matcher allows next: bool [len(matchers), vocab_size] on ``device``.
    llguidance computes all rows at once in its own threads, one bit per token (int32 words);
    they are unpacked here. A matcher in an error state allows nothing."""
    import llguidance
    from llguidance.torch import fill_next_token_bitmask_par

    if not _EXECUTOR:
        _EXECUTOR.append(llguidance.LLExecutor())
    words = (vocab_size + 31) // 32
    bits = torch.full((len(matchers), words), -1, dtype=torch.int32)
    fill_next_token_bitmask_par(_EXECUTOR[0], [(m, i) for i, m in enumerate(matchers)], bits)
    allowed = ((bits[:, :, None] >> _SHIFTS) & 1).bool().view(len(matchers), -1)
    return allowed[:, :vocab_size].to(device)
