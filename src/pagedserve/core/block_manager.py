"""Per-sequence block tables over the block pool (PagedAttention, Kwon et al., SOSP 2023, sec. 4).

- Allocation: a sequence holds ``ceil(tokens computed after this step / block_size)`` blocks,
  taken as it grows (never reserved to max length) and returned tail first.
- Prefix caching: a new (or recomputed) sequence first reuses the longest chain of cached full
  blocks of its tokens, capped so the last prompt token is always computed; full blocks are
  registered in the cache as soon as their tokens are scheduled.
- Forks (parallel sampling, beam search; sec. 4.4): a child takes a reference on every block of
  its parent. A sequence about to write into a block held by others gets its own copy first
  (copy-on-write); the copy is recorded as (src, dst) for the runner to perform.
- Swap (sec. 4.5): all blocks of a request move to a host pool and back into any free blocks;
  blocks shared between its sequences stay shared.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from pagedserve.core.block_pool import BlockPool, hash_block
from pagedserve.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates, shares, copies, swaps and frees the blocks of each sequence's block table."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_swap_blocks: int = 0):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.swap_pool = BlockPool(num_swap_blocks) if num_swap_blocks > 0 else None
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    # ---- prefix caching -------------------------------------------------------------------

    def _update_hashes(self, seq: Sequence) -> None:
        """Extend ``seq.block_hashes`` over every full block of its known tokens."""
        bs, hashes, tokens = self.block_size, seq.block_hashes, seq.token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else seq.request.root_hash
            hashes.append(hash_block(parent, tokens[i * bs:(i + 1) * bs]))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of ``seq``'s tokens (none when caching is
        off, the sequence already has blocks, or its request wants prompt logprobs, which
        need every position computed). Changes nothing."""
        if not self.pool.enable_caching or seq.block_table or seq.num_computed_tokens \
                or seq.request.prompt_logprobs is not None:
            return []
        self._update_hashes(seq)
        max_blocks = (seq.num_tokens - 1) // self.block_size  # the last token is computed
        hits = []
        for h in seq.block_hashes[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        if not self.pool.enable_caching:
            return
        full = min(num_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_cached_blocks:
            return
        self._update_hashes(seq)
        for i in range(seq.num_cached_blocks, full):
            self.pool.cache_block(seq.block_table[i], seq.block_hashes[i])
        seq.num_cached_blocks = full

    # ---- allocation -----------------------------------------------------------------------

    def _needs_copy(self, seq: Sequence) -> bool:
        """The next token goes into a partly filled block that others also hold."""
        return (seq.num_computed_tokens % self.block_size != 0
                and self.pool.ref_cnt[seq.block_table[-1]] > 1)

    def can_allocate(self, items: Iterable[tuple[Sequence, int, list[int]]]) -> bool:
        """Whether every (sequence, new tokens, prefix hits) can get its blocks at once. Hits
        that are cached but free are not counted as free: an allocation never evicts its own
        hits."""
        needed, evictable_hits = 0, set()
        for seq, n, hits in items:
            computed = len(hits) * self.block_size if hits else seq.num_computed_tokens
            held = len(hits) if hits else len(seq.block_table)
            needed += max(0, cdiv(computed + n, self.block_size) - held)
            if not hits and seq.block_table and self._needs_copy(seq):
                needed += 1
            evictable_hits.update(b for b in hits if self.pool.ref_cnt[b] == 0)
        return needed <= self.pool.num_free_blocks - len(evictable_hits)

    def allocate(self, seq: Sequence, n: int, hits: list[int],
                 copies: list[tuple[int, int]]) -> None:
        """Give ``seq`` the blocks for ``n`` more tokens, after taking ``hits`` as its first
        blocks (prefix-cache hits: ``num_computed_tokens`` jumps past them). Copy-on-write
        pairs are appended to ``copies``. Call ``can_allocate`` first; raises RuntimeError if
        the pool runs out."""
        if hits:
            self.pool.touch(hits)
            seq.block_table = list(hits)
            seq.num_computed_tokens = len(hits) * self.block_size
            seq.num_cached_blocks = len(hits)
        elif seq.block_table and self._needs_copy(seq):
            (new,) = self.pool.allocate(1)
            copies.append((seq.block_table[-1], new))
            self.pool.free([seq.block_table[-1]])
            seq.block_table[-1] = new
        total = seq.num_computed_tokens + n
        missing = cdiv(total, self.block_size) - len(seq.block_table)
        if missing > 0:
            seq.block_table.extend(self.pool.allocate(missing))
        self._cache_full_blocks(seq, total)

    def forget_uncomputed(self, seq: Sequence) -> None:
        """Drop the prefix-cache hashes of ``seq``'s blocks past its computed tokens (those
        registered when this step was scheduled): after a failed step their K/V were never
        written, so no later request may hit them."""
        first = seq.num_computed_tokens // self.block_size
        for b in seq.block_table[first:]:
            self.pool.forget(b)
        seq.num_cached_blocks = min(seq.num_cached_blocks, first)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s blocks (one more reference each)."""
        self.pool.touch(parent.block_table)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Return all of a sequence's blocks, tail first, and empty its block table."""
        self.pool.free(seq.block_table[::-1])
        seq.block_table = []
        seq.num_cached_blocks = 0
        if seq.swap_table:
            self.swap_pool.free(seq.swap_table[::-1])
            seq.swap_table = []

    # ---- swap -----------------------------------------------------------------------------

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]] | None:
        """Move the sequences' blocks to the host pool. Returns (device, host) block pairs to
        copy, or None (nothing changed) when the host pool is too small."""
        distinct = list(dict.fromkeys(b for s in seqs for b in s.block_table))
        if self.swap_pool is None or len(distinct) > self.swap_pool.num_free_blocks:
            return None
        host = dict(zip(distinct, self.swap_pool.allocate(len(distinct))))
        for s in seqs:
            s.swap_table = [host[b] for b in s.block_table]
        for s in seqs:  # a host block held by k sequences gets ref count k
            self.swap_pool.touch(s.swap_table)
        self.swap_pool.free(list(host.values()))
        for s in seqs:
            self.pool.free(s.block_table[::-1])
            s.block_table = []
            s.num_cached_blocks = 0
        self.num_swapped_out_blocks += len(distinct)
        return list(host.items())

    def can_swap_in(self, seqs: list[Sequence]) -> bool:
        """Room for the swapped blocks plus what the request's next step needs: blocks for
        its uncomputed tokens and the copy-on-write copies of shared, partly filled last
        blocks. Exact, so that a request that fits the empty pool (``_check_fits``) always
        comes back once the pool is empty."""
        distinct = set(b for s in seqs for b in s.swap_table)
        needed = len(distinct)
        last_holders = Counter(s.swap_table[-1] for s in seqs if s.swap_table)
        for s in seqs:
            needed += max(0, cdiv(s.num_tokens, self.block_size) - len(s.swap_table))
        for s in seqs:
            if s.swap_table and s.num_computed_tokens % self.block_size:
                # of h sequences writing into one shared partial block, h - 1 copy it
                needed += last_holders[s.swap_table[-1]] > 1
                last_holders[s.swap_table[-1]] -= 1
        return needed <= self.pool.num_free_blocks

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Bring swapped sequences back into free device blocks. Returns (host, device) pairs
        to copy. Call ``can_swap_in`` first."""
        distinct = list(dict.fromkeys(b for s in seqs for b in s.swap_table))
        device = dict(zip(distinct, self.pool.allocate(len(distinct))))
        for s in seqs:
            s.block_table = [device[b] for b in s.swap_table]
        for s in seqs:
            self.pool.touch(s.block_table)
        self.pool.free(list(device.values()))
        for s in seqs:
            self.swap_pool.free(s.swap_table[::-1])
            s.swap_table = []
        self.num_swapped_in_blocks += len(distinct)
        return list(device.items())


class ContiguousBlockManager(BlockManager):
    """The pre-paging baseline, for the ablation (``kv_allocator="contiguous"``): admitting a
    sequence reserves ``blocks_per_seq`` consecutive blocks (max_model_len slots) from a
    first-fit arena; the sequence writes into its run as it grows and returns the whole run
    when it ends. Admission waits until a long enough run is free, so growth never fails.
    No prefix caching, forks or swap (one sequence per request)."""

    def __init__(self, num_blocks: int, block_size: int, blocks_per_seq: int):
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        if not 1 <= blocks_per_seq <= num_blocks:
            raise ValueError(f"a reservation of {blocks_per_seq} blocks does not fit the "
                             f"{num_blocks} blocks of the cache")
        self.blocks_per_seq = blocks_per_seq
        self.free_runs: list[tuple[int, int]] = [(0, num_blocks)]  # (start, length), by start
        self.reservations: dict[int, int] = {}  # seq_id -> first block of its run

    @property
    def num_reserved_blocks(self) -> int:
        return len(self.reservations) * self.blocks_per_seq

    def _first_fit(self, runs: list[tuple[int, int]]) -> int | None:
        for i, (start, length) in enumerate(runs):
            if length >= self.blocks_per_seq:
                rest = length - self.blocks_per_seq
                runs[i:i + 1] = [(start + self.blocks_per_seq, rest)] if rest else []
                return start
        return None

    def can_allocate(self, items: Iterable[tuple[Sequence, int, list[int]]]) -> bool:
        runs = list(self.free_runs)
        return all(seq.seq_id in self.reservations or self._first_fit(runs) is not None
                   for seq, _, _ in items)

    def allocate(self, seq: Sequence, n: int, hits: list[int],
                 copies: list[tuple[int, int]]) -> None:
        if seq.seq_id not in self.reservations:
            start = self._first_fit(self.free_runs)
            if start is None:
                raise RuntimeError("no free run of blocks: call can_allocate first")
            self.reservations[seq.seq_id] = start
        start = self.reservations[seq.seq_id]
        have = len(seq.block_table)
        need = cdiv(seq.num_computed_tokens + n, self.block_size) - have
        if have + need > self.blocks_per_seq:
            raise RuntimeError(f"sequence {seq.seq_id} outgrew its reservation")
        ids = list(range(start + have, start + have + need))
        self.pool.touch(ids)  # blocks of a reserved run are free in the pool until written
        seq.block_table.extend(ids)

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        start = self.reservations.pop(seq.seq_id, None)
        if start is None:
            return
        runs = self.free_runs
        runs.append((start, self.blocks_per_seq))
        runs.sort()
        merged = [runs[0]]
        for s, length in runs[1:]:
            last_s, last_len = merged[-1]
            if last_s + last_len == s:
                merged[-1] = (last_s, last_len + length)
            else:
                merged.append((s, length))
        self.free_runs = merged

    def fork(self, parent: Sequence, child: Sequence) -> None:
        raise RuntimeError("the contiguous allocator runs one sequence per request")
