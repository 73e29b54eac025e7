"""Tool calling for the chat API (OpenAI's ``tools``), for models whose chat template knows
nothing of tools: the tools and the turns that carry calls and results are rendered as plain
chat messages in the format the model was trained on, a grammar forces a call when the request
requires one, and the calls are parsed back out of the model's text, whole or streamed.

A format is a ``ToolParser``, chosen by name from ``TOOL_PARSERS`` (as vLLM's
``--tool-call-parser``):

- ``smollm2`` (the default): SmolLM2-Instruct's convention, one tag holding a JSON list,
  ``<tool_call>[{"name": "f", "arguments": {...}}, ...]</tool_call>``;
- ``hermes``: one JSON object per tag, ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n
  </tool_call>``, several tags for several calls.

Tool results go back as a user turn of ``<tool_response>`` blocks in both.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")
# Arguments in the grammar are written as json.dumps writes them ({"a": 1, "b": [2, 3]}), the
# spacing the models saw in training, and with no optional whitespace anywhere: a small model
# under a grammar that allows whitespace can emit it forever.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
              # keywords llguidance does not implement (an unknown "format") are ignored rather
              # than failing the request: OpenAI itself does not enforce non-strict schemas
              "lenient": True}


def new_call_id() -> str:
    """``"call_"`` and 24 random hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    """One call the model made: the function's name and its arguments as a JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}``, with
        ``"index"`` first when given (a stream delta's calls are numbered)."""
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def check_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any = None) -> None:
    """Validates a request's raw ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

    tools: None or a list of ``{"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}`` with distinct names matching ``^[a-zA-Z0-9_-]{1,64}$``;
    tool_choice: None, "none", "auto", "required" or ``{"type": "function", "function":
    {"name": <one of the tools>}}``; parallel_tool_calls: None or a boolean.
    Raises ValueError whose message starts with the field, as ``tools[1].function.name: ...``.
    """
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ValueError("tools: must be a list of tools")
    names: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{where}: must be an object")
        if tool.get("type") != "function":
            raise ValueError(f"{where}.type: must be 'function', got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function: must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise ValueError(f"{where}.function.name: must be 1 to 64 letters, digits, '_' or "
                             f"'-', got {name!r}")
        if name in names:
            raise ValueError(f"{where}.function.name: duplicate name {name!r}")
        names.append(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"{where}.function.description: must be a string")
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict)
                                   or params.get("type", "object") != "object"):
            raise ValueError(f"{where}.function.parameters: must be a JSON schema of an object")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ValueError(f"{where}.function.strict: must be a boolean")

    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if (tool_choice.get("type") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str)):
            raise ValueError('tool_choice: must be {"type": "function", "function": {"name": '
                             '...}} or one of ' + ", ".join(map(repr, TOOL_CHOICES)))
        if not names:
            raise ValueError(f"tool_choice: names function {fn['name']!r} but there are no tools")
        if fn["name"] not in names:
            raise ValueError(f"tool_choice: unknown function {fn['name']!r}; the tools are: "
                             + ", ".join(names))
    elif tool_choice is not None and tool_choice not in TOOL_CHOICES:
        raise ValueError("tool_choice: must be one of " + ", ".join(map(repr, TOOL_CHOICES))
                         + f' or {{"type": "function", ...}}, got {tool_choice!r}')
    elif tool_choice == "required" and not names:
        raise ValueError("tool_choice: 'required' needs at least one tool")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ValueError("parallel_tool_calls: must be a boolean")


def forced_tools(tools: list[dict] | None, tool_choice: Any) -> list[dict] | None:
    """The tools a grammar must force one call of (``ToolParser.grammar``): all of them for
    "required", the named one for a named choice; None when the model chooses (None, "none",
    "auto"). Expects arguments that passed ``check_tools``."""
    if tool_choice == "required":
        return list(tools or [])
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return [t for t in tools or [] if t["function"]["name"] == name]
    return None


def _text(content: Any) -> str:
    """A message's content as text: None -> "", a list of parts -> their texts joined."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _dumps(value: Any) -> str:
    # Non-ASCII characters stay as they are: the grammar does not allow \u escapes of
    # printable characters, and the model should see what it may write.
    return json.dumps(value, ensure_ascii=False)


def _decode_calls(body: str) -> list[ToolCall] | None:
    """The calls in one tag's text: a JSON object ``{"name", "arguments"}`` or a list of
    them (``arguments`` may be missing, or a JSON text of an object); None if malformed."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    calls = []
    for item in value if isinstance(value, list) else [value]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                return None
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall(item["name"], _dumps(args)))
    return calls


