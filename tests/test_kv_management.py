"""KV-cache management end to end on tiny random models: prefix caching, preemption by
recompute and swap under memory pressure, parallel sampling forks, beam search."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch
from _helpers import load_hf, save_tiny_model

from pagedserve import LLM, SamplingParams
from pagedserve.kv.cache import HUGE_PAGE, _huge_page_zeros, _zeros
from pagedserve.sampling_params import BeamSearchParams


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    """A tiny Llama with room for 800-token prefixes."""
    return save_tiny_model(tmp_path_factory.mktemp("long"), "llama", max_position_embeddings=2048)


def tokens(outs):
    return [c.token_ids for o in outs for c in o.outputs]


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompts_with_prefix(prefix_len: int, n: int = 32) -> list[dict]:
    prefix = [(31 * j + 7) % 300 + 3 for j in range(prefix_len)]
    return [{"prompt_token_ids": prefix + [(13 * i + 5 * j) % 300 + 3 for j in range(1 + i % 9)]}
            for i in range(n)]


@pytest.mark.parametrize("prefix_len", [0, 15, 16, 17, 100, 800])
def test_prefix_caching_on_and_off_give_the_same_tokens(long_model, prefix_len):
    prompts = prompts_with_prefix(prefix_len)
    results = {}
    for caching in (False, True):
        llm = LLM(long_model, skip_tokenizer_init=True, num_kv_blocks=2048,
                  enable_prefix_caching=caching, max_num_batched_tokens=1024)
        batch = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        one_by_one = [tokens(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts]
        results[caching] = (batch, one_by_one)
        stats = llm.kv_cache_stats()
        if caching and prefix_len >= 16:
            assert stats.prefix_cache_hits >= (prefix_len // 16) * 16 * 31
        if not caching:
            assert stats.prefix_cache_hits == 0
    assert results[True][0] == results[False][0] == results[True][1] == results[False][1]


def test_shared_system_prompt_is_stored_once(long_model):
    prompts = prompts_with_prefix(800, n=50)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    # a budget that admits all 50 in one step: without sharing they would all be resident
    on = LLM(long_model, skip_tokenizer_init=True, num_kv_blocks=4096,
             max_num_batched_tokens=65536, long_prefill_token_threshold=0)
    outs = on.generate(prompts, params, use_tqdm=False)
    peak = on.kv_cache_stats().peak_used_blocks
    # 800/16 = 50 prefix blocks once, plus each request's tail (suffix + 10 tokens: 1-2 blocks)
    assert peak <= 50 + 50 * 2, peak
    assert all(o.num_cached_tokens == 800 for o in outs[1:])
    off = LLM(long_model, skip_tokenizer_init=True, num_kv_blocks=4096,
              enable_prefix_caching=False, max_num_batched_tokens=65536,
              long_prefill_token_threshold=0)
    assert tokens(off.generate(prompts, params, use_tqdm=False)) == tokens(outs)
    assert off.kv_cache_stats().peak_used_blocks >= 50 * 51  # 50 copies of the prefix


def workload(n: int = 24):
    """Short prompts, long outputs: requests are admitted cheaply and collide as they grow."""
    prompts = [{"prompt_token_ids": [(17 * i + 3 * j) % 300 + 3 for j in range(6 + i % 7)]}
               for i in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=60 + (13 * i) % 41, ignore_eos=True)
              for i in range(n)]
    # blocks of 4 tokens the workload needs with every request resident at full length
    need = sum(-(-(len(pr["prompt_token_ids"]) + p.max_tokens) // 4)
               for pr, p in zip(prompts, params))
    return prompts, params, need


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_ten_percent_pool_finishes_everything_with_the_same_tokens(tiny_llama, mode):
    prompts, params, need = workload()
    roomy = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4)
    ref = tokens(roomy.generate(prompts, params, use_tqdm=False))
    tight = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=need // 10, block_size=4,
                preemption_mode=mode, swap_space=0.01)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == ref  # nothing dropped, duplicated or changed
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    per_request = [o.metrics.num_preemptions for o in outs]
    stats = tight.kv_cache_stats()
    assert stats.num_preemptions == sum(per_request)
    # newest-first preemption never picks the requests that were running from the start
    assert min(per_request[3:]) >= 2, per_request
    if mode == "swap":
        assert stats.num_swapped_out_blocks > 0
        assert stats.num_swapped_in_blocks == stats.num_swapped_out_blocks
    else:
        assert stats.num_swapped_out_blocks == 0 and stats.prefix_cache_hits > 0


def test_swap_space_too_small_falls_back_to_recompute(tiny_llama):
    prompts, params, need = workload()
    ref = tokens(LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4)
                 .generate(prompts, params, use_tqdm=False))
    llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=need // 10, block_size=4,
              preemption_mode="swap", swap_space=1e-5)  # 5 host blocks
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == ref
    assert llm.kv_cache_stats().num_preemptions > 0


def test_request_that_can_never_fit_is_rejected(tiny_llama):
    llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="need up to 32 KV blocks, more than the 16"):
        llm.generate({"prompt_token_ids": [5] * 20}, SamplingParams(n=2, max_tokens=44),
                     use_tqdm=False)
    assert llm.generate({"prompt_token_ids": [5] * 20}, GREEDY, use_tqdm=False)


# ---- parallel sampling ------------------------------------------------------------------------

def test_seeded_n4_is_reproducible_and_independent(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=256, block_size=4)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    first = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    second = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    texts = [c.text for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert texts == [c.text for c in second.outputs]
    assert len(set(texts)) > 1
    single = llm.generate("Once upon a time", SamplingParams(temperature=1.0, seed=7,
                                                            max_tokens=16, ignore_eos=True),
                          use_tqdm=False)[0]
    assert single.outputs[0].token_ids == first.outputs[0].token_ids  # index 0 keeps the seed


@pytest.mark.parametrize("prompt_len", [6, 8])  # fork inside a block / at a block boundary
def test_forks_never_see_each_others_tokens(tiny_llama, prompt_len):
    """Every fork's reported logprobs equal an independent forward pass over its own tokens:
    a fork that read a sibling's K/V (a missing copy-on-write) would get different ones."""
    llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=256, block_size=4,
              prefill_dtype="float32")
    prompt = [(11 * j + 5) % 300 + 3 for j in range(prompt_len)]
    params = SamplingParams(n=4, temperature=1.5, seed=3, max_tokens=12, ignore_eos=True,
                            logprobs=0)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    model = load_hf(tiny_llama)
    for c in out.outputs:
        ids = prompt + c.token_ids
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        expected = [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(c.token_ids)]
        got = [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)]
        assert got == pytest.approx(expected, abs=1e-4)


