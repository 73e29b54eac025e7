"""The OpenAI-compatible server: a real uvicorn server on 127.0.0.1 (a free port) serving a
tiny random Llama, driven with the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from _helpers import MODEL, LiveServer, pace
from prometheus_client.parser import text_string_to_metric_families

from pagedserve import LLMEngine


@pytest.fixture(scope="module", params=[1, pytest.param(2, marks=pytest.mark.slow)],
                ids=["tp1", "tp2"])
def server(tiny_llama, request):
    """The openai-client tests run against one engine process and against two tensor-parallel
    workers (the tiny Llama's 2 KV heads, one per rank)."""
    engine = LLMEngine(tiny_llama, num_kv_blocks=256, block_size=4,
                       tensor_parallel_size=request.param)
    s = LiveServer(engine)
    yield s
    s.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama):
    """One engine process: the fuzz exercises the HTTP layer's validation (httpx, not the
    openai client), and 300 bodies over gloo would take minutes on 2 cores."""
    engine = LLMEngine(tiny_llama, num_kv_blocks=256, block_size=4)
    s = LiveServer(engine)
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return server.client()


# ---- the openai client ---------------------------------------------------------------------


def test_completion_and_usage_with_cached_tokens(client):
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert first.object == "text_completion" and first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 5
    assert first.usage.total_tokens == first.usage.prompt_tokens + 5
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].text == first.choices[0].text
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 4 == 0 and cached < again.usage.prompt_tokens


def test_chat_streaming_equals_non_streaming(client):
    messages = [{"role": "user", "content": "hello there, how are you?"}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_stream_n2_seed_stop_and_logprobs(client):
    kwargs = dict(model=MODEL, prompt="once upon a time", max_tokens=10, n=2, seed=12,
                  temperature=1.0, logprobs=2, extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert a.choices[0].text != a.choices[1].text
    lp = a.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs)
    assert "".join(lp.tokens) == a.choices[0].text
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[0], streamed[1]] == [c.text for c in a.choices]
    # a stop string taken from the seeded text ends it there, in both modes
    text = a.choices[0].text
    stop = text[3:6]
    cut = text[:text.index(stop)]
    s = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=10,
                                  seed=12, temperature=1.0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert s.choices[0].text == cut and s.choices[0].finish_reason == "stop"
    parts = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="once upon a time", max_tokens=10, seed=12, temperature=1.0,
        stop=[stop], stream=True, extra_body={"ignore_eos": True})]
    assert "".join(parts) == cut


