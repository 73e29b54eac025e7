"""One request never hurts another: validation against the model before anything is queued,
failures isolated to their request (injected with monkeypatch), hostile HTTP bodies, head-of-line
blocking by huge or slow prompts, and OpenAI's error contract as clients read it."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import pytest
from _helpers import MODEL, LiveServer, pace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve import LLMEngine, SamplingParams
from pagedserve import sampler as sampler_mod
from pagedserve.inputs import ContextLengthError
from pagedserve.output_processor import OutputProcessor

GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = {"good": "the quick brown fox jumps over the lazy dog",
           "bad": "once upon a time there was a little engine"}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(tiny_llama, num_kv_blocks=128, block_size=4, max_model_len=128)


def _run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    """Add every request, step until all finish; {request_id: final RequestOutput}."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def _reference(engine: LLMEngine, params: SamplingParams) -> list[int]:
    return _run(engine, {"ref": (PROMPTS["good"], params)})["ref"].outputs[0].token_ids


def _assert_idle(engine: LLMEngine) -> None:
    pool = engine.block_manager.pool
    assert not engine.has_unfinished_requests() and not engine.requests
    assert pool.num_used_blocks == 0
    pool.check_invariants([])


# ---- failure isolation in the engine ---------------------------------------------------------


def _fail_for(request_id: str, original):
    """``original`` wrapped to raise for sequences of ``request_id``."""
    def wrapped(self, seq, *args, **kwargs):
        if seq.request.request_id == request_id:
            raise RuntimeError("injected failure")
        return original(self, seq, *args, **kwargs)
    return wrapped


@pytest.mark.parametrize("where", ["logprobs", "stop_check", "output", "sampling"])
def test_a_failure_in_one_request_finishes_only_that_request(engine, monkeypatch, where):
    params = SamplingParams(logprobs=2, **GREEDY)
    ref = _reference(engine, params)
    if where == "logprobs":
        monkeypatch.setattr(OutputProcessor, "record_logprobs",
                            _fail_for("bad", OutputProcessor.record_logprobs))
    elif where == "stop_check":
        monkeypatch.setattr(OutputProcessor, "check_stop",
                            _fail_for("bad", OutputProcessor.check_stop))
    elif where == "output":
        original = OutputProcessor.make_output

        def make_output(self, request):
            if request.request_id == "bad":
                raise RuntimeError("injected failure")
            return original(self, request)
        monkeypatch.setattr(OutputProcessor, "make_output", make_output)
    else:  # the batched sampler fails whenever the bad request is in the batch
        original = sampler_mod.build_sampling_metadata

        def metadata(seqs, *args):
            if any(s.request.request_id == "bad" for s in seqs):
                raise RuntimeError("injected failure")
            return original(seqs, *args)
        monkeypatch.setattr(sampler_mod, "build_sampling_metadata", metadata)
    outs = _run(engine, {"good": (PROMPTS["good"], params), "bad": (PROMPTS["bad"], params),
                         "n2": (PROMPTS["good"], SamplingParams(n=2, **GREEDY))})
    bad = outs["bad"]
    assert bad.finished and [c.finish_reason for c in bad.outputs] == ["error"]
    assert "injected failure" in bad.error
    assert outs["good"].error is None and outs["good"].outputs[0].token_ids == ref
    assert [c.token_ids for c in outs["n2"].outputs] == [ref, ref]
    _assert_idle(engine)