def test_n_greater_than_one_shares_prompt_blocks(tiny_llama):
    llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=256, block_size=4,
              enable_prefix_caching=False)
    prompt = {"prompt_token_ids": list(range(10, 50))}  # 10 blocks
    llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=8,
                                        ignore_eos=True), use_tqdm=False)
    stats = llm.kv_cache_stats()
    assert stats.peak_used_blocks <= 10 + 4 * 3  # the prompt once, not 4 times
    assert stats.kv_sharing_saving > 0.5


# ---- beam search ------------------------------------------------------------------------------

BEAM_PROMPTS = [[5, 9, 33, 71], [100, 4, 18, 19, 20, 21, 22], [7]]


@pytest.mark.parametrize("eos, length_penalty, early_stopping", [
    (2, 1.0, False), (32, 0.5, True), (166, 2.0, "never"), ([218, 15], -1.0, False),
])
def test_beam_search_matches_transformers(tmp_path, eos, length_penalty, early_stopping):
    path = save_tiny_model(tmp_path, "llama", eos_token_id=eos)
    llm = LLM(path, skip_tokenizer_init=True, num_kv_blocks=256, block_size=4,
              prefill_dtype="float32")
    params = BeamSearchParams(beam_width=4, max_tokens=12, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    ours = llm.beam_search([{"prompt_token_ids": p} for p in BEAM_PROMPTS], params)
    model = load_hf(path)
    for p, o in zip(BEAM_PROMPTS, ours):
        ref = model.generate(torch.tensor([p]), num_beams=4, do_sample=False, max_new_tokens=12,
                             length_penalty=length_penalty, early_stopping=early_stopping,
                             eos_token_id=eos, pad_token_id=0)[0].tolist()
        assert o.sequences[0].tokens == ref
        scores = [s.score for s in o.sequences]
        assert scores == sorted(scores, reverse=True) and len(scores) <= 4
    assert llm.kv_cache_stats().kv_sharing_saving > 0.2


def test_beam_search_under_preemption(tiny_llama):
    params = BeamSearchParams(beam_width=3, max_tokens=20, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(10 + i)]}
               for i in range(6)]
    ref = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=512, block_size=4) \
        .beam_search(prompts, params)
    for mode in ("recompute", "swap"):
        llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=40, block_size=4,
                  max_model_len=40, preemption_mode=mode, swap_space=0.01,
                  max_num_batched_tokens=16)
        got = llm.beam_search(prompts, params)
        assert [o.sequences[0].tokens for o in got] == [o.sequences[0].tokens for o in ref]
        assert llm.kv_cache_stats().num_preemptions > 0


