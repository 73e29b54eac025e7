"""Request bodies of the OpenAI-compatible API (pydantic), and their translation into
SamplingParams. Field names and defaults follow OpenAI's API and vLLM's extensions (top_k,
min_p, repetition_penalty, ignore_eos, cache_salt). Unknown fields are ignored, as OpenAI
clients send some we do not use, except the request fields of OpenAI and vLLM that change what
is generated and are not implemented here (``UNIMPLEMENTED``): those are refused unless left at
"off", so that a request never silently gets something other than it asked for. Wrong types
and out-of-range values are errors (400). Integer fields take integer-valued floats (``4.0``),
as OpenAI and vLLM do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)

from pagedserve.sampling_params import RequestOutputKind, SamplingParams

Number = StrictFloat  # a JSON number (ints too), never a string or a boolean


def _integral(value: Any) -> Any:
    """4.0 -> 4; anything else unchanged (and then checked as a strict integer)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[StrictInt, BeforeValidator(_integral)]  # a JSON integer, or 4.0; never true
MAX_PROMPTS = 2048  # prompts in one completions request (OpenAI's bound for a batch)
MAX_DETOKENIZE_TOKENS = 131_072

# Request fields of OpenAI's API or vLLM's that change what is generated and are not
# implemented here, each with the values besides null that mean "off" (some clients send
# every field).
UNIMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "guided_decoding_backend": (), "guided_whitespace_pattern": (), "structured_outputs": (),
    "allowed_token_ids": (), "bad_words": ([],), "truncate_prompt_tokens": (),
    "use_beam_search": (False,), "length_penalty": (1,), "logits_processors": (),
    "return_tokens_as_token_ids": (False,), "prompt_embeds": (),
    "spaces_between_special_tokens": (True,), "priority": (0,), "vllm_xargs": (),
    "kv_transfer_params": (), "mm_processor_kwargs": (), "functions": ([],),
    "function_call": ("none", "auto"), "prediction": (), "audio": (), "modalities": (["text"],),
}
CHAT_UNIMPLEMENTED = {
    **UNIMPLEMENTED, "continue_final_message": (False,), "chat_template": (),
    "chat_template_kwargs": ({},), "documents": (), "echo": (False,),
    "add_special_tokens": (False,),
}
COMPLETION_UNIMPLEMENTED = {**UNIMPLEMENTED, "add_special_tokens": (True,)}


def _same(a: Any, b: Any) -> bool:
    return a == b and isinstance(a, bool) == isinstance(b, bool)  # True is not 1 here


def unimplemented_field(data: dict[str, Any], table: dict[str, tuple[Any, ...]]) -> str | None:
    """The first field of the raw body ``data`` set to a value this server does not
    implement (anything but null and the field's "off" values in ``table``)."""
    for name, off in table.items():
        value = data.get(name)
        if value is not None and not any(_same(value, v) for v in off):
            return name
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields both POST endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    n: Int = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    seed: Int | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None  # strict: no per-item Python validator
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: Int | None = None
    min_p: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    min_tokens: Int = 0
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    cache_salt: StrictStr | None = None
    user: StrictStr | None = None
    # Accepted by OpenAI or vLLM but not implemented here: refused unless left at "off", so
    # that a request never silently gets something else than it asked for.
    logit_bias: dict[str, Any] | None = None
    best_of: Int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    prompt_logprobs: Any = None  # offline API only (SamplingParams.prompt_logprobs)

    def unsupported(self) -> str | None:
        """The name of a set field this server does not implement, if any."""
        if self.logit_bias:
            return "logit_bias"
        if self.best_of not in (None, 1) and self.best_of != self.n:
            return "best_of"
        if self.response_format not in (None, {"type": "text"}):
            return "response_format"
        if self.tools:
            return "tools"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice"
        if self.prompt_logprobs is not None:
            return "prompt_logprobs"
        return None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError (from SamplingParams) naming the field."""
        fields: dict[str, Any] = dict(
            n=self.n, seed=self.seed, max_tokens=max_tokens, logprobs=logprobs,
            stop=self.stop, stop_token_ids=self.stop_token_ids, min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        if fields.get("top_k") == -1:  # OpenAI/vLLM clients send -1 for "off"
            fields["top_k"] = 0
        return SamplingParams(**fields)


PromptInput = (StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]])


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: PromptInput
    max_tokens: Int | None = 16
    echo: StrictBool = False
    logprobs: Int | None = None
    suffix: StrictStr | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: StrictBool = False
    top_logprobs: Int | None = None
    add_generation_prompt: StrictBool = True


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt, or chat messages through the chat template."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    tokens: Annotated[list[StrictInt], Field(max_length=MAX_DETOKENIZE_TOKENS)]
