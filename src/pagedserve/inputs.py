"""Input processing: prompts (text, token ids, chat messages) into validated token ids, and
sampling parameters checked against the model, before anything is queued.

Everything here reads only the tokenizer and the model's limits, so it is safe to call from any
thread: the server runs it in a worker pool, off the engine loop, so a huge prompt or a slow
chat template never stalls the streams being generated.
"""

from __future__ import annotations

import math
import threading
from typing import Any, NamedTuple

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.kv.spec import blocks_per_seq
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.tokenizer import apply_chat_template, check_text, encode

PromptType = str | dict[str, Any]


class ContextLengthError(ValueError):
    """A prompt, or a prompt plus its ``max_tokens``, longer than ``max_model_len``. The
    message uses OpenAI's wording ("This model's maximum context length is N tokens. However,
    ..."), which clients such as litellm recognise; the server answers it with 400 and
    ``code: "context_length_exceeded"``."""


def context_length_error(max_model_len: int, prompt_tokens: int,
                         max_tokens: int | None = None) -> ContextLengthError:
    """The error for a prompt of ``prompt_tokens`` that, alone or with ``max_tokens`` (None:
    the prompt alone), does not fit ``max_model_len``."""
    head = f"This model's maximum context length is {max_model_len} tokens. However, "
    if max_tokens is None:
        why = ", which leaves no room to generate" if prompt_tokens <= max_model_len else ""
        return ContextLengthError(
            f"{head}your prompt has {prompt_tokens} tokens{why}. Please reduce the length of "
            "the prompt or messages.")
    return ContextLengthError(
        f"{head}you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
        f"messages, {max_tokens} in the completion). Please reduce the length of the messages "
        "or completion.")


