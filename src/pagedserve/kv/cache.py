"""The KV cache tensors: one K and one V tensor per layer, each block-major.

Layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (vLLM's, token-major
inside a block), so that viewed as ``[num_blocks * block_size, num_kv_heads, head_dim]`` a
token's slot is a row index: writes go through ``slot_mapping`` with one ``index_copy_``, and a
block table gathers whole blocks whose rows are already in position order. All layers live in
one allocation ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``. It starts
zeroed so that never-written slots hold finite values (a masked score's zero weight times a
NaN would still be NaN). On CPU the zeros come from calloc (through numpy), so the OS commits
pages as blocks are first written instead of at start-up.
"""

from __future__ import annotations

import logging

import numpy as np
import psutil
import torch

from pagedserve import planner
from pagedserve.config import ModelConfig

logger = logging.getLogger(__name__)

# CPU default: this share of the memory still available after the weights are loaded.
CPU_KV_CACHE_MEMORY_FRACTION = 0.25
# CUDA default: this share of the free device memory after the weights are loaded (the rest is
# left for activations, the sampler and other processes).
CUDA_KV_CACHE_MEMORY_FRACTION = 0.80


def default_kv_cache_memory(device: torch.device) -> int:
    """Bytes for the KV cache when ``kv_cache_memory`` is not given (see the fractions above)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_KV_CACHE_MEMORY_FRACTION)
    return int(psutil.virtual_memory().available * CPU_KV_CACHE_MEMORY_FRACTION)


def num_blocks_for_memory(kv_cache_memory: int, model: ModelConfig, block_size: int,
                          dtype: torch.dtype) -> int:
    """How many blocks fit in ``kv_cache_memory`` bytes (the planner's rule, so that
    ``pagedserve plan`` and the engine agree)."""
    return planner.num_blocks(kv_cache_memory, model.kv_bytes_per_token(dtype), block_size)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    raw = np.zeros(shape, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32}[itemsize])
    return torch.from_numpy(raw).view(dtype)


class KVCache:
    """Owns the K/V tensors. ``layers[i]`` is ``(k_cache, v_cache)`` of layer i, each
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` of ``dtype`` on ``device``. ``swap``
    is the host swap pool ``[num_layers, 2, num_swap_blocks, block_size, num_kv_heads,
    head_dim]`` (PagedAttention sec. 4.5), pinned when the cache is on CUDA."""

    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, num_swap_blocks: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (model.num_hidden_layers, 2, num_blocks, block_size, model.num_key_value_heads,
                 model.head_dim)
        self.kv = _zeros(shape, dtype, device)
        self.layers = [(self.kv[i, 0], self.kv[i, 1]) for i in range(model.num_hidden_layers)]
        swap_shape = (*shape[:2], num_swap_blocks, *shape[3:])
        if device.type == "cuda":
            self.swap = torch.zeros(swap_shape, dtype=dtype, pin_memory=True)
        else:
            self.swap = _zeros(swap_shape, dtype, torch.device("cpu"))

    @classmethod
    def allocate(cls, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, num_swap_blocks: int = 0) -> KVCache:
        """Allocate after checking the memory exists. Raises ValueError naming the sizes."""
        block_bytes = model.kv_bytes_per_token(dtype) * block_size
        nbytes, swap_bytes = block_bytes * num_blocks, block_bytes * num_swap_blocks
        host = psutil.virtual_memory().available
        device_free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else host
        if device.type == "cpu":  # the cache and the swap pool share one memory
            device_free -= swap_bytes
        if swap_bytes > host:
            raise ValueError(f"the swap space of {num_swap_blocks} blocks needs "
                             f"{swap_bytes / 2**30:.2f} GiB but only {host / 2**30:.2f} GiB of "
                             "host memory is available; lower swap_space")
        if nbytes > device_free:
            raise ValueError(f"the KV cache of {num_blocks} blocks needs {nbytes / 2**30:.2f} GiB "
                             f"but only {max(device_free, 0) / 2**30:.2f} GiB of memory is "
                             "available (after the swap space); lower kv_cache_memory or "
                             "num_kv_blocks")
        try:
            return cls(model, num_blocks, block_size, dtype, device, num_swap_blocks)
        except (MemoryError, torch.OutOfMemoryError) as e:
            raise ValueError(f"cannot allocate a KV cache of {nbytes / 2**30:.2f} GiB: {e}") from e

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def _index(self, ids: list[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=device)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src -> block dst in every layer, for each (src, dst)."""
        src, dst = zip(*pairs)
        dev = self.kv.device
        self.kv.index_copy_(2, self._index(dst, dev), self.kv.index_select(2, self._index(src, dev)))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device block -> host block, for each (device, host)."""
        dev_ids, host_ids = zip(*pairs)
        blocks = self.kv.index_select(2, self._index(dev_ids, self.kv.device))
        self.swap.index_copy_(2, self._index(host_ids, self.swap.device), blocks.to("cpu"))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host block -> device block, for each (host, device)."""
        host_ids, dev_ids = zip(*pairs)
        blocks = self.swap.index_select(2, self._index(host_ids, self.swap.device))
        self.kv.index_copy_(2, self._index(dev_ids, self.kv.device), blocks.to(self.kv.device))