def test_a_failed_forward_fails_its_step_and_poisons_no_cache(engine, monkeypatch):
    params = SamplingParams(**GREEDY)
    ref = _reference(engine, params)
    engine.add_request("other", "a prompt that has a few blocks of tokens " * 2, params)
    engine.step()  # "other" is prefilled before the failure and decodes in the failed step
    real = engine.runner.execute
    calls = {"n": 0}

    def failing(sched):
        calls["n"] += 1
        if calls["n"] <= 3:
            raise RuntimeError("injected forward failure")
        return real(sched)
    monkeypatch.setattr(engine.runner, "execute", failing)
    cached_before = set(engine.block_manager.pool.cached)
    # each of three steps fails the requests it scheduled
    final = {}
    for i in range(3):
        engine.add_request(f"p{i}", PROMPTS["good"], params)
        for out in engine.step():
            final[out.request_id] = out
    assert set(final) == {"other", "p0", "p1", "p2"}
    assert all(o.outputs[0].finish_reason == "error" and "injected forward" in o.error
               for o in final.values())
    assert not engine.is_healthy()  # three failed steps in a row
    assert set(engine.block_manager.pool.cached) <= cached_before  # nothing half-written
    _assert_idle(engine)
    # the next step runs again; the prompt's blocks are computed afresh
    out = _run(engine, {"after": (PROMPTS["good"], params)})["after"]
    assert out.error is None and out.outputs[0].token_ids == ref
    assert engine.is_healthy()
    _assert_idle(engine)


# ---- validation against the model (offline) --------------------------------------------------


@pytest.mark.parametrize("prompt, kwargs, words", [
    ("hi", dict(stop_token_ids=[1_000_000], min_tokens=2, max_tokens=4), "stop_token_ids"),
    ("hi", dict(top_k=2**63, max_tokens=3), "top_k"),
    ("hi", dict(top_k=100_000, max_tokens=3), "top_k must be at most the vocabulary size"),
    ("hi", dict(max_tokens=None, min_tokens=1000), "min_tokens"),
    ("hi", dict(max_tokens=2**70), "max_tokens"),
    ("hi", dict(n=2**40), "n"),
    ({"prompt_token_ids": [2**63]}, {}, "outside the vocabulary"),
    ("word " * 2000, {}, "characters"),  # refused before tokenizing
])
def test_requests_are_checked_against_the_model(engine, prompt, kwargs, words):
    with pytest.raises(ValueError, match=words):
        engine.add_request("x", prompt, SamplingParams(**kwargs))
    _assert_idle(engine)


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_the_tokenizer(engine,
                                                                              monkeypatch):
    processor = engine.input_processor
    limit = processor.max_prompt_chars
    assert limit == 128 * max(len(t) for t in engine.tokenizer.get_vocab())
    monkeypatch.setattr(engine.tokenizer, "encode",
                        lambda *a, **k: pytest.fail("the tokenizer ran"))
    with pytest.raises(ContextLengthError, match=f"more than any prompt of 128 tokens can have "
                                                 rf"\({limit}\)"):
        processor.process_prompt("x" * (limit + 1))


_ANY = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3),
                 st.lists(st.integers(-5, 2**64), max_size=3))
_FIELDS = {
    "n": st.one_of(st.integers(1, 3), _ANY), "temperature": st.one_of(st.floats(0, 2), _ANY),
    "top_p": st.one_of(st.floats(0.01, 1), _ANY), "top_k": st.one_of(st.integers(-1, 400), _ANY),
    "min_p": st.one_of(st.floats(0, 1), _ANY), "seed": st.one_of(st.integers(0, 2**64), _ANY),
    "presence_penalty": st.one_of(st.floats(-2, 2), _ANY),
    "repetition_penalty": st.one_of(st.floats(0.5, 2), _ANY),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2), _ANY),
    "stop_token_ids": st.one_of(st.lists(st.integers(0, 400), max_size=3), _ANY),
    "max_tokens": st.one_of(st.integers(1, 8), _ANY), "min_tokens": st.one_of(st.integers(0, 4), _ANY),
    "logprobs": st.one_of(st.integers(0, 3), _ANY),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 2), _ANY),
    "ignore_eos": st.one_of(st.booleans(), _ANY),
}
_PROMPT = st.one_of(st.text(max_size=40),
                    st.builds(lambda ids: {"prompt_token_ids": ids},
                              st.lists(st.integers(-3, 330), max_size=20)),
                    st.builds(lambda ids: {"prompt_token_ids": ids}, _ANY))


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(requests=st.lists(st.tuples(_PROMPT, st.fixed_dictionaries({}, optional=_FIELDS)),
                         min_size=1, max_size=4))