class ToolParser:
    """One tool-call format. The model's calls are written ``OPEN call SEP call ... CLOSE``,
    each call as ``{"name": "f", "arguments": {...}}``; the parser reads any tag from
    ``START`` to ``END`` (more leniently: any JSON whitespace, one object or a list)."""

    name = ""
    START = "<tool_call>"
    END = "</tool_call>"
    OPEN = START  # how the format writes a call, for rendering and for the grammar
    SEP = ""
    CLOSE = END

    def system_prompt(self, tools: list[dict]) -> str:
        """The system prompt that tells the model about ``tools`` and the format."""
        raise NotImplementedError

    def call_text(self, calls: list[dict]) -> str:
        """The text of ``calls`` (``[{"name", "arguments": object}]``) in this format."""
        return self.OPEN + self.SEP.join(_dumps({"name": c["name"], "arguments": c["arguments"]})
                                         for c in calls) + self.CLOSE

    def tool_response(self, contents: list[str]) -> str:
        """A user turn carrying the results of consecutive tool messages."""
        return "\n".join(f"<tool_response>\n{c}\n</tool_response>" for c in contents)

    def render_messages(self, messages: list[dict], tools: list[dict] | None = None
                        ) -> list[dict]:
        """OpenAI chat messages (role, content str or None, optional ``tool_calls`` with
        arguments as JSON text, ``tool_call_id``, ``name``) as ``{"role", "content": str}``
        messages that any ChatML template renders: the tools' system prompt first (after the
        request's own system text, if its first message is a system one), each run of "tool"
        messages one user turn, an assistant's tool_calls as this format's call text.
        With no tools, tool messages or tool calls, the messages pass through (content None
        -> ""). Raises ValueError naming ``messages[i].tool_calls[j]`` for a call without a
        function name."""
        if not tools and not any(m.get("role") == "tool" or m.get("tool_calls")
                                 for m in messages):
            return [{**m, "content": _text(m.get("content"))} for m in messages]
        out: list[dict] = []
        rest = list(enumerate(messages))
        if tools:
            prompt = self.system_prompt(tools)
            if messages and messages[0].get("role") == "system":
                own = _text(messages[0].get("content")).strip()
                prompt = f"{own}\n\n{prompt}" if own else prompt
                rest = rest[1:]
            out.append({"role": "system", "content": prompt})
        results: list[str] = []  # the run of tool messages not yet written
        for i, m in rest:
            role = m.get("role")
            if role == "tool":
                results.append(_text(m.get("content")))
                continue
            if results:
                out.append({"role": "user", "content": self.tool_response(results)})
                results = []
            content = _text(m.get("content"))
            if role == "assistant" and m.get("tool_calls"):
                calls = [self._history_call(c, f"messages[{i}].tool_calls[{j}]")
                         for j, c in enumerate(m["tool_calls"])]
                text = self.call_text(calls)
                content = f"{content.strip()}\n{text}" if content.strip() else text
            out.append({"role": role, "content": content})
        if results:
            out.append({"role": "user", "content": self.tool_response(results)})
        return out

    @staticmethod
    def _history_call(call: Any, where: str) -> dict:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}: must be {{\"type\": \"function\", \"function\": "
                             "{\"name\": ..., \"arguments\": ...}}")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # shown to the model as the string it was
        return {"name": fn["name"], "arguments": {} if args is None else args}

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) for exactly this format's call text with one
        call (or, ``parallel``, one or more), each ``{"name": <one of tools>, "arguments":
        <an object valid against its parameters>}``, spaced as ``call_text`` spaces it; an
        object schema without ``additionalProperties`` takes only the declared arguments.
        Raises ValueError if ``tools`` is empty."""
        if not tools:
            raise ValueError("tools: a grammar needs at least one tool")
        lit = json.dumps  # a JSON string is a Lark string literal with the same escapes
        more = f" ({lit(self.SEP)} call)*" if parallel else ""
        lines = [f"start: {lit(self.OPEN)} call{more} {lit(self.CLOSE)}",
                 "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            fn = tool["function"]
            # The schema is the root of its own %json, so its "$ref"s to "#/$defs/..." hold.
            # Arguments the function does not declare are not allowed unless the schema says
            # so: a function cannot take them, and a small model would otherwise invent keys.
            schema = {"type": "object", "additionalProperties": False,
                      **(fn.get("parameters") or {}), "x-guidance": JSON_STYLE}
            head = '{"name": ' + lit(fn["name"]) + ', "arguments": '
            lines += [f'call_{i}: {lit(head)} args_{i} "}}"', f"args_{i}: %json {lit(schema)}"]
        return "\n".join(lines) + "\n"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content and the calls of a complete output. Text outside the tags is the
        content (stripped; None when empty); a tag whose text is not valid calls stays in the
        content as it was; an empty list makes no call. Never raises."""
        pieces, calls, pos = [], [], 0
        for m in re.finditer(re.escape(self.START) + "(.*?)" + re.escape(self.END), text,
                             re.DOTALL):
            found = _decode_calls(m.group(1))
            if found is not None:
                pieces.append(text[pos:m.start()])
                calls += found
                pos = m.end()
        pieces.append(text[pos:])
        return "".join(pieces).strip() or None, calls

    def streamer(self) -> ToolCallStreamer:
        """A ``ToolCallStreamer`` for one output of this format."""
        return ToolCallStreamer(self)


