"""The KV cache tensors: one K and one V tensor per layer, each block-major.

Layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (vLLM's, token-major
inside a block), so that viewed as ``[num_blocks * block_size, num_kv_heads, head_dim]`` a
token's slot is a row index: writes go through ``slot_mapping`` with one ``index_copy_``, and a
block table gathers whole blocks whose rows are already in position order. All layers live in
one allocation ``[slots, 2, num_blocks, block_size, num_kv_heads, head_dim]``: a block holds
``slots`` layers (kv/spec.py ``KVLayout``: every layer for a model with one kind of attention;
one KV group's layers for a hybrid model, whose groups each map their own blocks). It starts
zeroed so that never-written slots hold finite values (a masked score's zero weight times a
NaN would still be NaN). On CPU the zeros come from a private anonymous mapping advised for
transparent huge pages (calloc through numpy where that is not available), so the OS commits
pages as blocks are first written instead of at start-up. An 8-bit cache (``kv_cache_dtype``
"int8" or "fp8", see kv/quant.py) holds bytes in ``kv`` and one scale per token and KV head in
``scales`` [num_layers, 2, num_blocks, block_size, num_kv_heads]; every block operation (copy,
swap) moves both, so a block's scales never part from its bytes.
"""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass

import numpy as np
import psutil
import torch

from pagedserve.config import ModelConfig
from pagedserve.kv import spec as kv_spec
from pagedserve.kv.quant import SCALE_DTYPE, KVCacheSpec

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


def kv_bytes_per_token(model: ModelConfig, spec: KVCacheSpec) -> int:
    """Bytes one token's K/V cost in a cache stored as ``spec``, scales included."""
    return kv_spec.kv_bytes_per_token(model.num_hidden_layers, model.num_key_value_heads,
                                      model.head_dim, spec.element_bytes, spec.scale_bytes)


def slot_bytes_per_token(model: ModelConfig, spec: KVCacheSpec, layout: kv_spec.KVLayout) -> int:
    """Bytes one token's slot of a block costs: ``layout.slots`` layers' K/V, scales included
    (``kv_bytes_per_token`` for a model with one kind of attention)."""
    return kv_spec.kv_bytes_per_token(layout.slots, model.num_key_value_heads, model.head_dim,
                                      spec.element_bytes, spec.scale_bytes)


def num_blocks_for_memory(kv_cache_memory: int, model: ModelConfig, block_size: int,
                          spec: KVCacheSpec, layout: kv_spec.KVLayout) -> int:
    """How many blocks fit in ``kv_cache_memory`` bytes (``kv.spec``'s rule, which
    ``pagedserve plan`` uses too)."""
    return kv_spec.num_blocks(kv_cache_memory, slot_bytes_per_token(model, spec, layout),
                              block_size)


HUGE_PAGE = 2 << 20  # bytes: the x86-64 transparent huge page


def _huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """Zeroed CPU memory advised for transparent huge pages (Linux ``madvise(MADV_HUGEPAGE)``),
    or None where the OS has no such advice or the tensor is under one huge page. Decode
    attention and the K/V write reach blocks scattered over gigabytes of cache, so with 4 KB
    pages nearly every block they touch costs a TLB miss, which 2 MB pages spare
    (docs/performance.md has the measurement). The mapping comes zeroed and the OS
    commits it as it is touched (2 MB at a time where huge pages are granted), like calloc."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # no address space for it: calloc's MemoryError becomes the clear error
        return None
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP compiled out or disabled: still zeroed, lazily committed memory
        pass
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE  # THP backs only 2 MB-aligned ranges
    return raw[start:start + nbytes].view(dtype).view(shape)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           huge_pages: bool = False) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    if huge_pages and (t := _huge_page_zeros(shape, dtype)) is not None:
        return t
    raw = np.zeros(shape, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32}[dtype.itemsize])
    return torch.from_numpy(raw).view(dtype)


def _host_zeros(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    if pinned:
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    return _zeros(shape, dtype, torch.device("cpu"))


@dataclass
class LayerKVCache:
    """One layer's view of the cache: ``k``/``v`` [num_blocks, block_size, num_kv_heads,
    head_dim] of ``spec.storage_dtype``; for an 8-bit cache ``k_scale``/``v_scale``
    [num_blocks, block_size, num_kv_heads] bfloat16, else None. ``group``: the KV group whose
    block tables (and slot mapping) address this layer's blocks."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    spec: KVCacheSpec
    group: int = 0


