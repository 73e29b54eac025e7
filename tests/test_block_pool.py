"""The block pool, block manager and scheduler, without a model."""

from __future__ import annotations

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.core.block_manager import BlockManager
from pagedserve.core.block_pool import BlockPool
from pagedserve.core.scheduler import Scheduler
from pagedserve.outputs import RequestMetrics
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Request, RequestStatus


def make_request(rid: str, num_prompt: int, max_tokens: int = 8) -> Request:
    return Request(rid, None, list(range(1, num_prompt + 1)), SamplingParams(max_tokens=max_tokens),
                   max_tokens, frozenset({0}), RequestMetrics(0.0))


def test_pool_allocate_free_and_reuse_order():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free_blocks == 1
    pool.free(a[::-1])
    assert pool.num_free_blocks == 4
    assert list(pool.free_queue) == [3, 2, 1, 0]
    with pytest.raises(RuntimeError, match="only 4 free"):
        pool.allocate(5)
    pool.check_invariants([])


def test_pool_invariants_catch_corruption():
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.check_invariants([blocks])
    with pytest.raises(AssertionError, match="ref count 1 but 0"):
        pool.check_invariants([])  # a block held by nobody but not free: a leak
    pool.free_queue.append(2)
    with pytest.raises(AssertionError, match="twice"):
        pool.check_invariants([blocks])
    pool.free_queue.pop()
    pool.ref_cnt[0] = -1
    with pytest.raises(AssertionError):
        pool.check_invariants([blocks])


def test_blocks_taken_as_the_sequence_grows_never_reserved():
    bm = BlockManager(num_blocks=10, block_size=4)
    r = make_request("a", 5, max_tokens=30)
    assert bm.allocate_slots(r, 5) and len(r.block_table) == 2
    r.num_computed_tokens = 5
    for n in range(6, 9):  # tokens 6..8 fit in block 2
        assert bm.allocate_slots(r, 1) and len(r.block_table) == 2
        r.num_computed_tokens = n
    assert bm.allocate_slots(r, 1) and len(r.block_table) == 3
    assert bm.num_free_blocks == 7
    bm.free(r)
    assert bm.num_free_blocks == 10 and r.block_table == []


def test_allocate_fails_without_side_effects():
    bm = BlockManager(num_blocks=2, block_size=4)
    r = make_request("a", 12)
    assert not bm.allocate_slots(r, 12)
    assert r.block_table == [] and bm.num_free_blocks == 2


def _step(sched: Scheduler, sampled_token: int = 7):
    """Advance like the engine: count computed tokens, append a token when a chunk ends."""
    out = sched.schedule()
    for r, n in out.scheduled:
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(sampled_token)
    return out


def test_scheduler_chunked_prefill_and_budget():
    bm = BlockManager(num_blocks=64, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, max_model_len=64), bm)
    a, b = make_request("a", 25), make_request("b", 3)
    s.add_request(a)
    s.add_request(b)
    out = _step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 10)]
    out = _step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 10)]
    out = _step(s)  # a finishes its prompt (5 tokens), b is admitted with the rest of the budget
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 5), ("b", 3)]
    out = _step(s)  # both decode
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 1)]


def test_scheduler_max_num_seqs_and_fcfs():
    bm = BlockManager(num_blocks=64, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, max_model_len=64), bm)
    reqs = [make_request(str(i), 3) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    out = _step(s)
    assert [r.request_id for r, _ in out.scheduled] == ["0", "1"]
    s.finish_requests([reqs[0]])  # its place is filled in the next step
    out = _step(s)
    assert [r.request_id for r, _ in out.scheduled] == ["1", "2"]
    assert reqs[0].block_table == []


def test_scheduler_admits_only_when_blocks_available_and_preempts_newest():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=16), bm)
    a, b, c = make_request("a", 4), make_request("b", 4), make_request("c", 8)
    for r in (a, b, c):
        s.add_request(r)
    out = _step(s)  # a and b take one block each; c (2 blocks) fits too
    assert [r.request_id for r, _ in out.scheduled] == ["a", "b", "c"]
    assert bm.num_free_blocks == 0
    # Each request now needs a new block to decode; none is free: the newest (c) is preempted.
    out = _step(s)
    assert [r.request_id for r in out.preempted] == ["c"]
    assert c.status == RequestStatus.WAITING and c.num_computed_tokens == 0
    assert c.block_table == [] and s.waiting[0] is c
    assert [r.request_id for r, _ in out.scheduled] == ["a", "b"]
    assert s.num_preemptions == 1
    # c keeps its generated token and is re-prefilled (prompt + output) when blocks return.
    s.finish_requests([a, b])
    out = _step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("c", 9)]


def test_scheduler_preempts_itself_when_newest():
    bm = BlockManager(num_blocks=2, block_size=2)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=4), bm)
    a, b = make_request("a", 2), make_request("b", 2)
    s.add_request(a)
    s.add_request(b)
    _step(s)
    out = _step(s)  # both need a 2nd block; b (newest) goes, a continues
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [r.request_id for r, _ in out.scheduled] == ["a"]
