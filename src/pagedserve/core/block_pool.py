"""Physical KV blocks: a FIFO free queue and a reference count per block.

Invariants (checked every step when ``PAGEDSERVE_DEBUG_KV=1``): a block is in the free queue
exactly when its ref count is 0; no block is in the queue twice; ref counts are never negative;
``num_free_blocks + num_used_blocks == num_blocks``.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids in ``[0, num_blocks)`` and takes them back.

    Blocks are not tied to any request here; block tables live with the requests
    (:class:`pagedserve.core.block_manager.BlockManager`).
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.free_queue: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (ref count 1 each). Raises RuntimeError if fewer are free."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, only {len(self.free_queue)} free")
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_cnt[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the back of the queue
        in the order given."""
        for b in blocks:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue.append(b)

    def check_invariants(self, block_tables: list[list[int]]) -> None:
        """Assert the pool agrees with the live block tables. Raises AssertionError."""
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue), "a block is in the free queue twice"
        refs = [0] * self.num_blocks
        for table in block_tables:
            for b in table:
                refs[b] += 1
        for b in range(self.num_blocks):
            assert self.ref_cnt[b] >= 0, f"block {b} has negative ref count {self.ref_cnt[b]}"
            assert self.ref_cnt[b] == refs[b], (
                f"block {b}: ref count {self.ref_cnt[b]} but {refs[b]} block tables hold it"
            )
            assert (b in free) == (refs[b] == 0), f"block {b}: free-queue state disagrees"
        assert self.num_free_blocks + self.num_used_blocks == self.num_blocks
