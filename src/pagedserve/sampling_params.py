"""vLLM-compatible ``SamplingParams``, validated on construction.

Every field keeps vLLM's name and meaning; invalid values raise ValueError at construction, so a
bad request is refused before it reaches the scheduler.
"""

from __future__ import annotations

import enum
import json as jsonlib
import math
from dataclasses import dataclass, field

# Below this temperature sampling is greedy (argmax), as in vLLM.
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20
# Every integer field must fit a signed 64-bit tensor element; the engine then bounds each
# against the model (top_k and token ids by the vocabulary, n by max_num_seqs).
INT64_MAX = 2**63 - 1
# Stop strings are searched after every token on the engine thread, stop ids on every token:
# bounded so that one request cannot slow every other stream. OpenAI allows 4 stop strings.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 4096
MAX_LOGIT_BIAS = 1024  # OpenAI allows 300 entries
# A finished beam scores sum(logprobs) / len ** length_penalty; beyond this bound len ** lp
# overflows a float for long outputs.
MAX_LENGTH_PENALTY = 10.0
MIN_REPETITION_PENALTY = 1e-4
MAX_REPETITION_PENALTY = 1e4


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names): everything so far, only
    what is new since the last output, or nothing until the request finishes."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output (vLLM's names): exactly one of ``json`` (a JSON Schema, as a dict
    or its JSON text), ``regex``, ``choice`` (a list of strings: the output is one of them),
    ``grammar`` (a Lark grammar) or ``json_object=True`` (any JSON object).

    Raises:
        ValueError: none or several given, or one of the wrong type, naming the field.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [f for f in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, "
                             f"grammar, json_object; got {', '.join(given) or 'none'}")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", jsonlib.loads(self.json))
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json must be a JSON Schema object, got "
                             f"{type(self.json).__name__}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be true or false, got "
                             f"{self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple))
                                        or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                             "strings")

    def kind(self) -> tuple[str, object]:
        """(field, spec) of the one constraint given."""
        if self.json_object:
            return "json_object", {"type": "object"}
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name, getattr(self, name)
        raise AssertionError("validated in __post_init__")

    def cache_key(self) -> str:
        field, spec = self.kind()
        return field + ":" + jsonlib.dumps(spec, sort_keys=True)


