"""Tool calling: request validation, prompt rendering, the grammars that force a call (driven
through llguidance with a real byte-level tokenizer), and parsing, whole and streamed."""

from __future__ import annotations

import json
import re

import jinja2
import pytest

from pagedserve.server.tool_parsers import (
    DEFAULT_TOOL_PARSER,
    TOOL_PARSERS,
    ToolCall,
    check_tools,
    forced_tools,
    get_tool_parser,
)

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")


def _tool(name, params=None, description=None):
    fn = {"name": name}
    if description is not None:
        fn["description"] = description
    if params is not None:
        fn["parameters"] = params
    return {"type": "function", "function": fn}


WEATHER = _tool("get_weather", {
    "type": "object",
    "properties": {"city": {"type": "string"},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"],
}, "Current weather in a city")
TIME = _tool("get-time")  # no parameters: no arguments
LOOKUP = _tool("lookup", {  # a schema with references, which must keep resolving
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}},
                        "required": ["x"]}},
    "type": "object", "properties": {"at": {"$ref": "#/$defs/point"}}, "required": ["at"],
})
TOOLS = [WEATHER, TIME, LOOKUP]
PARSERS = sorted(TOOL_PARSERS)


def _calls(text_calls):
    return [(c.name, json.loads(c.arguments)) for c in text_calls]


# -- ToolCall, check_tools, the registry ------------------------------------------------------


def test_tool_call_shape():
    call = ToolCall("f", '{"a": 1}')
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    assert ToolCall("f", "{}").id != call.id
    assert call.to_openai() == {"id": call.id, "type": "function",
                                "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert call.to_openai(index=2) == {"index": 2, **call.to_openai()}


def test_check_tools_accepts_valid_requests():
    check_tools(None, None, None)
    check_tools([], "none", True)
    check_tools(TOOLS, "auto", False)
    check_tools(TOOLS, "required")
    check_tools(TOOLS, {"type": "function", "function": {"name": "get-time"}})
    check_tools([{"type": "function", "function": {"name": "f", "description": "d",
                                                   "strict": True,
                                                   "parameters": {"properties": {}}}}], None)


@pytest.mark.parametrize("tools, choice, parallel, message", [
    ("f", None, None, "tools: must be a list"),
    ([1], None, None, r"tools\[0\]: must be an object"),
    ([{"type": "code", "function": {"name": "f"}}], None, None, r"tools\[0\].type: "),
    ([{"type": "function"}], None, None, r"tools\[0\].function: must be an object"),
    ([WEATHER, _tool("bad name")], None, None, r"tools\[1\].function.name: .*'bad name'"),
    ([WEATHER, _tool("x" * 65)], None, None, r"tools\[1\].function.name: "),
    ([WEATHER, _tool("get_weather")], None, None,
     r"tools\[1\].function.name: duplicate name 'get_weather'"),
    ([_tool("f", description=3)], None, None, r"tools\[0\].function.description: "),
    ([_tool("f", {"type": "string"})], None, None, r"tools\[0\].function.parameters: "),
    ([_tool("f", [])], None, None, r"tools\[0\].function.parameters: "),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], None, None,
     r"tools\[0\].function.strict: "),
    (TOOLS, "always", None, "tool_choice: must be one of 'none', 'auto', 'required'"),
    (TOOLS, {"type": "function", "function": {"name": "x"}}, None,
     "^tool_choice: unknown function 'x'; the tools are: get_weather, get-time, lookup$"),
    (TOOLS, {"type": "function", "name": "x"}, None, "tool_choice: must be"),
    (None, "required", None, "tool_choice: 'required' needs at least one tool"),
    ([], {"type": "function", "function": {"name": "f"}}, None,
     "tool_choice: names function 'f' but there are no tools"),
    (TOOLS, None, "yes", "parallel_tool_calls: must be a boolean"),
])
def test_check_tools_names_the_field(tools, choice, parallel, message):
    with pytest.raises(ValueError, match=message):
        check_tools(tools, choice, parallel)


def test_forced_tools():
    assert forced_tools(TOOLS, None) is None
    assert forced_tools(TOOLS, "auto") is None and forced_tools(TOOLS, "none") is None
    assert forced_tools(TOOLS, "required") == TOOLS
    assert forced_tools(TOOLS, {"type": "function", "function": {"name": "lookup"}}) == [LOOKUP]


def test_registry():
    assert DEFAULT_TOOL_PARSER == "smollm2" and {"smollm2", "hermes"} <= set(TOOL_PARSERS)
    assert get_tool_parser("hermes").name == "hermes"
    with pytest.raises(ValueError, match="unknown parser 'x'; the parsers are: smollm2, hermes"):
        get_tool_parser("x")


