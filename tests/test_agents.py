"""What agent frameworks send, against ``pagedserve serve`` on the real default model: the
official openai client's ``parse`` with pydantic models (streamed and not), guided choice and
regex, langchain-openai's ``with_structured_output`` (both methods) and ``bind_tools`` with
``tool_choice="required"``, and litellm with ``response_format``."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow


class Address(BaseModel):
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


class Person(BaseModel):  # a nested object, an enum, bounded numbers
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)
    role: Literal["engineer", "doctor", "artist", "teacher"]
    address: Address


class Item(BaseModel):
    product: str = Field(max_length=30)
    quantity: int = Field(ge=1, le=10)


class Order(BaseModel):  # an array of objects with bounds
    customer: str = Field(max_length=40)
    items: list[Item] = Field(min_length=1, max_length=3)
    express: bool


class Weather(BaseModel):
    city: str = Field(max_length=30)
    celsius: float = Field(ge=-60, le=60)
    sky: Literal["sunny", "cloudy", "rainy", "snowy"]


Name = Annotated[str, Field(max_length=30)]  # every string bounded: a sampled one ends


class Event(BaseModel):
    title: str = Field(max_length=40)
    attendees: list[Name] = Field(max_length=4)
    priority: Literal["low", "medium", "high"]


class Review(BaseModel):
    rating: int = Field(ge=1, le=5)
    pros: list[Name] = Field(max_length=3)
    recommend: bool


CASES = [
    (Person, ["Describe a fictional engineer.", "Invent a doctor who lives in Spain."]),
    (Order, ["Order two apples and a pear for Ann.", "Make an express order of five pens."]),
    (Weather, ["What might the weather be in Oslo in winter?", "Weather report for Cairo."]),
    (Event, ["Plan a team meeting about the budget.", "A birthday party for Sam."]),
    (Review, ["Review a cheap pair of headphones.", "Review your favourite book."]),
]
MAX_TOKENS = 256


@pytest.fixture(scope="module")
def served(smollm2_path):
    """``pagedserve serve`` on the default model; yields its base URL and model name."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", "serve", "--model", smollm2_path, "--port", "0",
         "--served-model-name", "smol", "--kv-cache-memory", "512MiB"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = None
    deadline = time.time() + 300
    while url is None and time.time() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        found = re.search(r"at (http://\S+/v1)", line)
        url = found.group(1) if found else None
    assert url, "the server did not start"
    yield url, "smol"
    proc.terminate()
    proc.wait(30)


def _client(served):
    import openai

    return openai.OpenAI(base_url=served[0], api_key="none", max_retries=0, timeout=300)


def _parse(served, model, prompt: str, stream: bool):
    client = _client(served)
    messages = [{"role": "user", "content": prompt}]
    if stream:
        with client.chat.completions.stream(model=served[1], messages=messages,
                                            response_format=model,
                                            max_tokens=MAX_TOKENS) as s:
            return s.get_final_completion().choices[0]
    return client.chat.completions.parse(model=served[1], messages=messages,
                                         response_format=model,
                                         max_tokens=MAX_TOKENS).choices[0]


def test_openai_parse_gives_valid_objects_streamed_and_not(served):
    jobs = [(model, prompt, stream) for model, prompts in CASES for prompt in prompts
            for stream in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(lambda job: _parse(served, *job), jobs))
    for (model, prompt, stream), choice in zip(jobs, choices):
        assert choice.finish_reason == "stop", (prompt, stream, choice)
        assert isinstance(choice.message.parsed, model), (prompt, stream, choice)


def test_guided_choice_and_regex_always_match(served):
    client = _client(served)
    ask = [{"role": "user", "content": "Is water wet? Then give a date."}]
    for extra, check in [({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                         ({"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"},
                          lambda t: re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", t))]:
        for seed in range(3):
            r = client.chat.completions.create(model=served[1], messages=ask, max_tokens=20,
                                               temperature=1.0, seed=seed, extra_body=extra)
            assert check(r.choices[0].message.content), (extra, r.choices[0].message.content)


def test_langchain_structured_output_and_required_tools(served):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    chat = langchain_openai.ChatOpenAI(base_url=served[0], api_key="none", model=served[1],
                                       max_tokens=MAX_TOKENS, temperature=0, max_retries=0)
    for method in ("json_schema", "function_calling"):
        out = chat.with_structured_output(Weather, method=method).invoke(
            "What might the weather be in Rome in summer?")
        assert isinstance(out, Weather), (method, out)

    @tool
    def get_weather(city: str, unit: Literal["c", "f"]) -> str:
        """The current weather in a city."""
        return "sunny"

    msg = chat.bind_tools([get_weather], tool_choice="required").invoke(
        "What is the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather", msg
    args = msg.tool_calls[0]["args"]
    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
    assert get_weather.invoke(args) == "sunny"


@pytest.mark.filterwarnings("ignore::UserWarning")  # litellm's own pydantic warnings
def test_litellm_response_format(served, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    litellm = pytest.importorskip("litellm")
    r = litellm.completion(model=f"openai/{served[1]}", api_base=served[0], api_key="none",
                           messages=[{"role": "user", "content": "Review a cheap umbrella."}],
                           response_format=Review, max_tokens=MAX_TOKENS, max_retries=0)
    Review.model_validate(json.loads(r.choices[0].message.content))
