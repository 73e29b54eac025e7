"""Hybrid KV paging without a model: KV groups from layer windows, sliding-window groups
returning the blocks their window passed, prefix hits, forks and swap per group, and the
blocks a long Gemma 3 sequence holds."""

from __future__ import annotations

import math

import pytest
from _helpers import make_sequence

from pagedserve.config import SchedulerConfig
from pagedserve.core.block_manager import NULL_BLOCK, BlockManager
from pagedserve.core.scheduler import Scheduler
from pagedserve.kv.spec import kv_layout
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence

GEMMA3_270M = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]  # 3 global, 15 local


def seq_of(tokens, rid="r", max_tokens=64):
    return make_sequence(list(tokens), SamplingParams(max_tokens=max_tokens), request_id=rid)


def run(bm: BlockManager, seq: Sequence, n: int, hits=None):
    """One step of ``n`` tokens as the scheduler runs it: allocate, compute, slide."""
    hits = [] if hits is None else hits
    assert bm.can_allocate([(seq, n, hits)])
    bm.allocate(seq, n, hits, [])
    seq.num_computed_tokens += n
    bm.slide(seq)


def live(table):
    return [b for b in table if b != NULL_BLOCK]


def test_layout_groups_layers_by_window():
    layout = kv_layout(GEMMA3_270M)
    assert layout.slots == 3 and layout.windows == (None,) + (512,) * 5
    assert layout.groups[0].layers == (5, 11, 17)
    assert layout.groups[1].layers == (0, 1, 2) and layout.groups[2].layers == (3, 4, 6)
    assert sorted(i for g in layout.groups for i in g.layers) == list(range(18))
    assert layout.layer_slot(11) == (0, 1) and layout.layer_slot(6) == (2, 2)
    # one kind of attention, or hybrid paging off: one group of every layer
    assert kv_layout([None] * 30).groups[0].layers == tuple(range(30))
    assert kv_layout([4096] * 4).windows == (4096,)
    assert kv_layout(GEMMA3_270M, hybrid=False).windows == (None,)
    # uneven kinds: groups as large as the rarest kind, the last one short
    odd = kv_layout([None, 8, 8, None, 8, 8, 8])
    assert odd.slots == 2 and [len(g.layers) for g in odd.groups] == [2, 2, 2, 1]


@pytest.mark.parametrize("length", [4096, 8192])
def test_gemma3_local_groups_hold_only_their_window(length):
    """A Gemma 3 270M sequence prefilled in 512-token chunks and decoded to ``length``: every
    local group ends with at most ceil(512 / 16) + 1 blocks, and the whole sequence holds
    3.5x (4,096 tokens) or 4.4x (8,192) fewer bytes than with every layer kept whole."""
    bs, window = 16, 512
    hybrid = BlockManager(2000, bs, windows=kv_layout(GEMMA3_270M).windows)
    whole = BlockManager(2000, bs, windows=kv_layout(GEMMA3_270M, hybrid=False).windows)
    seqs = {}
    for bm in (hybrid, whole):
        seq = seqs[bm] = seq_of(range(3, 3 + length - 100), max_tokens=100)
        while seq.num_computed_tokens < seq.num_tokens:
            run(bm, seq, min(512, seq.num_tokens - seq.num_computed_tokens))
        for _ in range(100):  # decode the rest one token at a time
            seq.append_token(5)
            run(bm, seq, 1)
            for g in bm.windowed:
                assert len(live(seq.block_tables[g])) <= math.ceil(window / bs) + 1
        assert seq.num_computed_tokens == length
    held = [len(live(t)) for t in seqs[hybrid].block_tables]
    assert held[0] == length // bs  # the global layers keep every block
    assert all(h <= math.ceil(window / bs) + 1 for h in held[1:])
    assert hybrid.pool.num_used_blocks == sum(held)
    # a hybrid block holds 3 layers, a whole one 18: compare bytes, not blocks
    ratio = (whole.pool.num_used_blocks * 18) / (hybrid.pool.num_used_blocks * 3)
    assert ratio >= (3.5 if length == 4096 else 4.4), ratio
    assert hybrid.pool.num_used_blocks <= kv_layout(GEMMA3_270M).blocks_per_seq(length, bs, 1)


