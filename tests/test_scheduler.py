"""The scheduler and the runner's input layout, without a model: token budgets, chunked
prefill, the long-prefill cap, admission order, preemption, prefix hits, the one writer of
computed tokens, and ``prepare_input``'s token layout, slots and sampled rows."""

from __future__ import annotations

import pytest
from _helpers import make_sequence

from pagedserve.config import SchedulerConfig
from pagedserve.core.block_manager import BlockManager
from pagedserve.core.scheduler import MIN_PREFILL_TOKENS, Scheduler, StepCost
from pagedserve.runner import prepare_input
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import SequenceStatus


def _scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=16, threshold=0,
               caching=True, mode="recompute", itl_target_ms=0.0):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    config = SchedulerConfig(max_num_seqs, budget, 1024, threshold, itl_target_ms)
    return Scheduler(config, bm, mode)


def _add(sched: Scheduler, prompt_len: int, rid: str, first: int = 3):
    seq = make_sequence([first + i for i in range(prompt_len)], request_id=rid,
                        params=SamplingParams(max_tokens=8))
    sched.add_request(seq.request)
    return seq


def _step(sched: Scheduler, token: int = 7):
    """schedule -> (no model) -> update_from_output, then a sampled token for every sequence
    whose chunk reached its end. Returns {request_id: tokens computed}."""
    out = sched.schedule()
    sched.update_from_output(out)
    for seq, _ in out.scheduled:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(token)
    return {seq.request.request_id: n for seq, n in out.scheduled}


def test_chunked_prefill_under_the_token_budget_then_decodes():
    sched = _scheduler(budget=4)
    a = _add(sched, 10, "a")
    assert [_step(sched) for _ in range(4)] == [{"a": 4}, {"a": 4}, {"a": 2}, {"a": 1}]
    assert a.num_computed_tokens == 11 and a.num_tokens == 12


def test_running_requests_go_first_and_waiting_ones_fill_the_budget_in_order():
    sched = _scheduler(budget=8)
    _add(sched, 6, "a")
    _add(sched, 6, "b", first=30)
    _add(sched, 6, "c", first=60)
    assert _step(sched) == {"a": 6, "b": 2}
    assert _step(sched) == {"a": 1, "b": 4, "c": 3}
    assert _step(sched) == {"a": 1, "b": 1, "c": 3}


def test_long_prefill_token_threshold_caps_prefill_chunks_not_decodes():
    sched = _scheduler(budget=64, threshold=5)
    _add(sched, 3, "short")
    _add(sched, 20, "long")
    assert _step(sched) == {"short": 3, "long": 5}
    assert _step(sched) == {"short": 1, "long": 5}
    uncapped = _scheduler(budget=64)
    _add(uncapped, 20, "long")
    assert _step(uncapped) == {"long": 20}


def test_step_cost_budget_is_what_fits_beside_the_decodes():
    cost = StepCost()
    assert cost.prefill_budget(0.1) is None  # nothing measured yet
    for _ in range(3):
        cost.observe(8, 0, 0.020)  # decode-only steps: 20 ms
    assert cost.prefill_budget(0.1) is None  # no prompt-token cost yet
    cost.observe(0, 10, 1.0)  # too few prompt tokens to learn from
    assert cost.prefill_budget(0.1) is None
    cost.observe(8, 100, 0.120)  # 100 ms beyond the decodes: 1 ms per prompt token
    cost.observe(0, 200, 0.200)  # no decodes: all of it is the prompt's
    assert cost.prefill_budget(0.1) == 80  # (100 - 20) ms / 1 ms
    cost.observe(8, 0, 5.0)  # one stalled step does not move the median
    assert cost.prefill_budget(0.1) == 80
    assert cost.prefill_budget(0.001) == MIN_PREFILL_TOKENS  # prompts always move
    for _ in range(3):  # an absurd rate (the median now) still gives a finite budget
        cost.observe(0, 10**6, 1e-300)
    assert cost.prefill_budget(3600.0) == 2**31