def test_prompt_forms_and_echo(client):
    r = client.completions.create(model=MODEL, prompt=["a b c", "d e f"], max_tokens=3,
                                  temperature=0, echo=True, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text.startswith("a b c") and r.choices[1].text.startswith("d e f")
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == 3
    many = client.completions.create(model=MODEL, prompt=[[5, 6], [7, 8, 9]], max_tokens=2)
    assert many.usage.prompt_tokens == 5 and len(many.choices) == 2
    echo0 = client.completions.create(model=MODEL, prompt="a b c", max_tokens=0, echo=True)
    assert echo0.choices[0].text == "a b c" and echo0.choices[0].finish_reason == "length"
    assert echo0.usage.completion_tokens == 0
    chunks = list(client.completions.create(model=MODEL, prompt="a b c", max_tokens=0,
                                            echo=True, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].text == "a b c" and chunks[-1].usage.prompt_tokens > 0


def test_chat_logprobs_and_max_completion_tokens(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4,
        logprobs=True, top_logprobs=3, temperature=0, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and r.usage.completion_tokens == 4
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob
               for t in content)
    # greedy: the chosen token is the most likely one
    assert all(t.token == t.top_logprobs[0].token for t in content)


def test_models_health_tokenize_detokenize(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    t = httpx.post(server.url + "/tokenize", json={"prompt": "a b c"}).json()
    assert t["count"] == len(t["tokens"]) > 0
    d = httpx.post(server.url + "/detokenize", json={"tokens": t["tokens"]}).json()
    assert "a b c" in d["prompt"]
    chat = httpx.post(server.url + "/tokenize",
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 0


# ---- bad input: the right status, then the next request succeeds ---------------------------


def _post(server, path: str, body, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=30,
                      headers={"content-type": "application/json", **(headers or {})})


OK_COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {**OK_COMPLETION, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {**OK_COMPLETION, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {**OK_COMPLETION, "n": 0}, 400, "n must be"),
    ("/v1/completions", {**OK_COMPLETION, "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {**OK_COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": ""}, 400, "empty"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": []}, 400, "empty"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": [999999]}, 400, "vocabulary"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": [5] * 600}, 400, "600"),
    ("/v1/completions", {**OK_COMPLETION, "max_tokens": 100000}, 400, "100000"),
    ("/v1/completions", {**OK_COMPLETION, "model": "gpt-4"}, 404, "gpt-4"),
    ("/v1/completions", {**OK_COMPLETION, "logprobs": 50}, 400, "logprobs"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {**OK_CHAT, "top_logprobs": 2}, 400, "logprobs"),
    ("/v1/chat/completions", {**OK_CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {**OK_CHAT, "model": "nope"}, 404, "nope"),
    ("/v1/chat/completions", {**OK_CHAT, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs must be in [0, 20]"),
    ("/v1/chat/completions", {**OK_CHAT, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/chat/completions", {**OK_CHAT, "response_format": {"type": "json"}}, 400,
     "response_format"),
    ("/v1/completions", {**OK_COMPLETION, "best_of": 3}, 400, "best_of"),
    ("/v1/chat/completions", {**OK_CHAT, "stream_options": {"include_usage": True}}, 400,
     "stream_options: only allowed with stream=true"),
    ("/v1/completions", {**OK_COMPLETION, "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "vocabulary"),
])
def test_bad_input_gets_its_status_and_the_server_goes_on(server, client, path, body, status,
                                                          words):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    code = "context_length_exceeded" if "maximum context length" in err["message"] else status
    assert words in err["message"] and err["code"] == code
    assert client.completions.create(**OK_COMPLETION).choices[0].finish_reason
    server.idle()


@pytest.mark.parametrize("field, value", [("temperature", -1), ("top_p", 0), ("n", 0),
                                          ("max_completion_tokens", 0), ("stop", [""])])
def test_field_errors_name_their_param(server, field, value):
    r = _post(server, "/v1/chat/completions", {**OK_CHAT, field: value})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


def test_prompt_plus_max_tokens_names_both_numbers(server):
    r = _post(server, "/v1/completions", {**OK_COMPLETION, "prompt": [5] * 500,
                                          "max_tokens": 20})
    assert r.status_code == 400
    assert "500" in r.json()["error"]["message"] and "20" in r.json()["error"]["message"]


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])


def test_unknown_route_and_method_are_json_errors(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_body_size_limit_auth_and_queue_limit(tiny_llama):
    engine = LLMEngine(tiny_llama, num_kv_blocks=64, block_size=4, max_num_seqs=1)
    s = LiveServer(engine, api_key="sekret", max_num_waiting=1, max_body_bytes=2000)
    try:
        assert _post(s, "/v1/completions", OK_COMPLETION).status_code == 401
        good = s.client(api_key="sekret")
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").models.list()
        assert good.completions.create(**OK_COMPLETION).usage.completion_tokens
        lower = _post(s, "/v1/completions", OK_COMPLETION, {"authorization": "bearer sekret"})
        assert lower.status_code == 200  # the scheme name is case-insensitive (RFC 9110)
        # more prompts than max_num_waiting in one request: accepted when nothing waits
        many = _post(s, "/v1/completions", {**OK_COMPLETION, "prompt": ["a", "b", "c"]},
                     {"authorization": "Bearer sekret"})
        assert many.status_code == 200 and len(many.json()["choices"]) == 3
        big = {**OK_COMPLETION, "prompt": "x " * 5000}
        r = _post(s, "/v1/completions", big, headers={"authorization": "Bearer sekret"})
        assert r.status_code == 413
        assert httpx.get(s.url + "/health").status_code == 200  # not under /v1: no auth

        # one request runs (max_num_seqs=1), one waits, the next is refused with 429
        async def burst():
            async with httpx.AsyncClient(timeout=60) as http:
                long = {**OK_COMPLETION, "max_tokens": 40, "ignore_eos": True}
                return await asyncio.gather(*(http.post(
                    s.url + "/v1/completions", json=long,
                    headers={"authorization": "Bearer sekret"}) for _ in range(4)))

        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert codes[0] == 200 and codes[-1] == 429, codes
        assert all(r.headers["retry-after"] == "1" for r in responses if r.status_code == 429)
        assert good.completions.create(**OK_COMPLETION).usage.completion_tokens
    finally:
        s.stop()


def test_logprobs_are_finite_json(server):
    # top_k=1 leaves every other token at -inf; its logprob must still be a JSON number
    body = {**OK_COMPLETION, "max_tokens": 3, "logprobs": 3, "top_k": 1, "temperature": 1.0}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200
    json.loads(r.text, parse_constant=lambda c: pytest.fail(f"non-finite {c}"))


# ---- disconnects, metrics ------------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_server(tiny_llama):
    """Steps take at least 10 ms, so a 400-token request runs for 4 s or more: an abort that
    lands within 2 s is the disconnect's doing, not the request finishing."""
    s = LiveServer(pace(LLMEngine(tiny_llama, num_kv_blocks=2048, block_size=4), 0.01))
    yield s
    s.stop()


def test_twenty_clients_dropping_mid_stream_free_everything(slow_server):
    server = slow_server

    async def drop_one(http: httpx.AsyncClient, i: int) -> None:
        body = {**OK_COMPLETION, "max_tokens": 400, "ignore_eos": True, "stream": True,
                "prompt": f"client {i} says hello"}
        async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    break  # one chunk received, then hang up

    async def main():
        async with httpx.AsyncClient(timeout=60) as http:
            await asyncio.gather(*(drop_one(http, i) for i in range(20)))

    before = server.engine.stats.num_generation_tokens
    asyncio.run(main())
    server.idle(timeout=2.0)
    assert not server.engine.requests
    assert server.engine.stats.num_generation_tokens - before < 20 * 400  # aborted, not finished
    deadline = time.time() + 2  # and /metrics says so, with no request after them
    while (m := _metrics(server))["pagedserve:num_requests_running"] or \
            m["pagedserve:kv_cache_usage_perc"]:
        assert time.time() < deadline, m
        time.sleep(0.05)


def test_non_streaming_client_timeout_aborts(slow_server):
    body = {**OK_COMPLETION, "max_tokens": 400, "ignore_eos": True}
    before = slow_server.engine.stats.num_generation_tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_server.url + "/v1/completions", json=body, timeout=0.3)
    slow_server.idle(timeout=2.0)
    assert slow_server.engine.stats.num_generation_tokens - before < 400


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values.setdefault(sample.name, sample.value)
    return values


def test_metrics_parse_and_kv_usage_moves_under_load(server, client):
    before = _metrics(server)
    for name in ("pagedserve:kv_cache_usage_perc", "pagedserve:num_requests_running",
                 "pagedserve:num_requests_waiting", "pagedserve:num_requests_swapped",
                 "pagedserve:prefix_cache_queries_total", "pagedserve:prefix_cache_hits_total",
                 "pagedserve:num_preemptions_total", "pagedserve:prompt_tokens_total",
                 "pagedserve:generation_tokens_total",
                 "pagedserve:time_to_first_token_seconds_count",
                 "pagedserve:time_per_output_token_seconds_count",
                 "pagedserve:e2e_request_latency_seconds_count"):
        assert name in before, name
    seen = []
    done = threading.Event()

    def load():
        with server.client() as c:
            for _chunk in c.completions.create(model=MODEL, prompt="load " * 20, max_tokens=150,
                                              n=4, stream=True, extra_body={"ignore_eos": True}):
                pass
        done.set()

    t = threading.Thread(target=load)
    t.start()
    while not done.is_set():
        seen.append(_metrics(server)["pagedserve:kv_cache_usage_perc"])
        time.sleep(0.02)
    t.join()
    after = _metrics(server)
    assert max(seen) > 0
    assert after["pagedserve:generation_tokens_total"] - \
        before["pagedserve:generation_tokens_total"] >= 600
    assert after["pagedserve:e2e_request_latency_seconds_count"] > \
        before["pagedserve:e2e_request_latency_seconds_count"]
    server.idle()
    assert _metrics(server)["pagedserve:kv_cache_usage_perc"] == 0


# ---- fuzz: no 500, no hang -------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_junk = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                  st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                  st.lists(st.integers(-5, 10**6), max_size=4), st.just({"a": 1}))


_SAMPLING = {
    "model": st.just(MODEL),
    "n": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2**32),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "cache_salt": st.text(max_size=5),
    "max_tokens": st.integers(-1, 6),
    "logprobs": st.integers(0, 5),
}
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                  "content": st.text(min_size=1, max_size=20)})
_PROMPT = st.one_of(st.text(min_size=1, max_size=30),
                    st.lists(st.integers(0, 300), min_size=1, max_size=8),
                    st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3),
                    st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=4), min_size=1,
                             max_size=2))


@st.composite
def _bodies(draw, required: dict, optional: dict) -> dict:
    """A schema-valid body (types right, values anywhere near their range), and in half the
    cases one field replaced by a value of any JSON type, or removed."""
    body = draw(st.fixed_dictionaries(required, optional=optional))
    if draw(st.booleans()):
        field = draw(st.sampled_from(sorted({**required, **optional})))
        if draw(st.integers(0, 4)) == 0:
            body.pop(field, None)
        else:
            body[field] = draw(_junk)
    return body


_COMPLETION = _bodies({"prompt": _PROMPT}, {**_SAMPLING, "echo": st.booleans()})
_CHAT = _bodies({"messages": st.lists(_message, min_size=1, max_size=3)},
                {**_SAMPLING, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
                 "max_completion_tokens": st.integers(0, 6)})


def _send(server, path: str, body: dict) -> None:
    text = json.dumps(body)  # NaN/Infinity go out as JSON extensions, as some clients send
    with httpx.stream("POST", server.url + path, content=text, timeout=30,
                      headers={"content-type": "application/json"}) as r:
        payload = r.read().decode()
    assert r.status_code in (200, 400, 404), (r.status_code, payload, body)
    if r.status_code == 200 and payload.startswith("data:"):
        assert payload.rstrip().endswith("data: [DONE]"), payload
    elif r.status_code != 200:
        assert "error" in json.loads(payload)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_COMPLETION)