@dataclass
class SamplingParams:
    """How to pick each new token and when to stop.

    Args:
        n: sequences per request (parallel sampling). They share the prompt's KV blocks and
            copy a block only when they write into it (copy-on-write).
        temperature: >= 0; 0 means greedy.
        top_p: nucleus mass in (0, 1]. top_k: 0 or -1 disables, else >= 1. min_p: in [0, 1].
        presence_penalty, frequency_penalty: in [-2, 2], OpenAI semantics, over generated tokens.
        repetition_penalty: in [1e-4, 1e4] (1 = off), CTRL/HF semantics (Keskar et al. 2019),
            over prompt + output.
        seed: per-request seed; a seeded request's tokens do not depend on its batch-mates.
            With n > 1, sequence i draws from its own stream derived from (seed, i).
        stop: strings that end generation (left out of the text unless
            include_stop_str_in_output). stop_token_ids: token ids that end generation.
        ignore_eos: keep generating past EOS. max_tokens: None means up to max_model_len.
        min_tokens: EOS and stop_token_ids are masked until this many tokens exist.
        logprobs: return the sampled token's logprob plus this many top alternatives (0..20).
        prompt_logprobs: return each prompt token's logprob (given the tokens before it) plus
            this many top alternatives (0..20); such a request does not use prefix-cache hits,
            since every prompt position must be computed.
        output_kind: CUMULATIVE, DELTA (streaming) or FINAL_ONLY outputs from ``LLMEngine.step``.
        structured_outputs: constrain the output to a JSON schema, regex, choice or grammar
            (``StructuredOutputsParams``).
        logit_bias: token id -> bias in [-100, 100] added to its logit (OpenAI's field).
        allowed_token_ids: only these tokens may be generated (at most the vocabulary).
        bad_words: words never generated: a word's last token is masked whenever the output
            ends with the tokens before it (each word with and without a leading space).
        truncate_prompt_tokens: keep only the prompt's last k tokens (k >= 1; -1 means
            max_model_len).
    Raises:
        ValueError: for any value out of range, with the field name and value.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        stop, stop_ids = self.stop, self.stop_token_ids
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if stop_ids is not None and not isinstance(stop_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {stop_ids!r}")
        self.stop_strings = tuple(stop or ())
        self.stop_token_ids = list(stop_ids or [])
        self._validate()

    def _validate(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(msg)

        for name in ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs",
                     "seed"):
            value = getattr(self, name)
            optional = name in ("max_tokens", "logprobs", "prompt_logprobs", "seed")
            if (value is not None or not optional) and not _is_int(value):
                fail(f"{name} must be an integer, got {value!r}")
            if name != "seed" and value is not None and not -INT64_MAX <= value <= INT64_MAX:
                fail(f"{name} must be within +-(2**63 - 1), got {value}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
                fail(f"{name} must be a finite number, got {value!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                fail(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.structured_outputs is not None \
                and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail("structured_outputs must be a StructuredOutputsParams, got "
                 f"{type(self.structured_outputs).__name__}")
        self._validate_logits_fields(fail)
        if not isinstance(self.output_kind, RequestOutputKind):
            fail(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.n < 1:
            fail(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            fail(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            fail(f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                fail(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        # Far outside this range float32 logits overflow or the penalty rounds to 0.
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            fail(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                 f"{MAX_REPETITION_PENALTY}], got {self.repetition_penalty}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            fail(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            fail(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            fail(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            fail(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            fail(f"stop strings must be non-empty strings, got {self.stop!r}")
        if len(self.stop_strings) > MAX_STOP_STRINGS or \
                any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop_strings):
            fail(f"stop takes at most {MAX_STOP_STRINGS} strings of at most "
                 f"{MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            fail(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got "
                 f"{len(self.stop_token_ids)}")
        if any(not _is_int(t) or not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            fail(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    def _validate_logits_fields(self, fail) -> None:
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
                fail(f"logit_bias must be a map of at most {MAX_LOGIT_BIAS} token ids to "
                     f"numbers, got {bias!r:.200}")
            for token, value in bias.items():
                if not _is_int(token) or not 0 <= token <= INT64_MAX:
                    fail(f"logit_bias: token ids must be integers in [0, 2**63), got "
                         f"{token!r}")
                if not (_is_int(value) or isinstance(value, float)) or not -100 <= value <= 100:
                    fail(f"logit_bias: biases must be numbers in [-100, 100], got {value!r} "
                         f"for token {token}")
        ids = self.allowed_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or not ids
                                or any(not _is_int(t) or not 0 <= t <= INT64_MAX for t in ids)):
            fail(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r:.200}")
        words = self.bad_words
        if words is not None and (not isinstance(words, (list, tuple))
                                  or len(words) > MAX_STOP_STRINGS
                                  or any(not isinstance(w, str) or not w.strip()
                                         or len(w) > MAX_STOP_STRING_CHARS for w in words)):
            fail(f"bad_words must be a list of at most {MAX_STOP_STRINGS} non-blank strings "
                 f"of at most {MAX_STOP_STRING_CHARS} characters, got {words!r:.200}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k == -1 or 1 <= k <= INT64_MAX)):
            fail(f"truncate_prompt_tokens must be -1 or a positive integer, got {k!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass
class BeamSearchParams:
    """Beam search (vLLM's name), scored as transformers' ``generate(num_beams=...)`` does.

    Args:
        beam_width: live beams (>= 1). Beams share KV blocks and copy one on write.
        max_tokens: most tokens generated per beam (>= 1).
        ignore_eos: keep beams running past EOS.
        length_penalty: a finished beam scores sum(logprobs) / generated_len ** length_penalty;
            in [-10, 10].
        early_stopping: transformers' semantics: True stops once beam_width beams finished;
            False stops when no running beam can still beat the worst finished one, judged at
            the current length; "never" judges at the longest possible length when
            length_penalty > 0.
    Raises:
        ValueError: a value out of range, naming the field.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        lp = self.length_penalty
        if not (_is_int(lp) or isinstance(lp, float)) or not math.isfinite(lp) \
                or abs(lp) > MAX_LENGTH_PENALTY:
            raise ValueError(f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY}, "
                             f"{MAX_LENGTH_PENALTY}], got {lp!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', "
                             f"got {self.early_stopping!r}")