def test_fuzzed_params_and_prompts_fail_only_with_a_value_error_at_add_request(engine,
                                                                              requests):
    added = 0
    for i, (prompt, fields) in enumerate(requests):
        try:
            engine.add_request(f"fuzz-{i}", prompt, SamplingParams(**fields))
            added += 1
        except ValueError:
            pass
    finished = 0
    while engine.has_unfinished_requests():
        for out in engine.step():  # anything raised here fails the test
            assert out.error is None, out.error
            finished += out.finished
    assert finished == added
    _assert_idle(engine)


def test_beam_length_penalty_is_bounded_and_seeds_are_distinct(engine):
    from pagedserve import BeamSearchParams

    for lp in (330.0, -400.0, 1e308):
        with pytest.raises(ValueError, match="length_penalty"):
            BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=lp)
    streams = {}
    for seed in (0, 2**63, -2**63, -1, 2**63 - 1, 2**64 - 1):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)
        streams[seed] = tuple(_run(engine, {"s": ("hello", params)})["s"].outputs[0].token_ids)
    assert len(set(streams.values())) == len(streams)
    out = _run(engine, {"t": ("hello", SamplingParams(max_tokens=3))})["t"]
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    _assert_idle(engine)


# ---- the server: hostile bodies ---------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = LiveServer(LLMEngine(tiny_llama, num_kv_blocks=256, block_size=4))
    yield s
    s.stop()


def _post(server, path: str, body, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"content-type": "application/json", **(headers or {})})


