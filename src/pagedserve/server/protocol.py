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

from pagedserve.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

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
    "guided_whitespace_pattern": (),
    "use_beam_search": (False,), "length_penalty": (1,), "logits_processors": (),
    "return_tokens_as_token_ids": (False,), "prompt_embeds": (),
    "spaces_between_special_tokens": (True,), "priority": (0,), "vllm_xargs": (),
    "kv_transfer_params": (), "mm_processor_kwargs": (), "functions": ([],),
    "function_call": ("none", "auto"), "prediction": (), "audio": (), "modalities": (["text"],),
}
CHAT_UNIMPLEMENTED = {
    **UNIMPLEMENTED, "chat_template": (), "documents": (), "echo": (False,),
    "add_special_tokens": (False,),
}
COMPLETION_UNIMPLEMENTED = {**UNIMPLEMENTED, "add_special_tokens": (True,), "tools": ([],),
                            "tool_choice": ("none", "auto"), "continue_final_message": (False,),
                            "chat_template_kwargs": ({},)}


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
    logit_bias: dict[StrictStr, Number] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None
    truncate_prompt_tokens: Int | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields (at most one of them per request).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: StrictStr | dict[str, Any] | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_decoding_backend: StrictStr | None = None  # one grammar engine here: ignored
    # Accepted by OpenAI or vLLM but not implemented here: refused unless left at "off", so
    # that a request never silently gets something else than it asked for.
    best_of: Int | None = None
    prompt_logprobs: Any = None  # offline API only (SamplingParams.prompt_logprobs)

    def unsupported(self) -> str | None:
        """The name of a set field this server does not implement, if any."""
        if self.best_of not in (None, 1) and self.best_of != self.n:
            return "best_of"
        if self.prompt_logprobs is not None:
            return "prompt_logprobs"
        return None

    def structured_spec(self) -> tuple[StructuredOutputsParams | None, str]:
        """(the constraint, the field the client sent it in). Raises ValueError starting
        with the field's name for a malformed value or two constraints in one request."""
        given = [name for name in ("response_format", "structured_outputs", "guided_json",
                                   "guided_regex", "guided_choice", "guided_grammar")
                 if getattr(self, name) is not None
                 and not (name == "response_format" and self.response_format == {"type": "text"})]
        if not given:
            return None, ""
        if len(given) > 1:
            raise ValueError(f"{given[1]}: give one output constraint per request, got "
                             f"{' and '.join(given)}")
        name = given[0]
        value = getattr(self, name)
        if name == "response_format":
            return response_format_spec(value)
        if name == "structured_outputs":
            unknown = sorted(set(value) - STRUCTURED_FIELDS)
            if unknown:
                raise ValueError(f"structured_outputs.{unknown[0]}: unknown field; the fields "
                                 f"are {', '.join(sorted(STRUCTURED_FIELDS))}")
            try:
                spec = StructuredOutputsParams(**{k: v for k, v in value.items()
                                                  if k in CONSTRAINTS})
                return spec, f"{name}.{spec.kind()[0]}"
            except (ValueError, TypeError) as e:
                raise ValueError(str(e)) from None
        key = name.removeprefix("guided_")
        try:
            return StructuredOutputsParams(**{key: value}), name
        except ValueError as e:
            raise ValueError(str(e).replace(f"structured_outputs.{key}", name)) from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """Raises ValueError (from SamplingParams) naming the field."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream=true")
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
        if self.logit_bias:
            fields["logit_bias"] = logit_bias(self.logit_bias)
        for name in ("allowed_token_ids", "bad_words", "truncate_prompt_tokens"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        fields["structured_outputs"] = structured
        return SamplingParams(**fields)


CONSTRAINTS = {"json", "regex", "choice", "grammar", "json_object"}
# with vLLM's options that do not change what is accepted here
STRUCTURED_FIELDS = CONSTRAINTS | {"disable_fallback", "disable_any_whitespace",
                                   "disable_additional_properties"}


def response_format_spec(value: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str]:
    """OpenAI's ``response_format`` as a constraint: ``{"type": "json_object"}`` (any JSON
    object) or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict",
    "description"}}`` (always enforced strictly). Raises ValueError naming the field."""
    kind = value.get("type")
    if kind == "text":
        return None, ""
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if kind != "json_schema":
        raise ValueError(f"response_format.type: must be 'text', 'json_object' or "
                         f"'json_schema', got {kind!r}")
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: must be an object with 'name' and 'schema'")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ValueError(f"{where}.name: must be a non-empty string")
    if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
        raise ValueError(f"{where}.strict: must be true or false")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ValueError(f"{where}.schema: must be a JSON Schema object, got "
                         f"{type(schema).__name__}")
    return StructuredOutputsParams(json=schema), where + ".schema"


def logit_bias(raw: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys) with integer keys. Raises
    ValueError naming the field for a key that is not an integer."""
    out = {}
    for key, value in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise ValueError(f"logit_bias: keys must be token ids, got {key!r}") from None
        out[token] = value
    return out


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


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    arguments: StrictStr = "{}"  # a JSON object's text, as OpenAI sends it


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant turn, sent back in the conversation."""

    model_config = ConfigDict(extra="ignore")
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: StrictStr | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template and the tool parsers take it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for name in ("tool_call_id", "name"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: StrictBool = False
    top_logprobs: Int | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[StrictStr, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None


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
