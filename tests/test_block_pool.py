"""The block pool, block manager (prefix cache, forks, copy-on-write, swap) and scheduler,
without a model."""

from __future__ import annotations

import pytest
from _helpers import make_sequence

from pagedserve.config import SchedulerConfig
from pagedserve.core.block_manager import BlockManager
from pagedserve.core.block_pool import BlockPool
from pagedserve.core.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence, SequenceStatus

BS = 4


def seq_of(tokens, rid="r", salt=None, max_tokens=8):
    return make_sequence(list(tokens), SamplingParams(max_tokens=max_tokens), request_id=rid,
                         cache_salt=salt)


def admit(bm: BlockManager, seq, n=None):
    """Admit a new sequence like the scheduler does: prefix hits, then its tokens."""
    hits = bm.find_cached_prefix(seq)
    start = bm.hit_blocks(hits) * BS
    n = seq.num_tokens - start if n is None else n
    assert bm.can_allocate([(seq, n, hits)])
    bm.allocate(seq, n, hits, [])
    seq.num_computed_tokens += n
    return hits


def check_idle(bm: BlockManager):
    pool = bm.pool
    pool.check_invariants([])
    assert pool.num_used_blocks == 0
    free = pool.num_free_blocks - pool.num_cached_blocks
    assert free + pool.num_cached_blocks + pool.num_used_blocks == pool.num_blocks


# ---- pool basics ------------------------------------------------------------------------------

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
    pool.ref_cnt[0] = -1
    with pytest.raises(AssertionError):
        pool.check_invariants([blocks])


def test_blocks_taken_as_the_sequence_grows_never_reserved():
    bm = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    seq = seq_of(range(1, 6), max_tokens=30)
    admit(bm, seq)
    assert len(seq.block_table) == 2
    for _ in range(3):  # tokens 6..8 fit in block 2
        seq.append_token(7)
        bm.allocate(seq, 1, [], [])
        seq.num_computed_tokens += 1
        assert len(seq.block_table) == 2
    seq.append_token(7)
    bm.allocate(seq, 1, [], [])
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 7
    bm.free(seq)
    assert bm.num_free_blocks == 10 and seq.block_table == []


# ---- prefix caching ---------------------------------------------------------------------------

PREFIX = list(range(100, 112))  # 3 full blocks


def test_hit_on_shared_prefix_while_owner_runs():
    bm = BlockManager(num_blocks=16, block_size=BS)
    owner = seq_of(PREFIX + [1, 2], "a")
    admit(bm, owner)
    other = seq_of(PREFIX + [3], "b")
    hits = admit(bm, other)
    assert hits == [owner.block_table[:3]]
    assert all(bm.pool.ref_cnt[b] == 2 for b in hits[0])
    assert other.num_computed_tokens == 13 and other.block_table[:3] == hits[0]
    assert other.block_table[3] != owner.block_table[3]  # the partial block is never shared


def test_last_prompt_token_is_always_computed():
    bm = BlockManager(num_blocks=16, block_size=BS)
    admit(bm, seq_of(PREFIX, "a"))
    same = seq_of(PREFIX, "b")
    hits = bm.find_cached_prefix(same)
    assert bm.hit_blocks(hits) == 2  # not 3: the 12th token must be computed for logits


