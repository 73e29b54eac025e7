"""Structured outputs (work in progress): choice, regex and JSON schema constraints on a
tiny random model always give matching outputs; forks and preemption keep grammar state."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("llguidance")

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.sampling_params import StructuredOutputsParams as S  # noqa: E402


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=512, block_size=4)


def _texts(llm, spec, n=1, temperature=0.8, max_tokens=60):
    params = SamplingParams(n=n, temperature=temperature, seed=1, max_tokens=max_tokens,
                            structured_outputs=spec)
    outs = llm.generate(["Hello", "The answer is", "JSON:"], params, use_tqdm=False)
    return [c for o in outs for c in o.outputs]


def test_choice_and_regex_always_match(llm):
    for c in _texts(llm, S(choice=["yes", "no", "maybe"]), n=3):
        assert c.text in ("yes", "no", "maybe") and c.finish_reason == "stop", c
    for c in _texts(llm, S(regex=r"[0-9]{3}-[0-9]{4}"), n=3):
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", c.text), c


def test_json_schema_gives_valid_objects(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                     "maximum": 9},
                                               "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    for c in _texts(llm, S(json=schema), n=2, max_tokens=200):
        value = json.loads(c.text)
        assert set(value) == {"a", "b"} and 0 <= value["a"] <= 9 and value["b"] in "xy"


def test_bad_specs_name_the_field(llm):
    with pytest.raises(ValueError, match="exactly one"):
        S(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate("x", SamplingParams(structured_outputs=S(regex="(")), use_tqdm=False)
