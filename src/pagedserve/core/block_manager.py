"""Per-request block tables over the block pool (PagedAttention, Kwon et al., SOSP 2023, sec. 4.2).

A request holds exactly ``ceil(num_computed_tokens_after_this_step / block_size)`` blocks: blocks
are taken as the request grows, one step at a time, never reserved to max length, and all
returned (tail first) the step it finishes or is preempted.
"""

from __future__ import annotations

from pagedserve.core.block_pool import BlockPool
from pagedserve.sequence import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates and frees the blocks of each request's ``block_table``."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens``.

        Returns False (and changes nothing) when the pool has too few free blocks.
        """
        total = request.num_computed_tokens + num_new_tokens
        needed = self.num_blocks_for(total) - len(request.block_table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free_blocks:
            return False
        request.block_table.extend(self.pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        """Return all of a request's blocks, tail first, and empty its block table."""
        self.pool.free(request.block_table[::-1])
        request.block_table = []
