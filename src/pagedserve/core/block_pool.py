"""Physical KV blocks: reference counts, an LRU free queue, and the prefix cache's hash map.

Automatic prefix caching (as in vLLM, after SGLang's RadixAttention, Zheng et al. 2024): a
full block is identified by a hash chained from its parent block's hash and its token ids, so
equal prefixes map to equal hashes. A block whose last reference is dropped keeps its hash and
stays reusable ("cached") in the free queue until its memory is needed; the queue's front is the
least recently freed block, evicted first, and eviction clears the hash.

Invariants (checked every step when ``PAGEDSERVE_DEBUG_KV=1``): a block is in the free queue
exactly when its ref count is 0; ref counts are never negative; ``cached[h] == b`` implies
``block_hash[b] == h``; ``num_free (unhashed) + num_cached (hashed, evictable) + num_used ==
num_blocks``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """sha256 of the parent block's hash and this block's token ids. A cryptographic hash, so a
    crafted prompt cannot collide with another request's blocks."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def root_hash(cache_salt: str | None) -> bytes:
    """The parent hash of a request's first block; different salts never share a block."""
    return hashlib.sha256(b"pagedserve|" + (cache_salt or "").encode("utf-8", "surrogatepass")).digest()


class BlockPool:
    """Block ids ``[0, num_blocks)`` with ref counts; with ``enable_caching``, full blocks can
    be registered under their hash and found again after they are freed."""

    def __init__(self, num_blocks: int, enable_caching: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # ref-count-0 blocks, front = least recently freed = evicted first
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.num_cached_free = 0  # hashed blocks in the free queue
        # Each block's owner tag (a hybrid model's KV group) and the blocks in use per tag.
        self.tag = [0] * num_blocks
        self.used_by_tag: dict[int, int] = {}
        self.peak_used = 0  # most blocks in use at any moment, inside a step too

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus cached (evictable) ones."""
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return self.num_cached_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def allocate(self, n: int, tag: int = 0) -> list[int]:
        """Take ``n`` blocks from the front of the free queue (ref count 1 each, owned by
        ``tag``), evicting their cached content. Raises RuntimeError if fewer are free."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, only {len(self.free_queue)} free")
        blocks = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:  # evict: the block's old content is no longer findable
                self.num_cached_free -= 1
                self.block_hash[b] = None
                if self.cached.get(h) == b:
                    del self.cached[h]
            self.ref_cnt[b] = 1
            self.tag[b] = tag
            blocks.append(b)
        self.used_by_tag[tag] = self.used_by_tag.get(tag, 0) + n
        self.peak_used = max(self.peak_used, self.num_used_blocks)
        return blocks

    def touch(self, blocks: Sequence[int]) -> None:
        """Take one more reference on each block (a prefix-cache hit or a fork); a cached free
        block leaves the free queue."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
                if self.block_hash[b] is not None:
                    self.num_cached_free -= 1
                self.used_by_tag[self.tag[b]] = self.used_by_tag.get(self.tag[b], 0) + 1
            self.ref_cnt[b] += 1
        self.peak_used = max(self.peak_used, self.num_used_blocks)

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the back of the free
        queue in the order given (pass a block table reversed: tails are evicted before the
        prefixes other requests may share)."""
        for b in blocks:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None
                self.used_by_tag[self.tag[b]] -= 1
                if self.block_hash[b] is not None:
                    self.num_cached_free += 1

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def cache_block(self, block: int, block_hash: bytes) -> None:
        """Register a full, computed block under its hash (no-op if the hash is known)."""
        if block_hash not in self.cached and self.block_hash[block] is None:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash

    def forget(self, block: int) -> None:
        """Unregister a block's hash (its content is not what the hash says)."""
        h = self.block_hash[block]
        if h is None:
            return
        self.block_hash[block] = None
        if self.cached.get(h) == block:
            del self.cached[h]
        if self.ref_cnt[block] == 0:
            self.num_cached_free -= 1

    def check_invariants(self, block_tables: list[list[int]]) -> None:
        """Assert the pool agrees with the live block tables. Raises AssertionError."""
        assert len(self.free_queue) == len(set(self.free_queue)), "a block is free twice"
        refs = [0] * self.num_blocks
        for table in block_tables:
            for b in table:
                if b >= 0:  # a window group's null entries hold nothing
                    refs[b] += 1
        for b in range(self.num_blocks):
            assert self.ref_cnt[b] >= 0, f"block {b} has negative ref count {self.ref_cnt[b]}"
            assert self.ref_cnt[b] == refs[b], (
                f"block {b}: ref count {self.ref_cnt[b]} but {refs[b]} block tables hold it")
            assert (b in self.free_queue) == (refs[b] == 0), f"block {b}: free-queue state disagrees"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"block {b}: stale prefix-cache entry"
        hashed_free = sum(1 for b in self.free_queue if self.block_hash[b] is not None)
        assert hashed_free == self.num_cached_free, "cached-block count disagrees"
        num_free = len(self.free_queue) - self.num_cached_free
        assert num_free + self.num_cached_free + self.num_used_blocks == self.num_blocks
        by_tag: dict[int, int] = {}
        for b in range(self.num_blocks):
            if refs[b]:
                by_tag[self.tag[b]] = by_tag.get(self.tag[b], 0) + 1
        assert by_tag == {t: n for t, n in self.used_by_tag.items() if n}, (
            f"blocks in use per tag {self.used_by_tag} but the tables hold {by_tag}")