def test_fuzz_completions(fuzz_server, body):
    _send(fuzz_server, "/v1/completions", body)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_CHAT)
def test_fuzz_chat(fuzz_server, body):
    _send(fuzz_server, "/v1/chat/completions", body)


@pytest.mark.slow
def test_server_is_clean_after_fuzzing(fuzz_server):
    fuzz_server.idle()
    client = fuzz_server.client()
    assert client.completions.create(**OK_COMPLETION).choices[0].finish_reason


# ---- the CLI --------------------------------------------------------------------------------


@pytest.mark.slow
def test_pagedserve_serve_prints_url_serves_and_stops_on_sigterm(tiny_llama):
    import os
    import re
    import signal
    import subprocess
    import sys

    env = {**os.environ, "PAGEDSERVE_API_KEY": "k1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", "serve", "--model", tiny_llama, "--port", "0",
         "--num-kv-blocks", "64", "--served-model-name", "tiny-cli"],
        stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = None
        for line in proc.stderr:
            m = re.search(r"serving 'tiny-cli' at (http://\S+/v1)", line)
            if m:
                url = m.group(1)
                break
        assert url, "no URL printed"
        c = openai.OpenAI(base_url=url, api_key="k1", max_retries=0, timeout=30)
        r = c.completions.create(model="tiny-cli", prompt="hello", max_tokens=3,
                                 extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("args, message", [
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--max-num-waiting", "-1"], "--max-num-waiting must be >= 0"),
    (["--host", "256.1.1.1", "--port", "0"], "cannot listen on 256.1.1.1:0"),
])
def test_serve_bad_flags_are_one_line_errors(tiny_llama, args, message, capsys):
    from pagedserve.cli import main

    assert main(["serve", "--model", tiny_llama, "--num-kv-blocks", "16", *args]) == 2
    assert message in capsys.readouterr().err


def test_chat_on_a_model_without_a_chat_template_says_why(tmp_path):
    """A base model (no chat template, as gemma3-270m) answers chat with a 400 naming the
    reason; completions work."""
    from _helpers import save_base_model

    engine = LLMEngine(save_base_model(tmp_path / "base"), num_kv_blocks=64, block_size=4)
    s = LiveServer(engine)
    try:
        r = _post(s, "/v1/chat/completions", {**OK_CHAT, "max_tokens": 2})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        r = _post(s, "/v1/completions", {"model": MODEL, "prompt": "a b", "max_tokens": 2,
                                           "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        s.stop()