# -- rendering --------------------------------------------------------------------------------


def test_messages_pass_through_without_tools():
    parser = get_tool_parser("smollm2")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": None, "name": "bot"}]
    assert parser.render_messages(messages, None) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "name": "bot"}]
    assert parser.render_messages(messages, []) == parser.render_messages(messages, None)


def test_smollm2_system_prompt():
    parser = get_tool_parser("smollm2")
    out = parser.render_messages([{"role": "user", "content": "Weather in Paris?"}], [WEATHER])
    assert [m["role"] for m in out] == ["system", "user"]
    prompt = out[0]["content"]
    tools = re.search(r"\nYou have access to the following tools:\n<tools>(.*)</tools>\n\n",
                      prompt).group(1)
    assert json.loads(tools) == [WEATHER]  # one JSON list of OpenAI-shaped tools
    assert prompt.startswith("You are an expert in composing function calls.")
    assert prompt.endswith('<tool_call>[\n{"name": "func_name1", "arguments": {"argument1": '
                           '"value1", "argument2": "value2"}},\n... (more tool calls as '
                           "required)\n]</tool_call>")
    assert "empty list '[]'" in prompt
    # the request's own system text comes first, in the same system message
    own = parser.render_messages([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hi"}], [WEATHER])
    assert own == [{"role": "system", "content": "Be brief.\n\n" + prompt},
                   {"role": "user", "content": "Hi"}]


def test_hermes_system_prompt_lists_one_tool_per_line():
    prompt = get_tool_parser("hermes").system_prompt([WEATHER, TIME])
    listed = re.search(r"<tools>\n(.*)\n</tools>", prompt, re.DOTALL).group(1).split("\n")
    assert [json.loads(line) for line in listed] == [WEATHER, TIME]
    assert prompt.endswith('<tool_call>\n{"name": <function-name>, "arguments": '
                           "<args-json-object>}\n</tool_call>")


def _conversation():
    call = {"type": "function", "id": "call_1",
            "function": {"name": "get_weather", "arguments": '{"city": "Köln"}'}}
    call2 = {"type": "function", "id": "call_2",
             "function": {"name": "get-time", "arguments": "{}"}}
    return [
        {"role": "user", "content": "Weather and time in Köln?"},
        {"role": "assistant", "content": None, "tool_calls": [call, call2]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
        {"role": "assistant", "content": "21 degrees at 14:05."},
        {"role": "user", "content": "Thanks"},
    ]


@pytest.mark.parametrize("name, calls_text", [
    ("smollm2", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Köln"}}, '
                '{"name": "get-time", "arguments": {}}]</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get-time", "arguments": {}}\n</tool_call>'),
])
def test_render_round_trip(name, calls_text):
    parser = get_tool_parser(name)
    out = parser.render_messages(_conversation(), TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant",
                                        "user"]
    assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in out)
    assert out[2]["content"] == calls_text
    assert out[3]["content"] == ('<tool_response>\n{"temp": 21}\n</tool_response>\n'
                                 "<tool_response>\n14:05\n</tool_response>")
    # what was rendered parses back into the same calls
    content, calls = parser.parse(out[2]["content"])
    assert content is None
    assert _calls(calls) == [("get_weather", {"city": "Köln"}), ("get-time", {})]
    # and any ChatML template renders the messages
    prompt = jinja2.Template(SMOLLM2_TEMPLATE).render(messages=out, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nYou are") and "SmolLM" not in prompt
    assert f"<|im_start|>assistant\n{calls_text}<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")


def test_render_history_without_tools_and_with_content():
    parser = get_tool_parser("smollm2")
    messages = _conversation()
    messages[1]["content"] = "Let me look."
    out = parser.render_messages(messages, None)  # tool turns are rendered even without tools
    assert out[0] == {"role": "user", "content": "Weather and time in Köln?"}
    assert out[1]["content"].startswith("Let me look.\n<tool_call>[")
    assert out[2]["content"].startswith("<tool_response>\n")
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\]: "):
        parser.render_messages([{"role": "user", "content": "x"},
                                {"role": "assistant", "tool_calls": [{"type": "function"}]}])


# -- grammars ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE tokenizer (tests/_helpers.py) and llguidance's view of it."""
    pytest.importorskip("llguidance")
    from _helpers import tiny_tokenizer
    from llguidance.hf import from_tokenizer

    hf = tiny_tokenizer()
    return hf, from_tokenizer(hf)


def _accepts(tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes ``text``, token by token, and can stop after it."""
    import llguidance

    hf, ll = tokenizer
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(grammar),
                                   log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    consumed = matcher.consume_tokens(hf.encode(text, add_special_tokens=False))
    return consumed and matcher.is_accepting()


def _format(parser, calls):
    return parser.call_text([{"name": n, "arguments": a} for n, a in calls])


@pytest.mark.parametrize("name", PARSERS)
def test_grammar_is_valid(name, tokenizer):
    import llguidance

    parser = get_tool_parser(name)
    for tools in ([WEATHER], TOOLS):
        for parallel in (False, True):
            grammar = llguidance.LLMatcher.grammar_from_lark(parser.grammar(tools, parallel))
            assert llguidance.LLMatcher.validate_grammar(grammar, tokenizer[1]) == ""
    with pytest.raises(ValueError, match="tools: "):
        parser.grammar([], False)


@pytest.mark.parametrize("name", PARSERS)
def test_grammar_forces_valid_calls(name, tokenizer):
    parser = get_tool_parser(name)
    one, many = parser.grammar(TOOLS, parallel=False), parser.grammar(TOOLS, parallel=True)
    good = [
        [("get_weather", {"city": "Paris"})],
        [("get_weather", {"city": "Paris", "unit": "celsius", "days": 3})],
        [("get-time", {})],
        [("lookup", {"at": {"x": 1.5}})],
    ]
    for calls in good:
        text = _format(parser, calls)
        assert _accepts(tokenizer, one, text), text
        assert _accepts(tokenizer, many, text), text
    two = _format(parser, [("get_weather", {"city": "Paris"}), ("lookup", {"at": {"x": 0}})])
    assert _accepts(tokenizer, many, two)
    assert not _accepts(tokenizer, one, two)  # parallel=False: exactly one call

    bad = [
        [("get_wether", {"city": "Paris"})],  # not a tool's name
        [("get_weather", {"unit": "celsius"})],  # "city" is required
        [("get_weather", {"city": "Paris", "unit": "kelvin"})],  # not in the enum
        [("get_weather", {"city": "Paris", "days": 9})],  # above the maximum
        [("get_weather", {"city": 3})],  # wrong type
        [("lookup", {"at": {}})],  # the referenced schema requires "x"
        [("get_weather", {"city": "Paris", "color": "red"})],  # not a declared argument
        [("get-time", {"tz": "UTC"})],  # no parameters: no arguments
    ]
    for calls in bad:
        text = _format(parser, calls)
        assert not _accepts(tokenizer, many, text), text
    # a named function: only that tool
    named = parser.grammar([WEATHER], parallel=False)
    assert _accepts(tokenizer, named, _format(parser, good[0]))
    assert not _accepts(tokenizer, named, _format(parser, good[2]))
    # nothing more than the call text: no text around it, no unfinished call
    text = _format(parser, good[0])
    assert not _accepts(tokenizer, one, "Sure! " + text)
    assert not _accepts(tokenizer, one, text + "\n")
    assert not _accepts(tokenizer, one, text[:-3])


@pytest.mark.parametrize("name", PARSERS)
def test_grammar_allows_no_free_whitespace(name, tokenizer):
    parser = get_tool_parser(name)
    tag = _tool("tag", {"type": "object", "properties": {"a": {"type": "array"}}})
    grammar = parser.grammar(TOOLS + [tag], parallel=True)
    text = _format(parser, [("get_weather", {"city": "Paris", "days": 2}),
                            ("tag", {"a": [1, 2]})])
    assert _accepts(tokenizer, grammar, text)
    variants = [
        text.replace('{"city": ', '{"city":'),  # compact separators
        text.replace('{"city"', '{ "city"'),  # a space after "{"
        text.replace("[1, 2]", "[1,  2]"),  # two spaces in a nested array
        text.replace('"get_weather", ', '"get_weather" , '),
        text.replace("}", "} ", 1),
        text.replace("<tool_call>", "<tool_call> ", 1),
    ]
    for variant in variants:
        assert variant != text
        assert not _accepts(tokenizer, grammar, variant), variant


# -- parsing ----------------------------------------------------------------------------------


SMOLLM2_CASES = [
    '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>',
    'Sure.\n<tool_call>[{"name": "a", "arguments": {"x": [1, "</tool"]}}, '
    '{"name": "b", "arguments": {}}]</tool_call>\nDone <tool_ here.',
    "<tool_call>[]</tool_call>",
    "No tool fits this question.",
    '<tool_call>[{"name": "a", "arguments": {"x": 1}]</tool_call>',  # malformed JSON
    '<tool_call>[{"name": "a", "arguments": {"x": 1}}]',  # unfinished
    'x <tool_call>[{"arguments": {}}]</tool_call> y',  # no name
    "  \n <tool_call>[{\"name\": \"a\"}]</tool_call>\n\n",
    '<tool_call>[{"name": "a", "arguments": {}}]</tool_call>oops <tool_call>{"name": "b",'
    ' "arguments": "{\\"k\\": 2}"}</tool_call> <tool_call>',
    "a < b <tool_callx> <<tool_call>[{\"name\": \"é\", \"arguments\": {\"s\": \"日本\"}}]"
    "</tool_call>",
    "",
]
HERMES_CASES = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
    '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "a", "arguments": {"x": }\n</tool_call>',
    "<tool_call>\n{\"name\": \"a\"",
    "Plain answer, <tool_call",
]


def test_parse_smollm2():
    parser = get_tool_parser("smollm2")
    content, calls = parser.parse(SMOLLM2_CASES[0])
    assert content is None and _calls(calls) == [("get_weather", {"city": "Paris"})]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    content, calls = parser.parse(SMOLLM2_CASES[1])
    assert content == "Sure.\n\nDone <tool_ here."
    assert _calls(calls) == [("a", {"x": [1, "</tool"]}), ("b", {})]
    assert parser.parse(SMOLLM2_CASES[2]) == (None, [])  # an empty list: no call
    assert parser.parse(SMOLLM2_CASES[3]) == ("No tool fits this question.", [])
    for text in SMOLLM2_CASES[4:7]:  # malformed: no call, the whole text is the content
        assert parser.parse(text) == (text.strip(), [])
    content, calls = parser.parse(SMOLLM2_CASES[7])
    assert content is None and _calls(calls) == [("a", {})]  # "arguments" may be left out
    content, calls = parser.parse(SMOLLM2_CASES[8])
    assert content == "oops  <tool_call>"
    assert _calls(calls) == [("a", {}), ("b", {"k": 2})]  # arguments given as a JSON text
    content, calls = parser.parse(SMOLLM2_CASES[9])
    assert content == "a < b <tool_callx> <" and _calls(calls) == [("é", {"s": "日本"})]
    assert calls[0].arguments == '{"s": "日本"}'
    assert parser.parse("") == (None, [])
    assert parser.parse("<tool_call>" + "[" * 100_000 + "</tool_call>")[1] == []


def test_parse_hermes():
    parser = get_tool_parser("hermes")
    content, calls = parser.parse(HERMES_CASES[0])
    assert content is None and _calls(calls) == [("get_weather", {"city": "Paris"})]
    content, calls = parser.parse(HERMES_CASES[1])
    assert content == "Let me check." and _calls(calls) == [("a", {"x": 1}), ("b", {})]
    for text in HERMES_CASES[2:]:
        assert parser.parse(text) == (text.strip(), [])


def _stream(parser, pieces):
    streamer = parser.streamer()
    content, calls = "", []
    for piece in pieces:
        text, done = streamer.feed(piece)
        content, calls = content + text, calls + done
    text, done = streamer.finish()
    return content + text, calls


@pytest.mark.parametrize("name, text", [("smollm2", t) for t in SMOLLM2_CASES]
                         + [("hermes", t) for t in HERMES_CASES])
def test_stream_matches_parse_at_every_split(name, text):
    parser = get_tool_parser(name)
    content, calls = parser.parse(text)
    want = (content or "", _calls(calls))
    for i in range(len(text) + 1):
        got, got_calls = _stream(parser, [text[:i], text[i:]])
        assert (got, _calls(got_calls)) == want, i
        for j in range(i, len(text) + 1, 7):
            got, got_calls = _stream(parser, [text[:i], text[i:j], text[j:]])
            assert (got, _calls(got_calls)) == want, (i, j)
    got, got_calls = _stream(parser, list(text))  # a character at a time
    assert (got, _calls(got_calls)) == want


def test_stream_holds_back_only_what_may_be_a_tag():
    streamer = get_tool_parser("smollm2").streamer()
    assert streamer.feed("Hello") == ("Hello", [])
    assert streamer.feed(" there <tool") == (" there", [])  # "<tool" may open a tag
    assert streamer.feed("box>") == (" <toolbox>", [])  # it did not
    assert streamer.feed(" <tool_call>[{\"name\": \"f\", ") == ("", [])
    text, calls = streamer.feed('"arguments": {"a": 1}}]</tool_call> and')
    assert text == "  and" and _calls(calls) == [("f", {"a": 1})]  # released at its end
    assert streamer.feed(" more ") == (" more", [])  # trailing whitespace waits
    assert streamer.feed("\n") == ("", [])
    assert streamer.finish() == ("", [])