def _run_capped(llm, prompts, params, max_steps: int = 2000):
    """Like generate(), but fails instead of hanging if the scheduler stops making progress."""
    engine = llm.llm_engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    done = {}
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            return [done[str(i)] for i in range(len(prompts))]
    engine.abort_request([str(i) for i in range(len(prompts))])
    raise AssertionError(f"no progress after {max_steps} steps")


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("kind", ["n", "beam"])
def test_multi_sequence_request_in_a_pool_it_barely_fits(tiny_llama, mode, kind):
    """A request whose two sequences just fit the empty pool (2 x 2 blocks of 16) is
    preempted by its neighbour's growth and must come back (a swap-in once asked for a block
    per sequence more than the request's next step needs, and never came back)."""
    from pagedserve.sampling_params import RequestOutputKind

    prompt_a = [(7 * j) % 300 + 3 for j in range(16)]
    prompt_b = [(11 * j) % 300 + 3 for j in range(14)]
    final = RequestOutputKind.FINAL_ONLY
    first = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=final)
    second = (SamplingParams(n=2, seed=1, max_tokens=16, ignore_eos=True, output_kind=final)
              if kind == "n" else BeamSearchParams(beam_width=2, max_tokens=16, ignore_eos=True))
    prompts = [{"prompt_token_ids": prompt_b}, {"prompt_token_ids": prompt_a}]
    roomy = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=64)
    ref = _run_capped(roomy, prompts, [first, second])
    tight = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=4, preemption_mode=mode)
    outs = _run_capped(tight, prompts, [first, second])
    assert tokens(outs) == tokens(ref)
    assert tight.kv_cache_stats().num_preemptions > 0


def test_bad_kv_options_and_params_are_value_errors(tiny_llama):
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False"):
        LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=8, enable_prefix_caching="no")
    with pytest.raises(ValueError, match=r"swap_space must be a number of GiB in \[0, 2\*\*20\)"):
        LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=8, swap_space=2**21)
    for name in ("n", "top_k", "min_tokens"):
        with pytest.raises(ValueError, match=f"{name} must be an integer"):
            SamplingParams(**{name: None})
    llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=32)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match="beam_search"):
        llm.generate(prompt, BeamSearchParams(beam_width=2, max_tokens=3))
    with pytest.raises(ValueError, match="must be SamplingParams or a list"):
        llm.generate(prompt, "temperature=0")
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_contiguous_allocator_same_tokens_lower_utilization(tiny_llama):
    """The pre-paging ablation: max_model_len reserved per request from a first-fit arena.
    Same greedy tokens as paged; fewer requests at once; most reserved slots stay empty."""
    prompts, params, _ = workload(12)
    kwargs = dict(skip_tokenizer_init=True, num_kv_blocks=160, block_size=4, max_model_len=160)
    paged = LLM(tiny_llama, **kwargs)
    ref = tokens(paged.generate(prompts, params, use_tqdm=False))
    contiguous = LLM(tiny_llama, kv_allocator="contiguous", **kwargs)
    assert tokens(contiguous.generate(prompts, params, use_tqdm=False)) == ref
    p, c = paged.kv_cache_stats(), contiguous.kv_cache_stats()
    assert c.max_num_running == 4  # 160 blocks / 40 per reservation
    assert p.max_num_running == 12 and c.num_preemptions == 0
    assert p.reserved_slot_utilization > 0.9 > 0.6 > c.reserved_slot_utilization > 0
    assert c.peak_reserved_slots == 4 * 160
    assert contiguous.llm_engine.block_manager.free_runs == [(0, 160)]  # runs merged back
    with pytest.raises(ValueError, match="one sequence per request"):
        contiguous.generate(prompts[0], SamplingParams(n=2), use_tqdm=False)
    with pytest.raises(ValueError, match="kv_allocator must be"):
        LLM(tiny_llama, kv_allocator="slab", **kwargs)


def test_huge_page_zeros_is_a_zeroed_aligned_tensor_that_owns_its_mapping():
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE on this platform (the cache falls back to calloc)")
    assert _huge_page_zeros((1024,), torch.float32) is None  # under one huge page: calloc
    t = _huge_page_zeros((3, 2, 100, 16, 2, 64), torch.bfloat16)  # 2.5 MB
    assert t.shape == (3, 2, 100, 16, 2, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0 and not t.any()
    t[-1, -1] = 2.5
    gc.collect()  # only the tensor refers to the mapping now
    assert t.float().sum().item() == 2.5 * 100 * 16 * 2 * 64


def test_cache_falls_back_to_calloc_when_the_mapping_fails(monkeypatch):
    def no_mapping(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", no_mapping)
    assert _huge_page_zeros((4 << 20,), torch.float32) is None
    t = _zeros((4 << 20,), torch.float32, torch.device("cpu"), huge_pages=True)
    assert t.shape == (4 << 20,) and not t.any()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_huge_page_cache_gives_the_same_tokens(tiny_llama, kv_cache_dtype):
    """A CPU cache of 1,024 blocks (8 MB; 2 MB for int8) comes from the mapping advised for
    huge pages (zeroed, 2 MB-aligned), one of 64 blocks from calloc: the same greedy tokens."""
    outs = []
    for blocks in (64, 1024):
        llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=blocks,
                  kv_cache_dtype=kv_cache_dtype)
        kv = llm.llm_engine.kv_cache.kv
        assert not kv.any()
        if blocks == 1024 and hasattr(mmap, "MADV_HUGEPAGE"):
            assert kv.data_ptr() % HUGE_PAGE == 0
        outs.append(tokens(llm.generate(prompts_with_prefix(40, 8), GREEDY)))
    assert outs[0] == outs[1]