def test_itl_target_caps_prompt_tokens_only_while_requests_decode():
    sched = _scheduler(budget=512, itl_target_ms=100.0, block_size=16, num_blocks=256)
    for _ in range(4):
        sched.step_cost.observe(2, 0, 0.020)
        sched.step_cost.observe(2, 100, 0.020 + 100 * 0.002)  # 2 ms per prompt token
    _add(sched, 300, "a")
    assert _step(sched) == {"a": 300}  # nothing decodes: no cap
    _add(sched, 300, "b", first=400)
    _add(sched, 300, "c", first=800)
    # a decodes, b and c wait: (100 - 20) ms / 2 ms = 40 prompt tokens, times 2 / 1
    assert _step(sched) == {"a": 1, "b": 80}
    _add(sched, 300, "d", first=1200)  # b, c, d against a: 3 x 40, first come first served
    assert _step(sched) == {"a": 1, "b": 120}
    assert _step(sched) == {"a": 1, "b": 100, "c": 20}
    assert _step(sched) == {"a": 1, "b": 1, "c": 40}  # c, d against a and b: 2 / 2
    off = _scheduler(budget=512, block_size=16, num_blocks=256)
    for _ in range(4):
        off.step_cost.observe(2, 100, 0.220)
    _add(off, 300, "a")
    _step(off)
    _add(off, 300, "b", first=400)
    assert _step(off) == {"a": 1, "b": 300}


def test_max_num_seqs_bounds_the_batch():
    sched = _scheduler(max_num_seqs=2)
    for rid in "abc":
        _add(sched, 2, rid)
    assert set(_step(sched)) == {"a", "b"}
    assert sched.num_waiting() == (1, 1) and sched.num_waiting(2) == (1, 3)


def test_num_waiting_counts_requests_the_cache_cannot_take():
    """Free seats but too few free blocks: the request waits, and counts as waiting (the
    server's max_num_waiting is about requests that will not run next step)."""
    sched = _scheduler(max_num_seqs=8, budget=4096)
    _add(sched, 4 * sched.block_manager.num_free_blocks - 8, "big")  # all but two blocks
    _step(sched)
    _add(sched, 4, "fits")
    _add(sched, 12, "too-big")
    assert sched.num_waiting() == (1, 1) and sched.num_waiting(3) == (1, 4)


def test_only_update_from_output_advances_computed_tokens():
    sched = _scheduler()
    a = _add(sched, 6, "a")
    out = sched.schedule()
    assert a.num_computed_tokens == 0 and out.scheduled == [(a, 6)]
    sched.update_from_output(out)
    assert a.num_computed_tokens == 6


def test_prefix_hits_skip_computed_blocks_but_never_the_last_prompt_token():
    sched = _scheduler(block_size=4)
    _add(sched, 9, "a")
    _step(sched)
    b = _add(sched, 9, "b")  # the same 9 tokens: two full cached blocks
    assert _step(sched)["b"] == 1 and b.request.num_cached_tokens == 8
    c = _add(sched, 8, "c")  # 8 tokens: the last one is recomputed, so one block is a hit
    assert _step(sched)["c"] == 4 and c.request.num_cached_tokens == 4


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_newest_request_is_preempted_when_blocks_run_out(mode):
    bm = BlockManager(5, 4, enable_prefix_caching=False, num_swap_blocks=16)
    sched = Scheduler(SchedulerConfig(8, 64, 1024), bm, mode)
    a = _add(sched, 8, "a")
    b = _add(sched, 8, "b", first=50)
    _add(sched, 8, "c", first=90)
    assert _step(sched) == {"a": 8, "b": 8}  # c does not fit: 1 block left
    assert _step(sched) == {"a": 1}  # a takes the last block, b has none: b is preempted
    assert b.request.metrics.num_preemptions == 1 and sched.num_preemptions == 1
    assert a.status == SequenceStatus.RUNNING and sched.running == [a.request]
    if mode == "swap":
        assert b.status == SequenceStatus.SWAPPED and sched.swapped == [b.request]
    else:
        assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0
        assert sched.waiting[0] is b.request
    sched.check_invariants()


def test_abort_and_fail_free_every_block():
    sched = _scheduler()
    a = _add(sched, 6, "a")
    b = _add(sched, 6, "b")
    _step(sched)
    sched.abort_requests(["a", "unknown"])
    sched.fail_request(b.request, RuntimeError("boom"))
    assert a.status == SequenceStatus.FINISHED_ABORTED
    assert b.status == SequenceStatus.FINISHED_ERROR and b.request.error == "RuntimeError: boom"
    assert not sched.requests and not sched.has_unfinished_requests()
    assert sched.block_manager.pool.num_used_blocks == 0
    sched.check_invariants()


# ---- the runner's input layout ------------------------------------------------------------