OK = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BIG = 2**63


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 2,
                         "stop_token_ids": [1000000]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "top_k": BIG}, "top_k"),
    ("/v1/completions", {**OK, "top_k": -BIG}, "top_k"),
    ("/v1/completions", {**OK, "n": BIG}, "n"),
    ("/v1/completions", {**OK, "n": -BIG}, "n"),
    ("/v1/completions", {**OK, "max_tokens": BIG * 4}, "max_tokens"),
    ("/v1/completions", {**OK, "min_tokens": BIG}, "min_tokens"),
    ("/v1/completions", {**OK, "seed": 2**64}, "seed"),
    ("/v1/completions", {**OK, "seed": -BIG - 1}, "seed"),
    ("/v1/completions", {**OK, "logprobs": BIG}, "logprobs"),
    ("/v1/completions", {**OK, "best_of": BIG}, "best_of"),
    ("/v1/completions", {**OK, "prompt": [BIG]}, "vocabulary"),
    ("/v1/completions", {**OK, "prompt": [[1, 2], [-1]]}, "vocabulary"),
    ("/v1/completions", {**OK, "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {**OK, "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {**OK, "n": True}, "n"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("/v1/completions", '{"prompt": "hi", "top_p": Infinity}', "top_p"),
    ("/v1/completions", '{"prompt": "hi", "presence_penalty": -Infinity}', "presence_penalty"),
    ("/v1/completions", '{"prompt": "hi", "frequency_penalty": 1e999}', "frequency_penalty"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["a"], "min_p": NaN}', "min_p"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": BIG, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": BIG}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "n": 10**6}, "max_num_seqs"),
    ("/v1/chat/completions", {**CHAT, "guided_choice": []}, "guided_choice"),
    ("/v1/chat/completions", {**CHAT, "guided_json": "{not json"}, "guided_json"),
    ("/v1/chat/completions", {**CHAT, "guided_regex": "(a"}, "guided_regex"),
    ("/v1/chat/completions", {**CHAT, "guided_grammar": "start: nothing_defined"},
     "guided_grammar"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "a+", "choice": ["b"]}},
     "structured_outputs"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "[z-a]"}},
     "structured_outputs.regex"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"json": {"type": 5}}},
     "structured_outputs.json"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"minimum": "a"}}}},
     "response_format.json_schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"},
                              "guided_regex": "a"}, "guided_regex"),
    ("/v1/chat/completions", {**CHAT, "allowed_token_ids": [10**9]}, "allowed_token_ids"),
    ("/v1/chat/completions", {**CHAT, "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/chat/completions", {**CHAT, "bad_words": [""]}, "bad_words"),
    ("/v1/chat/completions", {**CHAT, "continue_final_message": True},
     "continue_final_message"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"tools": []}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {}}]},
     "tools"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ("/v1/completions", {**OK, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/completions", {**OK, "logit_bias": {"5": 1000}}, "logit_bias"),
    ("/v1/completions", {**OK, "logit_bias": {"five": 1}}, "logit_bias"),
    ("/v1/completions", {**OK, "logit_bias": {str(10**9): 1}}, "logit_bias"),
    ("/v1/completions", {**OK, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ("/tokenize", {"prompt": "x" * 10_000_000}, "characters"),
    ("/detokenize", {"tokens": [BIG]}, "vocabulary"),
    # echo without generation is validated like any request
    ("/v1/completions", {**OK, "max_tokens": 0, "echo": True, "n": 500_000}, "n"),
    ("/v1/completions", {**OK, "max_tokens": 0, "echo": True, "n": 0}, "n"),
    ("/v1/completions", {**OK, "max_tokens": 0, "echo": True, "top_k": -5}, "top_k"),
    ("/v1/completions", {**OK, "max_tokens": 0, "echo": True, "stop_token_ids": [10**9]},
     "stop_token_ids"),
    ("/v1/completions", {**OK, "prompt": [[5]] * 3000}, "prompt"),
    ("/v1/completions", {**OK, "prompt": [5] * 5_000_000}, "prompt"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1' + "0" * 5000 + "}", "max_tokens"),
    ("/v1/completions", {**OK, "stop": [f"s{i}" for i in range(1000)]}, "stop"),
    ("/v1/completions", {**OK, "stop_token_ids": list(range(300)) * 20}, "stop_token_ids"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "u" * 4_000_000, "content": "hi"}]},
     "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}] * 700_000}, "messages"),
    ("/tokenize", {"messages": [{"role": "u" * 4_000_000, "content": "hi"}]}, "messages"),
    ("/tokenize", {}, "prompt"),
])
def test_hostile_bodies_get_a_4xx_naming_the_field_and_the_next_request_succeeds(
        server, path, body, field):
    r = _post(server, path, body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert field in err["message"] and err["param"], err
    assert _post(server, "/v1/completions", OK).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
    server.idle()


def test_openai_contract_details(server):
    # integer-valued floats are integers, as in OpenAI's API and vLLM
    r = _post(server, "/v1/completions", {**OK, "max_tokens": 3.0, "n": 1.0, "seed": 7.0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    # off values of unimplemented fields are accepted (clients that send every field)
    r = _post(server, "/v1/chat/completions", {**CHAT, "guided_json": None, "bad_words": [],
                                               "use_beam_search": False, "length_penalty": 1.0})
    assert r.status_code == 200, r.text
    # the model card: listed, fetchable by id, without the server's file path
    card = httpx.get(server.url + f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card == httpx.get(server.url + "/v1/models").json()["data"][0]
    assert os.sep not in json.dumps(card).replace("\\/", "")
    assert httpx.get(server.url + "/v1/models/other").status_code == 404
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    # the context-length error, in OpenAI's words and code
    r = _post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 5000})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert err["message"].startswith("This model's maximum context length is 512 tokens. "
                                     "However, you requested ")


def test_nulls_mean_defaults_echo_shows_id_prompts_and_head_health(server):
    r = _post(server, "/v1/completions", {**OK, "n": None, "stream": None, "echo": None,
                                          "seed": None, "temperature": None})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1
    r = _post(server, "/v1/chat/completions", {**CHAT, "logprobs": None, "n": None})
    assert r.status_code == 200, r.text
    text = _post(server, "/detokenize", {"tokens": [30, 40, 50]}).json()["prompt"]
    r = _post(server, "/v1/completions", {**OK, "prompt": [30, 40, 50], "echo": True,
                                          "temperature": 0})
    assert r.json()["choices"][0]["text"].startswith(text)
    assert httpx.head(server.url + "/health").status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_sends_each_choice_s_finish_once(server, path):
    body = {**(OK if path == "/v1/completions" else CHAT), "max_tokens": 12, "n": 3,
            "seed": 3, "temperature": 1.0, "stream": True}
    body["stop"] = [" ", "e"]  # most choices stop early; the others keep the stream going
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        chunks = [c for line in r.iter_lines() if line.startswith("data: {")
                  for c in json.loads(line[6:])["choices"]]
    finishes = [c["index"] for c in chunks if c["finish_reason"] is not None]
    assert sorted(finishes) == [0, 1, 2]
    last = {c["index"]: n for n, c in enumerate(chunks)}
    assert all(chunks[last[i]]["finish_reason"] for i in range(3))


def test_a_big_batch_whose_client_leaves_is_aborted_at_once(server):
    body = {**OK, "prompt": [[5, k % 300] for k in range(2000)], "max_tokens": 3}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    t0 = time.perf_counter()
    assert _post(server, "/v1/completions", OK).status_code == 200
    assert time.perf_counter() - t0 < 5
    server.idle(timeout=5)


def test_no_empty_delta_in_the_middle_of_a_chat_stream(server):
    """Tokens whose text is held back (a partial UTF-8 character here: the tiny tokenizer splits
    multi-byte characters) send no chunk; their logprobs come with the next text."""
    held = 0
    for seed in range(6):
        body = {**CHAT, "messages": [{"role": "user", "content": "日本語のテキスト 🙂🚀"}],
                "max_tokens": 24, "temperature": 1.0, "seed": seed, "stream": True,
                "logprobs": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                          timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        chunks = [c for e in events for c in e["choices"]]
        for c in chunks[1:]:
            assert c["delta"] or c["finish_reason"], c
        tokens = sum(len(c["logprobs"]["content"]) for c in chunks[1:])
        assert tokens == events[-1]["usage"]["completion_tokens"]
        held += tokens - len(chunks[1:])
    assert held > 0, "no token was held back: the test did not exercise the case"


def test_auth_covers_tokenize_and_leaves_health_and_metrics_open(tiny_llama):
    s = LiveServer(LLMEngine(tiny_llama, num_kv_blocks=64, block_size=4), api_key="k")
    try:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]}),
                           ("/v1/completions", OK)):
            assert _post(s, path, body).status_code == 401
            assert _post(s, path, body, {"authorization": "Bearer k"}).status_code == 200
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/metrics").status_code == 200
    finally:
        s.stop()