def text_chars(value: Any) -> int:
    """Characters of every string inside ``value`` (messages: roles, contents, names): what a
    chat template renders at least once."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_chars(v) for v in value)
    return 0


class ProcessedPrompt(NamedTuple):
    """A prompt ready for the scheduler: its text (None when given as ids), its token ids and
    its prefix-cache salt."""

    text: str | None
    token_ids: list[int]
    cache_salt: str | None


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one vocabulary entry can stand for: the longest entry's length
    (byte-level BPE writes one character per byte, SentencePiece one per character, so a
    decoded token is never longer than its entry)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


class InputProcessor:
    """Turns prompts into validated token ids and checks sampling parameters against the model.

    Args:
        tokenizer: a transformers tokenizer, or None (prompts must then be token ids).
        vocab_size: the model's vocabulary size; every token id must lie in [0, vocab_size).
        scheduler_config: ``max_model_len`` (the longest prompt + output, in tokens) and the
            batch bounds a request must fit.
        cache_config: the KV blocks a request's sequences must fit in together.
        one_sequence: the allocator runs one sequence per request (no n > 1, no beams).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig, one_sequence: bool = False):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.scheduler_config, self.cache_config = scheduler_config, cache_config
        self.one_sequence = one_sequence
        max_model_len = self.max_model_len = scheduler_config.max_model_len
        # No text longer than this can tokenize to max_model_len tokens or fewer: refusing it
        # before tokenizing bounds the work one request can cause.
        self.max_prompt_chars = (max_model_len * longest_token_chars(tokenizer)
                                 if tokenizer is not None else 0)
        self._grammars: Any = None  # structured.GrammarCompiler, made on first use
        self._grammars_lock = threading.Lock()

    def constraints(self, params: SamplingParams | BeamSearchParams
                    ) -> tuple[Any, list[list[int]]]:
        """(compiled grammar or None, token ids of each bad word and its leading-space form)
        of a request. Raises ValueError as ``compile_grammar``, or for bad_words without a
        tokenizer."""
        words = getattr(params, "bad_words", None)
        if not words:
            return self.compile_grammar(params), []
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this engine has none")
        ids = {tuple(self.tokenizer.encode(form, add_special_tokens=False))
               for w in words for form in (w.lstrip(), " " + w.lstrip())}
        return self.compile_grammar(params), [list(t) for t in sorted(ids) if t]

    def compile_grammar(self, params: SamplingParams | BeamSearchParams) -> Any:
        """The compiled grammar (``structured.Grammar``) of a request with
        ``structured_outputs``, else None. Compiled once per spec and cached, so the server
        compiles in a worker of its own and the engine thread then only finds it.

        Raises:
            ValueError: a spec the grammar engine refuses (naming the field), or a server
                without a tokenizer.
        """
        spec = getattr(params, "structured_outputs", None)
        if spec is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer; this engine has none")
        with self._grammars_lock:
            if self._grammars is None:
                from pagedserve.structured import GrammarCompiler

                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._grammars.compile(spec)

    # ---- prompts ------------------------------------------------------------------------------

    def check_text_length(self, num_chars: int) -> None:
        """Raise ContextLengthError for text too long to fit max_model_len tokens however it
        tokenizes (more than max_model_len times the longest vocabulary entry)."""
        if self.tokenizer is not None and num_chars > self.max_prompt_chars:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {num_chars} characters, more than any prompt of "
                f"{self.max_model_len} tokens can have ({self.max_prompt_chars}). Please reduce "
                "the length of the prompt or messages.")

    def check_message_count(self, num_messages: int) -> None:
        """Raise ContextLengthError for more messages than max_model_len (each renders at
        least one token)."""
        if num_messages > self.max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your conversation has {num_messages} messages. Please reduce the number of "
                "messages.")

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Raises ValueError without a tokenizer, for text that is not
        valid UTF-8, and ContextLengthError for text that cannot fit (checked before the
        tokenizer runs)."""
        if self.tokenizer is None:
            raise ValueError("the engine runs without a tokenizer: pass prompt_token_ids")
        self.check_text_length(len(text))
        if add_special_tokens:
            return encode(self.tokenizer, text)
        check_text(text)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **kwargs: Any) -> tuple[str, list[int]]:
        """(text, token ids) of a conversation through the chat template. Raises ValueError
        (no tokenizer or template, malformed messages) or ContextLengthError (the contents
        alone are too long, checked before the template runs)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer")
        if isinstance(messages, list):
            self.check_message_count(len(messages))
        self.check_text_length(text_chars(messages))
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt, **kwargs)

    def process_prompt(self, prompt: PromptType, truncate: int | None = None
                       ) -> ProcessedPrompt:
        """A prompt string, or a dict with "prompt" and/or "prompt_token_ids" (ids win) and
        optionally "cache_salt", as checked token ids: not empty, inside the vocabulary, at
        most max_model_len. ``truncate`` (``truncate_prompt_tokens``) keeps the last k ids
        (-1: max_model_len); the text stays whole. Raises ValueError (ContextLengthError for
        length) naming the numbers."""
        salt = None
        text = prompt
        ids = None
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise ValueError(f"cache_salt must be a string, got {salt!r}")
            text = prompt.get("prompt")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                        isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers")
                ids = list(ids)
            elif "prompt" not in prompt:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if ids is None:
            if not isinstance(text, str):
                raise ValueError(f"a prompt must be a string or a dict, got "
                                 f"{type(text).__name__}")
            ids = self.tokenize(text)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        if truncate is not None:
            ids = ids[-(self.max_model_len if truncate == -1 else truncate):]
        self.check_token_ids(ids)
        if len(ids) > self.max_model_len:
            raise context_length_error(self.max_model_len, len(ids))
        return ProcessedPrompt(text, ids, salt)

    @staticmethod
    def check_request(request_id: Any, params: Any, arrival_time: Any
                      ) -> SamplingParams | BeamSearchParams:
        """``params`` (default ``SamplingParams()`` for None) after checking that
        ``request_id`` is a string, ``params`` SamplingParams or BeamSearchParams and
        ``arrival_time`` None or a finite ``time.time()``; raises ValueError otherwise."""
        params = SamplingParams() if params is None else params
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if arrival_time is not None and (not isinstance(arrival_time, (int, float))
                                         or isinstance(arrival_time, bool)
                                         or not math.isfinite(arrival_time)):
            raise ValueError(f"arrival_time must be a finite number of seconds (time.time()), "
                             f"got {arrival_time!r}")
        return params

    def check_token_ids(self, ids: list[int], field: str = "token id") -> None:
        """Raise ValueError naming the first id outside [0, vocab_size)."""
        vocab = self.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"{field} {bad} is outside the vocabulary [0, {vocab})")

    # ---- parameters ---------------------------------------------------------------------------

    def resolve_max_tokens(self, params: SamplingParams | BeamSearchParams,
                           num_prompt_tokens: int) -> int:
        """``params.max_tokens``, or all the room max_model_len leaves when it is None, after
        checking the parameters against the model: stop_token_ids inside the vocabulary, top_k
        at most the vocabulary size, min_tokens at most max_tokens, prompt + max_tokens within
        max_model_len. Raises ValueError (ContextLengthError for length) naming the field."""
        max_len = self.max_model_len
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max_len - num_prompt_tokens
            if max_tokens < 1:
                raise context_length_error(max_len, num_prompt_tokens)
        elif num_prompt_tokens + max_tokens > max_len:
            raise context_length_error(max_len, num_prompt_tokens, max_tokens)
        self.check_params(params, max_tokens)
        return max_tokens

    def check_params(self, params: SamplingParams | BeamSearchParams,
                     max_tokens: int | None = None) -> None:
        """Raise ValueError naming the field unless ``params`` suit the model: stop_token_ids
        inside the vocabulary, top_k at most the vocabulary size, and min_tokens at most
        ``max_tokens`` (resolved; None skips that check)."""
        if not isinstance(params, SamplingParams):
            return
        self.check_token_ids(params.stop_token_ids, "stop_token_ids: token id")
        self.check_token_ids(params.allowed_token_ids or [], "allowed_token_ids: token id")
        self.check_token_ids(list(params.logit_bias or {}), "logit_bias: token id")
        if params.top_k > self.vocab_size:
            raise ValueError(f"top_k must be at most the vocabulary size {self.vocab_size} "
                             f"(or -1 / 0 for all), got {params.top_k}")
        if max_tokens is not None and params.min_tokens > max_tokens:
            raise ValueError(f"min_tokens={params.min_tokens} must not exceed max_tokens="
                             f"{max_tokens}")

    def check_fits(self, params: SamplingParams | BeamSearchParams, seq_len: int) -> None:
        """Raise ValueError unless the request's sequences (n, or the beam width) of up to
        ``seq_len`` tokens fit the batch and the KV cache together, or if it has stop strings
        and there is no tokenizer."""
        beam = isinstance(params, BeamSearchParams)
        num_seqs = params.beam_width if beam else params.n
        field = "beam_width" if beam else "n"
        if num_seqs > 1 and self.one_sequence:
            raise ValueError(f"{field}={num_seqs}: kv_allocator='contiguous' runs one sequence "
                             "per request")
        cfg, cache = self.scheduler_config, self.cache_config
        if num_seqs > cfg.max_num_seqs:
            raise ValueError(f"{field}={num_seqs} sequences is more than max_num_seqs="
                             f"{cfg.max_num_seqs}")
        need = num_seqs * blocks_per_seq(cache.windows, seq_len, cache.block_size,
                                         cfg.max_num_batched_tokens)
        if need > cache.num_blocks:
            raise ValueError(
                f"{field}={num_seqs} sequences of up to {seq_len} tokens need up to {need} KV "
                f"blocks, more than the {cache.num_blocks} the cache has")
        if num_seqs > cfg.max_num_batched_tokens:
            raise ValueError(f"{field}={num_seqs} sequences need max_num_batched_tokens >= "
                             f"{num_seqs}, it is {cfg.max_num_batched_tokens}")
        if not beam and params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