def test_prepare_input_lays_out_decodes_then_prefills_with_slots_and_sample_rows():
    sched = _scheduler(block_size=4, budget=32)
    d = _add(sched, 5, "decode")
    _step(sched)  # prefilled; one token sampled
    p = _add(sched, 10, "prefill", first=40)
    q = _add(sched, 12, "partial", first=80)
    sched.config = SchedulerConfig(8, 1 + 10 + 6, 1024)  # q gets a partial chunk of 6
    out = sched.schedule()
    inp, res = prepare_input(out, 4)
    assert inp.input_ids == [7] + list(range(40, 50)) + list(range(80, 86))
    assert inp.positions == [5] + list(range(10)) + list(range(6))
    slots = [d.block_table[1] * 4 + 1]
    slots += [p.block_table[i // 4] * 4 + i % 4 for i in range(10)]
    slots += [q.block_table[i // 4] * 4 + i % 4 for i in range(6)]
    assert inp.slot_mapping == [slots]
    assert inp.sample_rows == [0, 10] and res.sample_seqs == [d, p]  # q's chunk is partial
    assert inp.groups == [([1], [6], [[d.block_table]]),
                          ([10, 6], [10, 6], [[p.block_table, q.block_table]])]


@pytest.mark.parametrize("as_decodes", [True, False])
def test_prepare_input_lays_out_drafts(as_decodes):
    sched = _scheduler(block_size=4, budget=32)
    d = _add(sched, 5, "decode")
    _step(sched)  # 5 prompt tokens computed, token 7 sampled
    d.spec_token_ids = [20, 21, 22]
    out = sched.schedule()
    assert out.scheduled[0].num_tokens == 4 and len(d.block_table) == 3
    inp, res = prepare_input(out, 4, drafts_as_decodes=as_decodes)
    assert inp.input_ids == [7, 20, 21, 22] and inp.positions == [5, 6, 7, 8]
    assert inp.slot_mapping == [[d.block_table[p // 4] * 4 + p % 4 for p in range(5, 9)]]
    assert inp.sample_rows == [0, 1, 2, 3] and res.first_rows == [0]
    if as_decodes:  # one decode row per token, each attending up to its own position
        assert inp.groups == [([1, 1, 1, 1], [6, 7, 8, 9], [[d.block_table] * 4])]
    else:
        assert inp.groups == [([4], [9], [[d.block_table]])]


def test_prepare_input_marks_prompt_rows_for_prompt_logprobs():
    sched = _scheduler(block_size=4, budget=4)
    seq = make_sequence(list(range(3, 13)), params=SamplingParams(max_tokens=2,
                                                                  prompt_logprobs=1))
    seq.request.prompt_logprobs = [None] * 10
    sched.add_request(seq.request)
    rows = []
    for _ in range(3):
        out = sched.schedule()
        inp, res = prepare_input(out, 4)
        rows.append((inp.prompt_rows, [(first, count) for _, first, count in res.prompt_rows]))
        sched.update_from_output(out)
    # positions 0..8 predict tokens 1..9; the last prompt position predicts the first output
    assert rows == [([0, 1, 2, 3], [(0, 4)]), ([0, 1, 2, 3], [(4, 4)]), ([0], [(8, 1)])]


def test_sequences_of_a_request_take_their_hits_before_any_allocates():
    """A request's sequences admitted together (n > 1 after a recompute preemption): the one
    without hits must not take (and evict) a sibling's cached hit from the free queue."""
    from pagedserve.sequence import Sequence

    sched = _scheduler(num_blocks=6, block_size=4, budget=64)
    bm = sched.block_manager
    c = _add(sched, 5, "c", first=50)  # its first block, full, is cached when it ends
    _step(sched)
    hit = c.block_tables[0][0]
    bm.free(c)
    sched.running.clear()
    d = _add(sched, 16, "d", first=100)  # freed after c: the queue is [c's partial, c's full,
    _step(sched)                         # d's blocks...]
    bm.free(d)
    sched.running.clear()
    a = make_sequence(list(range(200, 205)), request_id="r", params=SamplingParams(n=2))
    b = Sequence(1, a.request, 1, list(range(50, 55)))  # c's tokens: its first block is a hit
    a.request.seqs.append(b)
    sched.add_request(a.request)
    sched.schedule()
    assert b.block_tables[0][0] == hit and b.num_computed_tokens == 4  # the hit was taken
    assert not set(a.block_tables[0]) & set(b.block_tables[0])
    bm.pool.check_invariants(a.block_tables + b.block_tables)