# ---- the server: one request's failure, head-of-line blocking --------------------------------


def test_a_request_the_engine_fails_gets_an_error_and_the_others_go_on(server, monkeypatch):
    body = {**OK, "prompt": PROMPTS["good"], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    ref = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    original = OutputProcessor.make_output

    def make_output(self, request):
        if request.prompt == PROMPTS["bad"]:
            raise RuntimeError("injected failure")
        return original(self, request)
    monkeypatch.setattr(OutputProcessor, "make_output", make_output)
    bad = {**body, "prompt": PROMPTS["bad"]}

    async def together():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            plain, good = await asyncio.gather(http.post("/v1/completions", json=bad),
                                               http.post("/v1/completions", json=body))
            async with http.stream("POST", "/v1/completions", json={**bad, "stream": True}) as r:
                events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            return plain, good, events

    plain, good, events = asyncio.run(together())
    assert plain.status_code == 500 and "injected failure" in plain.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == ref
    assert "injected failure" in json.loads(events[-2][6:])["error"]["message"]
    assert events[-1] == "data: [DONE]"
    assert httpx.get(server.url + "/health").status_code == 200
    server.idle()


def _stream_gaps(server, during) -> tuple[float, object]:
    """The largest gap between the chunks of a 60-token stream while ``during()`` runs in
    another thread (started once the stream has begun); (gap in s, during's result)."""
    result = {}
    body = {**OK, "max_tokens": 60, "ignore_eos": True, "stream": True}
    stamps = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
                break
        worker = threading.Thread(target=lambda: result.update(value=during()))
        worker.start()
        for line in lines:
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
        worker.join()
    assert len(stamps) > 30
    return max(b - a for a, b in zip(stamps, stamps[1:])), result.get("value")


@pytest.fixture(scope="module")
def paced_server(tiny_llama):
    """Steps of at least 20 ms, so that a 60-token stream lasts over a second."""
    s = LiveServer(pace(LLMEngine(tiny_llama, num_kv_blocks=256, block_size=4), 0.02))
    yield s
    s.stop()


def test_a_4mb_prompt_does_not_stall_a_running_stream(paced_server):
    big = "lorem ipsum " * (4_000_000 // 12)

    def send_big():
        return [_post(paced_server, "/v1/completions", {**OK, "prompt": big}),
                _post(paced_server, "/tokenize", {"prompt": big}),
                _post(paced_server, "/v1/chat/completions",
                      {**CHAT, "messages": [{"role": "user", "content": big}]})]

    gap, responses = _stream_gaps(paced_server, send_big)
    for r in responses:
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    print(f"largest gap between stream chunks while 4 MB prompts were refused: {gap:.3f} s")
    assert gap < 1.0


def test_a_slow_tokenization_runs_off_the_engine_loop(paced_server, monkeypatch):
    """A prompt that takes the tokenizer 3 s (slowed here) delays only its own request."""
    tokenizer = paced_server.engine.tokenizer
    encode = tokenizer.encode

    def slow_encode(text, *args, **kwargs):
        if "slow" in text:
            time.sleep(3)
        return encode(text, *args, **kwargs)
    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    t0 = time.perf_counter()
    gap, r = _stream_gaps(paced_server, lambda: _post(paced_server, "/v1/completions",
                                                      {**OK, "prompt": "slow prompt"}))
    assert r.status_code == 200 and time.perf_counter() - t0 > 3
    print(f"largest gap between stream chunks during a 3 s tokenization: {gap:.3f} s")
    assert gap < 1.0


@pytest.mark.slow  # importing litellm takes seconds
@pytest.mark.filterwarnings("ignore::UserWarning")  # litellm's own pydantic warnings
def test_litellm_raises_context_window_exceeded(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    litellm = pytest.importorskip("litellm")
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model=f"openai/{MODEL}", api_base=server.url + "/v1", api_key="x",
                           messages=[{"role": "user", "content": "word " * 600}],
                           max_tokens=4, max_retries=0)


def test_tp_timeout_is_generous_and_checked(monkeypatch):
    from pagedserve import envs

    monkeypatch.delenv("PAGEDSERVE_TP_TIMEOUT", raising=False)
    assert envs.tp_timeout() == envs.DEFAULT_TP_TIMEOUT_SECONDS == 600
    monkeypatch.setenv("PAGEDSERVE_TP_TIMEOUT", "30")
    assert envs.tp_timeout() == 30
    for bad in ("0", "-5", "abc", "inf", "nan"):
        monkeypatch.setenv("PAGEDSERVE_TP_TIMEOUT", bad)
        with pytest.raises(ValueError, match="PAGEDSERVE_TP_TIMEOUT"):
            envs.tp_timeout()
