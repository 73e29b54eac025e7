"""Per-sequence block tables over the block pool (PagedAttention, Kwon et al., SOSP 2023, sec. 4).

- Allocation: a sequence holds ``ceil(tokens computed after this step / block_size)`` blocks,
  taken as it grows (never reserved to max length) and returned tail first.
- KV groups (kv/spec.py ``KVLayout``): a hybrid model's layers form groups, each with its own
  block table per sequence, all drawing on one pool. Tables are indexed by position (entry i
  covers tokens ``i * block_size ..``). A sliding-window group's table keeps only the blocks
  its window still reaches: once a sequence's computed tokens pass a block by the window, the
  block returns to the pool and its entry becomes ``NULL_BLOCK`` (vLLM's hybrid KV cache
  manager). A model with one kind of attention has one group: plain PagedAttention.
- Prefix caching: a new (or recomputed) sequence first reuses the longest chain of cached full
  blocks of its tokens, capped so the last prompt token is always computed; full blocks are
  registered in the cache (per group) as soon as their tokens are scheduled. A hit of P blocks
  needs every full-attention group's first P blocks and every window group's blocks that the
  window of position ``P * block_size`` reaches (the rest of that group's entries are null).
- Forks (parallel sampling, beam search; sec. 4.4): a child takes a reference on every block of
  its parent. A sequence about to write into a block held by others gets its own copy first
  (copy-on-write); the copy is recorded as (src, dst) for the runner to perform.
- Swap (sec. 4.5): all blocks of a request move to a host pool and back into any free blocks;
  blocks shared between its sequences stay shared.
- Open-block rows (a quantized cache only, kv/quant.py): each sequence holding blocks also
  holds one row of the cache's ``k_open`` (``Sequence.open_row``), where its open block's K
  stays unquantized until the block fills. A fork copies its parent's row, swap moves it to a
  host row and back; the moves wait in ``open_ops`` until the scheduler hands them to the
  runner with the next step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve.core.block_pool import BlockPool, hash_block
from pagedserve.kv.spec import NULL_BLOCK, cdiv
from pagedserve.sequence import Sequence

__all__ = ["NULL_BLOCK", "BlockManager", "ContiguousBlockManager", "cdiv"]

# Prefix hits: one list of blocks per KV group, all of the same length (no hit: []).
Hits = list[list[int]]


def _live(table: list[int]) -> list[int]:
    return [b for b in table if b != NULL_BLOCK]


@dataclass
class OpenRowOps:
    """Moves of open-block rows for the runner, each a (source, destination) row pair, done
    in this order before the step's forward: ``copies`` device -> device (forks),
    ``swap_out`` device -> host, ``swap_in`` host -> device."""

    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.copies or self.swap_out or self.swap_in)


class BlockManager:
    """Allocates, shares, copies, swaps and frees the blocks of each sequence's block tables
    (one per KV group; ``windows[g]``: group g's sliding window, None for full attention), and,
    with ``num_open`` > 0 (a quantized cache), the sequences' open-block rows."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_swap_blocks: int = 0, windows: tuple[int | None, ...] = (None,),
                 num_open: int = 0):
        # free open-block rows, device and host (stacks: the last freed is reused first)
        self.open_rows = list(range(num_open - 1, -1, -1)) if num_open else None
        self.host_open_rows = list(range(num_open - 1, -1, -1)) \
            if num_open and num_swap_blocks else None
        self.open_ops = OpenRowOps()
        self.block_size = block_size
        self.windows = tuple(windows)
        self.windowed = [g for g, w in enumerate(self.windows) if w is not None]
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

    @staticmethod
    def hit_blocks(hits: Hits) -> int:
        """Blocks of the prefix a hit covers (the same in every group)."""
        return len(hits[0]) if hits else 0

    def first_needed(self, window: int, position: int) -> int:
        """First block a window group needs for queries at ``position`` and later."""
        return max(0, position - window + 1) // self.block_size

    # ---- open-block rows (quantized caches) ----------------------------------------------

    def _take_open_row(self, seq: Sequence) -> None:
        if self.open_rows is None or seq.open_row >= 0:
            return
        if not self.open_rows:
            raise RuntimeError("no open-block row is free (more sequences than max_num_seqs)")
        seq.open_row = self.open_rows.pop()

    def _drop_open_rows(self, seq: Sequence) -> None:
        if seq.open_row >= 0:
            self.open_rows.append(seq.open_row)
            seq.open_row = -1
        if seq.host_open_row >= 0:
            self.host_open_rows.append(seq.host_open_row)
            seq.host_open_row = -1

    def take_open_ops(self) -> OpenRowOps:
        """The open-row moves recorded since the last call (the runner does them next)."""
        ops, self.open_ops = self.open_ops, OpenRowOps()
        return ops

    # ---- prefix caching -------------------------------------------------------------------

    def _update_hashes(self, seq: Sequence) -> None:
        """Extend ``seq.block_hashes`` over every full block of its known tokens."""
        bs, hashes, tokens = self.block_size, seq.block_hashes, seq.token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else seq.request.root_hash
            hashes.append(hash_block(parent, tokens[i * bs:(i + 1) * bs]))

    def find_cached_prefix(self, seq: Sequence) -> Hits:
        """Cached blocks (per group) holding the longest prefix of ``seq``'s tokens (none when
        caching is off, the sequence already has blocks, or its request wants prompt logprobs,
        which need every position computed). Changes nothing."""
        if not self.pool.enable_caching or seq.block_tables or seq.num_computed_tokens \
                or seq.request.prompt_logprobs is not None:
            return []
        self._update_hashes(seq)
        lookup = self.pool.lookup
        hashes = seq.block_hashes[:(seq.num_tokens - 1) // self.block_size]  # last is computed
        found: list[list[int | None]] = [[] for _ in self.windows]
        limit = len(hashes)
        # full-attention groups first: a miss ends their prefix, which bounds the rest
        for g in sorted(range(len(self.windows)), key=lambda g: self.windows[g] is not None):
            for h in hashes[:limit]:
                b = lookup((g, h))
                if b is None and self.windows[g] is None:
                    break
                found[g].append(b)
            if self.windows[g] is None:
                limit = len(found[g])

        def window_holds(num: int) -> bool:  # every window group has what position needs
            return all(None not in found[g][self.first_needed(self.windows[g],
                                                              num * self.block_size):num]
                       for g in self.windowed)

        num = next((n for n in range(limit, 0, -1) if window_holds(n)), 0)
        if num == 0:
            return []
        hits = []
        for g, w in enumerate(self.windows):
            first = 0 if w is None else self.first_needed(w, num * self.block_size)
            hits.append([NULL_BLOCK] * first + found[g][first:num])
        return hits

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        if not self.pool.enable_caching:
            return
        # only blocks of known tokens: a block that drafts fill is cached once they are
        # accepted (the next step's allocation)
        full = min(num_tokens, seq.num_tokens) // self.block_size
        full = min(full, len(seq.block_tables[0]))
        if full <= seq.num_cached_blocks:
            return
        self._update_hashes(seq)
        for g, table in enumerate(seq.block_tables):
            for i in range(seq.num_cached_blocks, full):
                if table[i] != NULL_BLOCK:
                    self.pool.cache_block(table[i], (g, seq.block_hashes[i]))
        seq.num_cached_blocks = full

    # ---- allocation -----------------------------------------------------------------------

    def _needs_copy(self, seq: Sequence, table: list[int]) -> bool:
        """The next token goes into a partly filled block that others also hold."""
        return (seq.num_computed_tokens % self.block_size != 0
                and self.pool.ref_cnt[table[-1]] > 1)

    def can_allocate(self, items: Iterable[tuple[Sequence, int, Hits]]) -> bool:
        """Whether every (sequence, new tokens, prefix hits) can get its blocks at once. Hits
        that are cached but free are not counted as free: an allocation never evicts its own
        hits."""
        needed, evictable_hits = 0, set()
        for seq, n, hits in items:
            if hits:
                total = self.hit_blocks(hits) * self.block_size + n
                needed += len(self.windows) * cdiv(total, self.block_size) - sum(map(len, hits))
                evictable_hits.update(b for h in hits for b in h
                                      if b != NULL_BLOCK and self.pool.ref_cnt[b] == 0)
            elif not seq.block_tables:
                needed += len(self.windows) * cdiv(seq.num_computed_tokens + n, self.block_size)
            else:
                want = cdiv(seq.num_computed_tokens + n, self.block_size)
                for table in seq.block_tables:
                    needed += max(0, want - len(table)) + self._needs_copy(seq, table)
        return needed <= self.pool.num_free_blocks - len(evictable_hits)

    def take_hits(self, seq: Sequence, hits: Hits) -> None:
        """Make ``hits`` (prefix-cache hits, not empty) the first blocks of ``seq``, which
        holds none yet; ``num_computed_tokens`` jumps past them."""
        for h in hits:
            self.pool.touch(_live(h))
        seq.block_tables = [list(h) for h in hits]
        seq.num_computed_tokens = self.hit_blocks(hits) * self.block_size
        seq.num_cached_blocks = self.hit_blocks(hits)

    def allocate(self, seq: Sequence, n: int, hits: Hits,
                 copies: list[tuple[int, int]]) -> None:
        """Give ``seq`` the blocks for ``n`` more tokens in every group, after taking
        ``hits`` as its first blocks (prefix-cache hits: ``num_computed_tokens`` jumps past
        them). Copy-on-write pairs are appended to ``copies``. Call ``can_allocate`` first;
        raises RuntimeError if the pool runs out."""
        self._take_open_row(seq)
        if hits:
            self.take_hits(seq, hits)
        elif not seq.block_tables:
            seq.block_tables = [[] for _ in self.windows]
        else:
            for g, table in enumerate(seq.block_tables):
                if self._needs_copy(seq, table):
                    (new,) = self.pool.allocate(1, g)
                    copies.append((table[-1], new))
                    self.pool.free([table[-1]])
                    table[-1] = new
        total = seq.num_computed_tokens + n
        want = cdiv(total, self.block_size)
        for g, table in enumerate(seq.block_tables):
            if want > len(table):
                table.extend(self.pool.allocate(want - len(table), g))
        self._cache_full_blocks(seq, total)

    def slide(self, seq: Sequence) -> None:
        """Return the blocks of ``seq``'s window groups that no query from its next token on
        can reach (their entries become ``NULL_BLOCK``). Called when its computed tokens
        advance, so that every table is as short as its window allows when the next step is
        planned."""
        if not self.windowed or not seq.block_tables:
            return
        for g in self.windowed:
            table = seq.block_tables[g]
            i = min(self.first_needed(self.windows[g], seq.num_computed_tokens), len(table)) - 1
            gone = []  # tail first; the entries before the first null one are null already
            while i >= 0 and table[i] != NULL_BLOCK:
                gone.append(table[i])
                table[i] = NULL_BLOCK
                i -= 1
            if gone:
                self.pool.free(gone)

    def trim(self, seq: Sequence) -> None:
        """Return, tail first, the blocks past those that hold ``seq``'s computed tokens
        (after rejected drafts were rolled back: those blocks held only rejected drafts)."""
        keep = cdiv(seq.num_computed_tokens, self.block_size)
        for table in seq.block_tables:
            if len(table) > keep:
                gone = _live(table[keep:])[::-1]
                del table[keep:]
                self.pool.free(gone)

    def forget_uncomputed(self, seq: Sequence) -> None:
        """Drop the prefix-cache hashes of ``seq``'s blocks past its computed tokens (those
        registered when this step was scheduled): after a failed step their K/V were never
        written, so no later request may hit them."""
        first = seq.num_computed_tokens // self.block_size
        for table in seq.block_tables:
            for b in _live(table[first:]):
                self.pool.forget(b)
        seq.num_cached_blocks = min(seq.num_cached_blocks, first)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s blocks (one more reference each)."""
        self._take_open_row(child)
        if parent.open_row >= 0:
            self.open_ops.copies.append((parent.open_row, child.open_row))
        for table in parent.block_tables:
            self.pool.touch(_live(table))
        child.block_tables = [list(t) for t in parent.block_tables]
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Return all of a sequence's blocks, tail first, and empty its block tables."""
        if self.open_rows is not None:
            self._drop_open_rows(seq)
        for table in seq.block_tables:
            self.pool.free(_live(table)[::-1])
        seq.block_tables = []
        seq.num_cached_blocks = 0
        if seq.swap_tables:
            for table in seq.swap_tables:
                self.swap_pool.free(_live(table)[::-1])
            seq.swap_tables = []

    # ---- swap -----------------------------------------------------------------------------

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]] | None:
        """Move the sequences' blocks to the host pool. Returns (device, host) block pairs to
        copy, or None (nothing changed) when the host pool is too small."""
        distinct = list(dict.fromkeys(b for s in seqs for t in s.block_tables for b in _live(t)))
        if self.swap_pool is None or len(distinct) > self.swap_pool.num_free_blocks:
            return None
        if self.open_rows is not None:
            holders = [s for s in seqs if s.open_row >= 0]
            if len(holders) > len(self.host_open_rows):
                return None
            for s in holders:
                s.host_open_row = self.host_open_rows.pop()
                self.open_ops.swap_out.append((s.open_row, s.host_open_row))
                self.open_rows.append(s.open_row)
                s.open_row = -1
        host = dict(zip(distinct, self.swap_pool.allocate(len(distinct))))
        host[NULL_BLOCK] = NULL_BLOCK
        for s in seqs:
            s.swap_tables = [[host[b] for b in t] for t in s.block_tables]
        for s in seqs:  # a host block held by k sequences gets ref count k
            for t in s.swap_tables:
                self.swap_pool.touch(_live(t))
        del host[NULL_BLOCK]
        self.swap_pool.free(list(host.values()))
        for s in seqs:
            for t in s.block_tables:
                self.pool.free(_live(t)[::-1])
            s.block_tables = []
            s.num_cached_blocks = 0
        self.num_swapped_out_blocks += len(distinct)
        return list(host.items())

    def can_swap_in(self, seqs: list[Sequence], chunk: int) -> bool:
        """Room for the swapped blocks plus what the request's next step needs: in a
        full-attention group, blocks for all its uncomputed tokens; in a window group, for
        the next ``chunk`` of them (its older blocks go back as it advances); and the
        copy-on-write copies of shared, partly filled last blocks. Exact, so that a request
        that fits the empty pool (``check_fits``) always comes back once the pool is empty."""
        distinct = set(b for s in seqs for t in s.swap_tables for b in _live(t))
        needed = len(distinct)
        for g, window in enumerate(self.windows):
            tables = [s.swap_tables[g] for s in seqs if s.swap_tables]
            last_holders = Counter(t[-1] for t in tables if t)
            for s in seqs:
                if not s.swap_tables:
                    continue
                t = s.swap_tables[g]
                upto = s.num_tokens if window is None else \
                    min(s.num_tokens, s.num_computed_tokens + chunk)
                needed += max(0, cdiv(upto, self.block_size) - len(t))
                if t and s.num_computed_tokens % self.block_size:
                    # of h sequences writing into one shared partial block, h - 1 copy it
                    needed += last_holders[t[-1]] > 1
                    last_holders[t[-1]] -= 1
        if self.open_rows is not None and \
                sum(s.host_open_row >= 0 for s in seqs) > len(self.open_rows):
            return False
        return needed <= self.pool.num_free_blocks

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Bring swapped sequences back into free device blocks. Returns (host, device) pairs
        to copy. Call ``can_swap_in`` first."""
        device = {NULL_BLOCK: NULL_BLOCK}
        for g in range(len(self.windows)):  # a block belongs to one group: its tag
            distinct = list(dict.fromkeys(b for s in seqs if s.swap_tables
                                          for b in _live(s.swap_tables[g])))
            device.update(zip(distinct, self.pool.allocate(len(distinct), g)))
        for s in seqs:
            s.block_tables = [[device[b] for b in t] for t in s.swap_tables]
            if s.host_open_row >= 0:
                s.open_row = self.open_rows.pop()
                self.open_ops.swap_in.append((s.host_open_row, s.open_row))
                self.host_open_rows.append(s.host_open_row)
                s.host_open_row = -1
        for s in seqs:
            for t in s.block_tables:
                self.pool.touch(_live(t))
        del device[NULL_BLOCK]
        self.pool.free(list(device.values()))
        for s in seqs:
            for t in s.swap_tables:
                self.swap_pool.free(_live(t)[::-1])
            s.swap_tables = []
        self.num_swapped_in_blocks += len(device)
        return list(device.items())


class ContiguousBlockManager(BlockManager):
    """The pre-paging baseline, for the ablation (``kv_allocator="contiguous"``): admitting a
    sequence reserves ``blocks_per_seq`` consecutive blocks (max_model_len slots) from a
    first-fit arena; the sequence writes into its run as it grows and returns the whole run
    when it ends. Admission waits until a long enough run is free, so growth never fails.
    No prefix caching, forks or swap (one sequence per request)."""

    def __init__(self, num_blocks: int, block_size: int, blocks_per_seq: int,
                 num_open: int = 0):
        super().__init__(num_blocks, block_size, enable_prefix_caching=False,
                         num_open=num_open)
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

    def can_allocate(self, items: Iterable[tuple[Sequence, int, Hits]]) -> bool:
        runs = list(self.free_runs)
        return all(seq.seq_id in self.reservations or self._first_fit(runs) is not None
                   for seq, _, _ in items)

    def allocate(self, seq: Sequence, n: int, hits: Hits,
                 copies: list[tuple[int, int]]) -> None:
        self._take_open_row(seq)
        if not seq.block_tables:
            seq.block_tables = [[]]
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
