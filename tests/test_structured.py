"""Structured outputs and the logits fields on a tiny random model: choice, regex and JSON
schema outputs always match; grammar state survives preemption (recompute and swap) and n > 1
forks; prefix-cache hits, min_tokens, ignore_eos and max_tokens behave; logit_bias,
allowed_token_ids, bad_words and truncate_prompt_tokens; and the server's surface:
response_format, structured_outputs, guided_*, tools and tool_choice, streamed and not."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from _helpers import MODEL, LiveServer, save_tiny_model

from pagedserve import LLM, LLMEngine, SamplingParams
from pagedserve.sampler import bad_word_ends
from pagedserve.sampling_params import StructuredOutputsParams as S

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "b": {"enum": ["x", "y"]},
                                           "c": {"type": "array", "items": {"type": "boolean"},
                                                 "maxItems": 2}},
          "required": ["a", "b", "c"], "additionalProperties": False}


def _valid(value: dict) -> bool:
    return (set(value) == {"a", "b", "c"} and 0 <= value["a"] <= 9 and value["b"] in "xy"
            and len(value["c"]) <= 2 and all(isinstance(v, bool) for v in value["c"]))


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=512, block_size=4)


def _outputs(llm, spec, n=1, temperature=0.8, max_tokens=60, prompts=("Hello", "The answer is",
                                                                      "JSON:")):
    params = SamplingParams(n=n, temperature=temperature, seed=1, max_tokens=max_tokens,
                            structured_outputs=spec)
    return [c for o in llm.generate(list(prompts), params, use_tqdm=False) for c in o.outputs]


def test_choice_and_regex_always_match(llm):
    for c in _outputs(llm, S(choice=["yes", "no", "maybe"]), n=3):
        assert c.text in ("yes", "no", "maybe") and c.finish_reason == "stop", c
    for c in _outputs(llm, S(regex=r"[0-9]{3}-[0-9]{4}"), n=3):
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", c.text) and c.finish_reason == "stop", c


def test_json_schema_gives_valid_objects_and_length_cuts_mid_structure(llm):
    outs = _outputs(llm, S(json=SCHEMA), n=2, max_tokens=200)
    assert len(outs) == 6
    for c in outs:
        assert _valid(json.loads(c.text)) and c.finish_reason == "stop", c
    for c in _outputs(llm, S(json=SCHEMA), max_tokens=3):
        assert c.finish_reason == "length" and len(c.token_ids) == 3
    for c in _outputs(llm, S(json_object=True), max_tokens=40, temperature=0):
        assert c.finish_reason == "length" or isinstance(json.loads(c.text), dict), c


def test_grammar_ends_the_output_despite_min_tokens_and_ignore_eos(llm):
    for extra in ({"min_tokens": 20}, {"ignore_eos": True}):
        params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=S(
            choice=["yes", "no"]), **extra)
        (c,) = llm.generate("Is it?", params, use_tqdm=False)[0].outputs
        assert c.text in ("yes", "no") and c.finish_reason == "stop", (extra, c)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_grammar_state_survives_preemption(tiny_llama, mode):
    prompts = [f"Request number {i} asks for" for i in range(16)]
    specs = [S(json=SCHEMA), S(regex=r"(ab|cd)+[0-9]{2,30}"), None, S(choice=["alpha", "beta"])]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=specs[i % 4])
              for i in range(15)]
    params.append(SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=20,
                                 structured_outputs=S(json=SCHEMA)))
    roomy = LLM(tiny_llama, num_kv_blocks=512, block_size=4, max_model_len=64)
    ref = roomy.generate(prompts, params, use_tqdm=False)
    assert roomy.kv_cache_stats().num_preemptions == 0
    # about a tenth of the 16 x 12 blocks the requests need together; one fits alone
    tight = LLM(tiny_llama, num_kv_blocks=20, block_size=4, max_model_len=64,
                preemption_mode=mode, swap_space=0.01)
    outs = tight.generate(prompts, params, use_tqdm=False)
    stats = tight.kv_cache_stats()
    assert stats.num_preemptions > 0 and stats.num_used_blocks == 0
    for a, b in zip(ref, outs):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    for out, p in zip(outs, params):
        for c in out.outputs:
            if p.structured_outputs == S(json=SCHEMA):
                assert c.finish_reason == "length" or _valid(json.loads(c.text)), c


def test_prefix_cache_hits_leave_the_output_alone(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=256, block_size=4, enable_prefix_caching=True)
    prompt = "a long shared prompt that fills several blocks of four tokens each " * 2
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=S(json=SCHEMA))
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    second = llm.generate(prompt, params, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0 and first.num_cached_tokens == 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_compiled_grammars_are_cached_and_copied(llm):
    inputs = llm.llm_engine.input_processor
    a = inputs.compile_grammar(SamplingParams(structured_outputs=S(json=SCHEMA)))
    b = inputs.compile_grammar(SamplingParams(structured_outputs=S(json=json.dumps(SCHEMA))))
    assert a is b  # the same spec, whatever its form, compiles once
    m1, m2 = a.new_matcher(), a.new_matcher()
    assert m1 is not m2 and not m1.is_error() and not m1.is_accepting()


def test_bad_specs_name_the_field(llm):
    with pytest.raises(ValueError, match="exactly one"):
        S(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="json_object must be true or false"):
        S(json_object="yes")
    for spec, field in [(S(regex="("), "regex"), (S(json={"type": 5}), "json"),
                        (S(grammar="start: missing_rule"), "grammar")]:
        with pytest.raises(ValueError, match=f"structured_outputs.{field}"):
            llm.generate("x", SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_hostile_specs_are_refused_not_fatal(llm):
    """Compiling recurses as deep as a grammar nests: a chain that overflowed a thread's
    default stack (killing the process) compiles on the compile thread's stack, a longer
    spec is refused, and a spec no text matches is refused before it runs."""
    inputs = llm.llm_engine.input_processor
    n = 1500  # a "$ref" chain twice as long as the one that crashed on the default stack
    defs = {f"n{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/n{i + 1}"}}}
            for i in range(n)}
    defs[f"n{n}"] = {"type": "integer"}
    chain = SamplingParams(structured_outputs=S(json={"$defs": defs, "$ref": "#/$defs/n0"}))
    assert inputs.compile_grammar(chain).new_matcher() is not None
    rules = "\n".join(f'r{i}: "t{i}" r{i + 1} | "e"' for i in range(10_000))
    with pytest.raises(ValueError, match="structured_outputs.grammar: the spec has"):
        inputs.compile_grammar(SamplingParams(structured_outputs=S(
            grammar=f"start: r0\n{rules}\nr10000: \"end\"")))
    for spec in (S(regex=r"[^\s\S]"), S(grammar='start: a\na: a "x"')):
        with pytest.raises(ValueError, match="no text matches it"):
            inputs.compile_grammar(SamplingParams(structured_outputs=spec))
    # a grammar and allowed_token_ids that leave nothing: that request fails, alone
    params = [SamplingParams(max_tokens=4, structured_outputs=S(choice=["yes", "no"]),
                             allowed_token_ids=[5]), SamplingParams(max_tokens=4)]
    bad, good = llm.generate(["a", "b"], params, use_tqdm=False)
    assert bad.outputs[0].finish_reason == "error" and "no token can be generated" in bad.error
    assert good.outputs[0].finish_reason == "length"


def test_logit_bias_allowed_token_ids_and_bad_words(llm):
    base = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = llm.generate("Once upon a time", base, use_tqdm=False)[0].outputs[0].token_ids
    favourite = 40
    biased = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                            logit_bias={favourite: 100})
    assert llm.generate("Once upon a time", biased, use_tqdm=False)[0].outputs[0].token_ids \
        == [favourite] * 8
    against = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                             logit_bias={plain[0]: -100})
    assert plain[0] not in llm.generate("Once upon a time", against,
                                        use_tqdm=False)[0].outputs[0].token_ids
    only = SamplingParams(temperature=1.0, seed=5, max_tokens=30, ignore_eos=True,
                          allowed_token_ids=[7, 11, 13])
    assert set(llm.generate("Once", only, use_tqdm=False)[0].outputs[0].token_ids) <= {7, 11, 13}
    tokenizer = llm.get_tokenizer()
    word = tokenizer.decode([plain[0]]).strip()
    banned = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word])
    out = llm.generate("Once upon a time", banned, use_tqdm=False)[0].outputs[0].token_ids
    assert out[0] != plain[0]
    for bad in ([""], "word", [5]):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=bad)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate("x", SamplingParams(allowed_token_ids=[10**9]), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101})


def test_bad_word_ends_match_the_output_tail():
    words = [[5], [1, 2, 3], [9, 9]]
    assert bad_word_ends(words, []) == [5]
    assert bad_word_ends(words, [7, 1, 2]) == [5, 3]
    assert bad_word_ends(words, [1, 2, 4]) == [5]
    assert bad_word_ends(words, [9]) == [5, 9]


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = list(range(3, 40))
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2,
                                                                 truncate_prompt_tokens=5),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-5:]
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


# ---- the server -----------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "y": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x", "y"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # the tool prompt takes about a thousand tokens of the tiny vocabulary: a longer context
    path = save_tiny_model(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=2048)
    s = LiveServer(LLMEngine(path, num_kv_blocks=1024, block_size=4))
    yield s
    s.stop()


def _check_call(call: dict, names=("get_weather", "add")) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_")
    name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
    assert name in names
    if name == "get_weather":
        assert set(args) >= {"city", "unit"} and args["unit"] in "cf"
    else:
        assert isinstance(args["x"], int) and isinstance(args["y"], int)


def test_server_response_format_and_vllm_fields(server):
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, seed=1,
                                       temperature=0.7, response_format=fmt, n=2)
    assert all(_valid(json.loads(c.message.content)) for c in r.choices)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200,
                                            response_format=fmt, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert _valid(json.loads(text))
    r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=40, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(r.choices[0].text),
                                                                dict)
    for extra, check in [({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
                         ({"guided_regex": "[a-c]{4}"}, lambda t: re.fullmatch("[a-c]{4}", t)),
                         ({"structured_outputs": {"choice": ["one", "two"]}},
                          lambda t: t in ("one", "two")),
                         ({"guided_json": SCHEMA}, lambda t: _valid(json.loads(t)))]:
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=100,
                                           extra_body=extra)
        assert check(r.choices[0].message.content), (extra, r.choices[0].message.content)
    server.idle()


def test_server_tool_choice_required_named_and_streamed(server):
    for choice, parallel in [("required", True), ("required", False),
                             ({"type": "function", "function": {"name": "add"}}, True)]:
        body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": choice,
                "parallel_tool_calls": parallel, "max_tokens": 200, "temperature": 0.9,
                "seed": 4}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
        choice0 = r["choices"][0]
        if parallel and choice0["finish_reason"] == "length":  # a random model may go on
            continue                                          # adding calls
        assert choice0["finish_reason"] == "tool_calls", r
        calls = choice0["message"]["tool_calls"]
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            _check_call(call, ("add",) if isinstance(choice, dict) else ("get_weather", "add"))
    client = server.client()
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False,
                                            max_tokens=200, stream=True)
    deltas, finish = [], None
    for ch in stream:
        if ch.choices and ch.choices[0].delta.tool_calls:
            deltas += ch.choices[0].delta.tool_calls
        if ch.choices and ch.choices[0].finish_reason:
            finish = ch.choices[0].finish_reason
    assert finish == "tool_calls" and deltas
    for i, d in enumerate(deltas):
        assert d.index == i
        _check_call({"id": d.id, "type": d.type, "function": d.function.model_dump()})
    server.idle()


def test_server_tool_auto_none_and_history(server):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    for choice in ("auto", "none", None):
        body = {"model": MODEL, "messages": history, "tools": TOOLS, "max_tokens": 10}
        if choice is not None:
            body["tool_choice"] = choice
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    server.idle()


def test_server_chat_template_options(server):
    cont = ASK + [{"role": "assistant", "content": "The weather is"}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": cont, "continue_final_message": True, "max_tokens": 3,
        "add_generation_prompt": False})
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": cont, "continue_final_message": True,
        "add_generation_prompt": True, "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "chat_template_kwargs": {"enable_thinking": False},
        "max_tokens": 3, "truncate_prompt_tokens": 4, "logit_bias": {"40": 100},
        "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 4
    server.idle()