def test_window_blocks_return_to_the_pool_and_tables_stay_positional():
    bm = BlockManager(64, 4, windows=(None, 6))
    seq = seq_of(range(3, 23))  # 20 tokens
    run(bm, seq, 20)
    full, local = seq.block_tables
    assert len(full) == len(local) == 5 and NULL_BLOCK not in full
    # the next query (position 20) sees positions 15..20: blocks 3 and 4 only
    assert local[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in local[3:]
    assert bm.pool.num_used_blocks == 5 + 2
    bm.pool.check_invariants(seq.block_tables)
    bm.free(seq)
    assert bm.pool.num_used_blocks == 0


def test_scheduler_invariants_catch_a_group_holding_blocks_its_window_passed():
    bm = BlockManager(64, 4, enable_prefix_caching=False, windows=(None, 6))
    sched = Scheduler(SchedulerConfig(4, 64, 64), bm)
    seq = seq_of(range(3, 23))
    sched.add_request(seq.request)
    out = sched.schedule()
    sched.update_from_output(out)  # computed 20: the window group slid
    sched.check_invariants()
    seq.block_tables[1][0] = bm.pool.allocate(1)[0]  # a block its window no longer reaches
    with pytest.raises(AssertionError, match="window passed"):
        sched.check_invariants()


def test_prefix_hit_needs_the_window_before_the_hit_point():
    bs = 4
    bm = BlockManager(64, bs, windows=(None, 6))
    prefix = list(range(100, 124))  # 6 full blocks
    owner = seq_of(prefix + [1, 2, 3], "a")
    run(bm, owner, owner.num_tokens)
    # owner computed 27 tokens; its window group freed blocks 0..4 but they stay cached
    other = seq_of(prefix + [9], "b")
    hits = bm.find_cached_prefix(other)
    assert bm.hit_blocks(hits) == 6
    # position 24 needs positions 19..23: blocks 4 and 5 in the window group
    assert hits[0] == owner.block_tables[0][:6]
    assert hits[1][:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in hits[1][4:]
    run(bm, other, 1, hits)
    assert other.num_computed_tokens == 25
    # evict the window group's block 5 (nobody holds it but the cache): no 6-block hit now
    third_prefix = seq_of(prefix + [7], "c")
    bm.free(other)
    bm.free(owner)
    w5 = hits[1][5]
    bm.pool.forget(w5)
    hits = bm.find_cached_prefix(third_prefix)
    # the longest prefix whose window blocks are all still cached: 5 blocks (window 15..19
    # -> blocks 3, 4)
    assert bm.hit_blocks(hits) == 5 and w5 not in hits[1]
    bm.pool.check_invariants([])


def test_fork_and_swap_keep_null_entries_and_sharing():
    bm = BlockManager(32, 4, enable_prefix_caching=False, num_swap_blocks=32, windows=(None, 6))
    parent = seq_of(range(3, 17))  # 14 tokens
    run(bm, parent, 14)
    child = Sequence(1, parent.request, 1, list(parent.token_ids))
    bm.fork(parent, child)
    assert child.block_tables == parent.block_tables
    used = bm.pool.num_used_blocks
    pairs = bm.swap_out([parent, child])
    assert len(pairs) == used and bm.pool.num_used_blocks == 0
    assert parent.swap_tables[1][0] == NULL_BLOCK
    assert bm.can_swap_in([parent, child], 64)
    bm.swap_in([parent, child])
    assert parent.block_tables == child.block_tables and parent.block_tables[1][0] == NULL_BLOCK
    # both write token 15 into their shared partial block: copy-on-write in each group
    copies = []
    for s in (parent, child):
        s.append_token(5)
        bm.allocate(s, 1, [], copies)
    assert len(copies) == 2  # the parent copies its last block in both groups
    bm.pool.check_invariants([t for s in (parent, child) for t in s.block_tables])
    bm.swap_pool.check_invariants([])
    bm.free(parent)
    bm.free(child)
    assert bm.pool.num_used_blocks == 0


def test_can_allocate_is_exact_for_a_request_that_fits_only_an_empty_pool():
    """check_fits' bound (kv/spec.py) is the most a window group holds: a request sized to
    it runs to the end alone in exactly that many blocks."""
    layout = kv_layout([None, 8, 8, None])
    bs, chunk, length = 4, 8, 40
    need = layout.blocks_per_seq(length, bs, chunk)
    bm = BlockManager(need, bs, enable_prefix_caching=False, windows=layout.windows)
    sched = Scheduler(SchedulerConfig(4, chunk, length), bm)
    seq = seq_of(range(3, 3 + length - 10), max_tokens=10)
    sched.add_request(seq.request)
    while seq.num_tokens < length or seq.num_computed_tokens < seq.num_tokens:
        out = sched.schedule()
        assert out.scheduled and not out.preempted
        sched.update_from_output(out)
        sched.check_invariants()
        if seq.num_computed_tokens == seq.num_tokens and seq.num_tokens < length:
            seq.append_token(5)
    assert bm.pool.num_used_blocks <= need


# ---- end to end on a tiny random Gemma 3 (5 layers with windows of 8, then a global one) ----

def _tokens(outs):
    return [c.token_ids for o in outs for c in o.outputs]


def test_window_paging_gives_the_tokens_of_keeping_every_layer_whole(tiny_gemma3):
    """Same tokens as disable_hybrid_kv_cache_manager, in fewer blocks; the stats show the
    saving per group."""
    from _helpers import shared_prefix_workload

    from pagedserve import LLM

    prompts, params = shared_prefix_workload(8, 30)
    runs = {}
    for hybrid in (True, False):
        llm = LLM(tiny_gemma3, skip_tokenizer_init=True, num_kv_blocks=2048, block_size=4,
                  enable_prefix_caching=False, disable_hybrid_kv_cache_manager=not hybrid,
                  max_num_batched_tokens=16)  # short chunks: decoding sets the peak
        runs[hybrid] = (_tokens(llm.generate(prompts, params, use_tqdm=False)),
                        llm.kv_cache_stats())
    assert runs[True][0] == runs[False][0]
    hybrid, whole = runs[True][1], runs[False][1]
    assert [g.window for g in hybrid.kv_groups] == [None] + [8] * 5
    assert [g.window for g in whole.kv_groups] == [None] and whole.kv_groups[0].num_layers == 6
    # a hybrid block holds 1 layer, a whole one 6: the peak in bytes is far lower
    assert hybrid.peak_used_blocks * 1 < whole.peak_used_blocks * 6 / 2


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_int8_cache_forks_hits_and_preemption_give_a_roomy_runs_tokens(tiny_gemma3, mode):
    """An 8-bit cache with window paging: n=2 forks, prefix hits and preemption in a tight
    pool give the tokens of a roomy run of the same cache dtype."""
    from _helpers import shared_prefix_workload

    from pagedserve import LLM, SamplingParams

    prompts, params = shared_prefix_workload(10, 20)
    params = [SamplingParams(n=2, temperature=0.8, seed=i + 1, max_tokens=p.max_tokens,
                             ignore_eos=True) for i, p in enumerate(params)]
    roomy = LLM(tiny_gemma3, skip_tokenizer_init=True, num_kv_blocks=2048, block_size=4,
                enable_prefix_caching=False, kv_cache_dtype="int8")
    ref = _tokens(roomy.generate(prompts, params, use_tqdm=False))
    tight = LLM(tiny_gemma3, skip_tokenizer_init=True, num_kv_blocks=200, block_size=4,
                kv_cache_dtype="int8", preemption_mode=mode, swap_space=0.01,
                max_num_batched_tokens=32)
    assert _tokens(tight.generate(prompts, params, use_tqdm=False)) == ref
    stats = tight.kv_cache_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    if mode == "swap":
        assert stats.num_swapped_in_blocks == stats.num_swapped_out_blocks > 0


def test_stats_and_metrics_count_blocks_per_group(tiny_gemma3):
    from prometheus_client import generate_latest

    from pagedserve import LLM, SamplingParams
    from pagedserve.server.metrics import ServerMetrics

    engine = LLM(tiny_gemma3, skip_tokenizer_init=True, num_kv_blocks=512,
                 block_size=4).llm_engine
    groups = engine.kv_cache_stats().kv_groups
    assert [g.layers for g in groups] == [(5,), (0,), (1,), (2,), (3,), (4,)]
    assert all(g.bytes_per_token * 6 == engine.kv_cache_stats().kv_bytes_per_token
               for g in groups)
    metrics = ServerMetrics("m", groups)
    engine.add_request("a", {"prompt_token_ids": list(range(3, 43))},
                       SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()  # 40 tokens computed: the next query (position 40) sees 33..40
    used = [g.num_used_blocks for g in engine.kv_cache_stats().kv_groups]
    assert used == [10] + [2] * 5
    metrics.update(engine.stats.snapshot())
    text = generate_latest(metrics.registry).decode()
    assert ('pagedserve:kv_group_used_blocks{attention="full",group="0",model_name="m"} 10.0'
            in text)
    assert ('pagedserve:kv_group_used_blocks{attention="sliding_window_8",group="3",'
            'model_name="m"} 2.0' in text)
    engine.abort_request(["a"])
    assert [g.num_used_blocks for g in engine.kv_cache_stats().kv_groups] == [0] * 6


def test_contiguous_allocator_and_the_in_step_peak(tiny_gemma3):
    """kv_allocator="contiguous" pages a hybrid model as one group of every layer (the
    workers' cache too) with the same tokens; peak_used_blocks sees the blocks a prefill step
    held before its window groups gave them back."""
    from pagedserve import LLM, SamplingParams

    prompt = {"prompt_token_ids": list(range(3, 43))}  # 40 tokens: 10 blocks of 4 per group
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
    paged = LLM(tiny_gemma3, skip_tokenizer_init=True, num_kv_blocks=512, block_size=4)
    want = paged.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    stats = paged.kv_cache_stats()
    assert stats.peak_used_blocks >= 6 * 10  # the prefill step, in every group
    contiguous = LLM(tiny_gemma3, skip_tokenizer_init=True, num_kv_blocks=64, block_size=4,
                     kv_allocator="contiguous", max_model_len=64)
    assert [g.window for g in contiguous.kv_cache_stats().kv_groups] == [None]
    out = contiguous.generate(prompt, params, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].token_ids == want


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("length", [60, 200])
def test_a_pool_sized_to_the_worst_case_never_stalls(tiny_gemma3, mode, length):
    """Three long prompts in chunks of 16 in a pool of one sequence's worst case (and a
    little more): preempted mid-prefill, a swapped request comes back once the pool is free
    (its window groups need only the next chunk's blocks, not every uncomputed token's)."""
    from pagedserve import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(length)]}
               for i in range(3)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0)
    need = kv_layout([8, 8, 8, 8, 8, None]).blocks_per_seq(length + 24, 4, 16)
    ref = None
    for extra in (10_000, 0, 17):
        llm = LLM(tiny_gemma3, skip_tokenizer_init=True, num_kv_blocks=need + extra,
                  block_size=4, preemption_mode=mode, swap_space=0.01,
                  max_num_batched_tokens=16, enable_prefix_caching=False)
        engine = llm.llm_engine
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        outs, steps = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[out.request_id] = out.outputs[0].token_ids
            steps += 1
            assert steps < 1000, f"no progress after {steps} steps"
        if extra == 0:
            assert engine.scheduler.num_preemptions > 0
        ref = ref or outs
        assert outs == ref