class KVCache:
    """Owns the K/V tensors. ``layers[i]`` is layer i's :class:`LayerKVCache`. ``swap`` (and
    ``swap_scales`` for an 8-bit cache) is the host swap pool, shaped like ``kv`` (and
    ``scales``) with ``num_swap_blocks`` blocks (PagedAttention sec. 4.5), pinned when the
    cache is on CUDA."""

    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int,
                 spec: KVCacheSpec, device: torch.device, num_swap_blocks: int = 0,
                 layout: kv_spec.KVLayout | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.spec = spec
        self.layout = layout = layout or kv_spec.kv_layout([None] * model.num_hidden_layers)
        shape = (layout.slots, 2, num_blocks, block_size, model.num_key_value_heads,
                 model.head_dim)
        swap_shape = (*shape[:2], num_swap_blocks, *shape[3:])
        pinned = device.type == "cuda"
        self.kv = _zeros(shape, spec.storage_dtype, device, huge_pages=True)
        self.swap = _host_zeros(swap_shape, spec.storage_dtype, pinned)
        self.scales = self.swap_scales = None
        if spec.quantized:
            self.scales = _zeros(shape[:-1], SCALE_DTYPE, device, huge_pages=True)
            self.swap_scales = _host_zeros(swap_shape[:-1], SCALE_DTYPE, pinned)
        self.layers = []
        for layer in range(model.num_hidden_layers):
            g, i = layout.layer_slot(layer)
            self.layers.append(LayerKVCache(
                self.kv[i, 0], self.kv[i, 1], None if self.scales is None else self.scales[i, 0],
                None if self.scales is None else self.scales[i, 1], spec, g))

    @classmethod
    def allocate(cls, model: ModelConfig, num_blocks: int, block_size: int, spec: KVCacheSpec,
                 device: torch.device, num_swap_blocks: int = 0,
                 layout: kv_spec.KVLayout | None = None) -> KVCache:
        """Allocate after checking the memory exists. Raises ValueError naming the sizes."""
        layout = layout or kv_spec.kv_layout([None] * model.num_hidden_layers)
        block_bytes = slot_bytes_per_token(model, spec, layout) * block_size
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
            return cls(model, num_blocks, block_size, spec, device, num_swap_blocks, layout)
        except (MemoryError, torch.OutOfMemoryError) as e:
            raise ValueError(f"cannot allocate a KV cache of {nbytes / 2**30:.2f} GiB: {e}") from e

    @property
    def nbytes(self) -> int:
        """Device bytes of K/V and scales."""
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.kv.numel() * self.kv.element_size() + scales

    def _index(self, ids: list[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=device)

    def _pairs(self):
        """(device tensor, host tensor) pairs a block operation moves: K/V, then scales."""
        yield self.kv, self.swap
        if self.scales is not None:
            yield self.scales, self.swap_scales

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src -> block dst in every layer, for each (src, dst)."""
        src, dst = zip(*pairs)
        for t, _ in self._pairs():
            t.index_copy_(2, self._index(dst, t.device),
                          t.index_select(2, self._index(src, t.device)))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device block -> host block, for each (device, host)."""
        dev_ids, host_ids = zip(*pairs)
        for dev, host in self._pairs():
            blocks = dev.index_select(2, self._index(dev_ids, dev.device))
            host.index_copy_(2, self._index(host_ids, host.device), blocks.to("cpu"))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host block -> device block, for each (host, device)."""
        host_ids, dev_ids = zip(*pairs)
        for dev, host in self._pairs():
            blocks = host.index_select(2, self._index(host_ids, host.device))
            dev.index_copy_(2, self._index(dev_ids, dev.device), blocks.to(dev.device))