def test_free_is_tail_first_so_prefixes_outlive_tails():
    bm = BlockManager(num_blocks=5, block_size=BS)
    a = seq_of(PREFIX + [1, 2, 3, 4], "a")  # 4 full blocks
    admit(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert list(bm.pool.free_queue)[-4:] == table[::-1]  # the tail is evicted first
    bm.pool.allocate(2)  # the free block, then a's tail block
    b = seq_of(PREFIX + [9], "b")
    assert bm.find_cached_prefix(b) == [table[:3]]  # the shared prefix survived


def test_unrelated_request_evicts_least_recently_used_first():
    bm = BlockManager(num_blocks=6, block_size=BS)
    old = seq_of(list(range(200, 208)) + [1], "old")
    new = seq_of(list(range(300, 308)) + [1], "new")
    admit(bm, old)
    bm.free(old)  # freed first: least recently used
    admit(bm, new)
    bm.free(new)
    assert bm.pool.num_cached_blocks == 4
    unrelated = seq_of(list(range(400, 408)), "x")
    admit(bm, unrelated)  # needs 2 blocks: 2 empty ones exist, no eviction yet
    admit(bm, seq_of([5, 6, 7, 8, 9], "y"))  # 2 more: evicts the old request's 2 blocks
    assert bm.find_cached_prefix(seq_of(list(range(200, 208)) + [1], "o2")) == []
    assert bm.hit_blocks(bm.find_cached_prefix(seq_of(list(range(300, 308)) + [1], "n2"))) == 2


def test_allocation_never_evicts_its_own_hits():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = seq_of(PREFIX + [1], "a")  # 3 full blocks cached + 1 partial
    admit(bm, a)
    bm.free(a)
    assert bm.pool.num_free_blocks == 4 and bm.pool.num_cached_blocks == 3
    b = seq_of(PREFIX + [1, 2, 3, 4, 5], "b")  # 3 hits (evictable) + needs 2 new blocks
    hits = bm.find_cached_prefix(b)
    assert bm.hit_blocks(hits) == 3
    # 4 free in total, but 3 of them are b's own hits: only 1 may be taken
    assert not bm.can_allocate([(b, b.num_tokens - 12, hits)])


def test_failed_allocation_changes_no_ref_count():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = seq_of(PREFIX + [1], "a")
    admit(bm, a)
    refs = list(bm.pool.ref_cnt)
    b = seq_of(PREFIX + list(range(20)), "b")
    hits = bm.find_cached_prefix(b)
    assert hits and not bm.can_allocate([(b, b.num_tokens - 12, hits)])
    assert bm.pool.ref_cnt == refs and b.block_table == []


def test_reused_evicted_block_has_no_stale_hash():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = seq_of(list(range(10, 18)) + [1], "a")
    admit(bm, a)
    bm.free(a)
    x = seq_of(list(range(50, 62)), "x")  # takes all 3 blocks, evicting a's cached ones
    admit(bm, x)
    assert [bm.pool.block_hash[b] for b in x.block_table] == [(0, h) for h in x.block_hashes]  # none of a's
    assert bm.find_cached_prefix(seq_of(list(range(10, 18)) + [1], "a2")) == []
    bm.pool.check_invariants([x.block_table])


def test_different_cache_salt_never_hits():
    bm = BlockManager(num_blocks=16, block_size=BS)
    admit(bm, seq_of(PREFIX + [1], "a", salt="tenant-1"))
    assert bm.find_cached_prefix(seq_of(PREFIX + [1], "b", salt="tenant-2")) == []
    assert bm.find_cached_prefix(seq_of(PREFIX + [1], "c")) == []
    assert bm.hit_blocks(bm.find_cached_prefix(seq_of(PREFIX + [1], "d", salt="tenant-1"))) == 3


def test_idle_pool_accounts_for_every_block():
    bm = BlockManager(num_blocks=16, block_size=BS)
    seqs = [seq_of(PREFIX + [i, i + 1, i + 2, i + 3, i], str(i)) for i in range(3)]
    for s in seqs:
        admit(bm, s)
    for s in seqs:
        bm.free(s)
    check_idle(bm)
    assert bm.pool.num_cached_blocks == 3 + 3  # the shared prefix once, each tail's full block


# ---- forks and copy-on-write ------------------------------------------------------------------

def test_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    parent = seq_of([1, 2, 3, 4, 5, 6], max_tokens=4)
    admit(bm, parent)
    child = Sequence(1, parent.request, 1, list(parent.token_ids))
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert all(bm.pool.ref_cnt[b] == 2 for b in parent.block_table)
    copies = []
    parent.append_token(7)
    child.append_token(8)
    assert bm.can_allocate([(parent, 1, [])])
    bm.allocate(parent, 1, [], copies)  # writes into the shared partial block: copy first
    assert copies == [(child.block_table[1], parent.block_table[1])]
    assert parent.block_table[0] == child.block_table[0]  # the full block stays shared
    bm.allocate(child, 1, [], copies)  # now the only holder: writes in place
    assert len(copies) == 1
    bm.pool.check_invariants([parent.block_table, child.block_table])
    bm.free(parent)
    bm.free(child)
    check_idle(bm)


def test_swap_out_and_in_keeps_sharing():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False, num_swap_blocks=8)
    parent = seq_of([1, 2, 3, 4, 5, 6])
    admit(bm, parent)
    child = Sequence(1, parent.request, 1, list(parent.token_ids))
    bm.fork(parent, child)
    out = bm.swap_out([parent, child])
    assert len(out) == 2 and bm.pool.num_used_blocks == 0
    assert parent.swap_tables == child.swap_tables
    assert bm.can_swap_in([parent, child], 64)
    back = bm.swap_in([parent, child])
    assert len(back) == 2 and parent.block_table == child.block_table
    assert all(bm.pool.ref_cnt[b] == 2 for b in parent.block_table)
    bm.swap_pool.check_invariants([])
    bm.free(parent)
    bm.free(child)
    check_idle(bm)