class ToolCallStreamer:
    """Splits an output arriving in pieces into content and calls, as ``parse`` would the
    whole: ``feed(delta)`` and then ``finish()`` each return ``(content to send now, calls
    completed now)``. Content before a tag is sent as it comes; text that may be the start of
    a tag is held until it is decided, and a tag until its end arrives. Whitespace is held too
    (sent only when more content follows), so the content sent is ``parse``'s, stripped."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self._buf = ""  # text not yet decided: a possible start of a tag, or a tag's body
        self._in_tag = False
        self._space = ""  # whitespace held back from the end of the content sent
        self._started = False  # any content sent yet (leading whitespace is dropped)

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        start, end = self.parser.START, self.parser.END
        self._buf += delta
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_tag:
                i = self._buf.find(end)
                if i < 0:
                    break
                body, self._buf, self._in_tag = self._buf[:i], self._buf[i + len(end):], False
                found = _decode_calls(body)
                if found is None:
                    self._content(start + body + end, out)
                else:
                    calls += found
                continue
            i = self._buf.find(start)
            if i >= 0:
                self._content(self._buf[:i], out)
                self._buf, self._in_tag = self._buf[i + len(start):], True
                continue
            keep = _partial_suffix(self._buf, start)
            self._content(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end: an unfinished tag, or a held start of one, is content."""
        out: list[str] = []
        self._content((self.parser.START if self._in_tag else "") + self._buf, out)
        self._buf, self._in_tag, self._space = "", False, ""
        return "".join(out), []

    def _content(self, text: str, out: list[str]) -> None:
        text = self._space + text
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        self._space = text[len(body):]
        if body:
            self._started = True
            out.append(body)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class SmolLM2ToolParser(ToolParser):
    """SmolLM2-Instruct's format (its function-calling data): the calls as one JSON list in
    one tag, ``<tool_call>[{"name": "f", "arguments": {...}}, ...]</tool_call>``."""

    name = "smollm2"
    OPEN = "<tool_call>["
    SEP = ", "
    CLOSE = "]</tool_call>"

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            "You are an expert in composing function calls. You are given a question and a "
            "set of possible functions.\n"
            "Based on the question, you need to make one or more function/tool calls to "
            "achieve its purpose.\n"
            "If none of the functions can be used, point that out and do not answer.\n"
            "If the question lacks parameters a function requires, point that out too.\n\n"
            "You have access to the following tools:\n"
            f"<tools>{_dumps(_tool_specs(tools))}</tools>\n\n"
            "The output MUST strictly follow the format below, and NO other text may be "
            "included.\n"
            "Make sure every argument has the right type. If no function call is needed, make "
            "the tool calls an empty list '[]'.\n"
            "<tool_call>[\n"
            '{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": '
            '"value2"}},\n'
            "... (more tool calls as required)\n"
            "]</tool_call>"
        )


class HermesToolParser(ToolParser):
    """The Hermes format (Hermes 2 Pro, Qwen 2.5 and others): one JSON object per tag,
    ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, a tag per call."""

    name = "hermes"
    OPEN = "<tool_call>\n"
    SEP = "\n</tool_call>\n<tool_call>\n"
    CLOSE = "\n</tool_call>"

    def system_prompt(self, tools: list[dict]) -> str:
        listed = "\n".join(_dumps(t) for t in _tool_specs(tools))
        return (
            "You are a function-calling AI model. You may call one or more functions to help "
            "with the user's query. Do not make up values for function arguments.\n\n"
            "The function signatures are given within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a JSON object with the function's name and "
            "arguments within <tool_call></tool_call> XML tags:\n"
            "<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>"
        )


def _tool_specs(tools: list[dict]) -> list[dict]:
    """The tools as the prompt lists them: type, name, description and parameters ("strict"
    is for the server, not the model)."""
    specs = []
    for tool in tools:
        fn = tool["function"]
        spec = {"name": fn["name"]}
        for key in ("description", "parameters"):
            if fn.get(key) is not None:
                spec[key] = fn[key]
        specs.append({"type": "function", "function": spec})
    return specs


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    SmolLM2ToolParser.name: SmolLM2ToolParser,
    HermesToolParser.name: HermesToolParser,
}
DEFAULT_TOOL_PARSER = SmolLM2ToolParser.name


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name``. Raises ValueError listing the known names."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; the parsers are: "
                         + ", ".join(TOOL_PARSERS))
    return TOOL_PARSERS[name]()