def test_swap_out_refused_when_host_pool_is_full():
    bm = BlockManager(num_blocks=8, block_size=BS, num_swap_blocks=1)
    seq = seq_of(list(range(1, 10)))
    admit(bm, seq)
    assert bm.swap_out([seq]) is None and len(seq.block_table) == 3


# ---- scheduler --------------------------------------------------------------------------------

def _step(sched: Scheduler, sampled_token: int = 7):
    """Advance like the engine: count computed tokens, append a token when a chunk ends."""
    out = sched.schedule()
    for s, n in out.scheduled:
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(sampled_token)
    return out


def _sched(num_blocks, max_num_seqs=8, budget=100, max_len=64, mode="recompute", swap=0):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=False, num_swap_blocks=swap)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_len), bm, mode)


def ids(out):
    return [(s.request.request_id, n) for s, n in out.scheduled]


def test_scheduler_chunked_prefill_and_budget():
    s = _sched(64, budget=10)
    a, b = seq_of(range(1, 26), "a"), seq_of(range(1, 4), "b")
    s.add_request(a.request)
    s.add_request(b.request)
    assert ids(_step(s)) == [("a", 10)]
    assert ids(_step(s)) == [("a", 10)]
    assert ids(_step(s)) == [("a", 5), ("b", 3)]  # b gets the rest of the budget
    assert ids(_step(s)) == [("a", 1), ("b", 1)]


def test_scheduler_max_num_seqs_and_fcfs():
    s = _sched(64, max_num_seqs=2)
    reqs = [seq_of(range(1, 4), str(i)).request for i in range(4)]
    for r in reqs:
        s.add_request(r)
    assert [r for r, _ in ids(_step(s))] == ["0", "1"]
    reqs[0].seqs[0].status = SequenceStatus.FINISHED_LENGTH
    s.finish_requests([reqs[0]])  # its place is filled in the next step
    assert [r for r, _ in ids(_step(s))] == ["1", "2"]
    assert reqs[0].seqs[0].block_table == []


def test_scheduler_admits_only_when_blocks_available_and_preempts_newest():
    s = _sched(4, max_len=16)
    a, b, c = seq_of(range(1, 5), "a"), seq_of(range(1, 5), "b"), seq_of(range(1, 9), "c")
    for q in (a, b, c):
        s.add_request(q.request)
    assert [r for r, _ in ids(_step(s))] == ["a", "b", "c"]
    assert s.block_manager.num_free_blocks == 0
    out = _step(s)  # everyone needs a new block; the newest (c) is preempted
    assert [r.request_id for r in out.preempted] == ["c"]
    assert c.status == SequenceStatus.WAITING and c.num_computed_tokens == 0
    assert c.block_table == [] and s.waiting[0] is c.request
    assert ids(out) == [("a", 1), ("b", 1)] and s.num_preemptions == 1
    s.finish_requests([a.request, b.request])
    assert ids(_step(s)) == [("c", 9)]  # re-prefilled: prompt + its generated token


def _two_outgrowing_the_pool(s):
    """Two 8-token requests in a 4-block pool of 4-token blocks; the second step needs a 3rd
    block for each, so b (the newest) is preempted. Returns (a, b, that step's output)."""
    a, b = seq_of(range(1, 9), "a"), seq_of(range(1, 9), "b")
    s.add_request(a.request)
    s.add_request(b.request)
    _step(s)
    return a, b, _step(s)


def test_scheduler_swap_preemption_resumes_before_new_requests():
    s = _sched(4, max_len=16, mode="swap", swap=8)
    a, b, out = _two_outgrowing_the_pool(s)  # b is swapped out
    assert [r.request_id for r in out.preempted] == ["b"] and out.blocks_to_swap_out
    assert b.status == SequenceStatus.SWAPPED and s.swapped == [b.request]
    late = seq_of([1], "late")
    s.add_request(late.request)
    a.status = SequenceStatus.FINISHED_LENGTH
    s.finish_requests([a.request])
    out = _step(s)
    assert out.blocks_to_swap_in and ids(out)[0] == ("b", 1)
    assert b.num_computed_tokens == 9  # only the new token was computed, nothing again


def test_swap_falls_back_to_recompute_when_host_pool_is_full():
    s = _sched(4, max_len=16, mode="swap", swap=1)
    a, b, out = _two_outgrowing_the_pool(s)
    assert [r.request_id for r in out.preempted] == ["b"] and not out.blocks_to_swap_out
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0
