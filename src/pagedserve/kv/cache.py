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
pages as blocks are first written instead of at start-up.

A quantized cache (``kv_cache_dtype`` "int8", "fp8" or "int4", see kv/quant.py) holds codes in
``kv`` (int4: ``head_dim / 2`` bytes per row), K's per-channel scales and offsets in
``k_params`` [slots, 2 (scale, offset), num_blocks, num_kv_heads, head_dim] and V's per-token
scales in ``v_params`` [slots, 1, num_blocks, block_size, num_kv_heads]. Every block operation
(copy, swap) moves all three along their block axis, so a block's parameters never part from
its codes. ``kv_open`` [num_layers, 2, num_open, block_size,
num_kv_heads, head_dim], in the model's dtype, holds each running sequence's open (not yet
full) block of K and V rows, one row of blocks per sequence (``Sequence.open_row``, assigned by
the block manager); ``host_kv_open`` is its swap twin. Invariants: a block's codes and
parameters are written exactly once, when it fills; an open block's codes are never read.
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
from pagedserve.kv.quant import PARAM_DTYPE, KVCacheSpec

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


def _block_bytes(num_layers: int, model: ModelConfig, spec: KVCacheSpec, block_size: int) -> int:
    return kv_spec.kv_block_bytes(num_layers, model.num_key_value_heads, model.head_dim,
                                  kv_spec.DTYPES[spec.name][1], block_size,
                                  kv_spec.kv_param_bytes(spec.name, model.head_dim, block_size))


def kv_bytes_per_token(model: ModelConfig, spec: KVCacheSpec, block_size: int) -> int:
    """Bytes one token's K/V cost in a cache stored as ``spec``, scales and offsets
    included."""
    return -(-_block_bytes(model.num_hidden_layers, model, spec, block_size) // block_size)


def block_bytes(model: ModelConfig, spec: KVCacheSpec, layout: kv_spec.KVLayout,
                block_size: int) -> int:
    """Bytes one block costs: ``layout.slots`` layers' K/V for ``block_size`` tokens, scales
    and offsets included."""
    return _block_bytes(layout.slots, model, spec, block_size)


def open_rows_bytes(model: ModelConfig, spec: KVCacheSpec, block_size: int,
                    num_open: int) -> int:
    """Bytes of ``num_open`` open rows (quantized caches only, else 0)."""
    return num_open * kv_spec.open_block_bytes(
        model.num_hidden_layers, model.num_key_value_heads, model.head_dim,
        spec.compute_dtype.itemsize, block_size, spec.name)


def num_blocks_for_memory(kv_cache_memory: int, model: ModelConfig, block_size: int,
                          spec: KVCacheSpec, layout: kv_spec.KVLayout) -> int:
    """How many blocks fit in ``kv_cache_memory`` bytes (``kv.spec``'s rule, which
    ``pagedserve plan`` uses too)."""
    return kv_spec.num_blocks(kv_cache_memory, block_bytes(model, spec, layout, block_size))


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
    code_dim] of ``spec.storage_dtype`` (code_dim: head_dim, or head_dim / 2 for int4). For a
    quantized cache ``k_scale``/``k_zero`` [num_blocks, num_kv_heads, head_dim] and
    ``v_scale`` [num_blocks, block_size, num_kv_heads] bfloat16, and ``k_open``/``v_open``
    [num_open, block_size, num_kv_heads, head_dim] of the model's dtype; all None
    otherwise. ``group``: the KV group whose block
    tables (and slot mapping) address this layer's blocks."""

    k: torch.Tensor
    v: torch.Tensor
    spec: KVCacheSpec
    group: int = 0
    k_scale: torch.Tensor | None = None
    k_zero: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_open: torch.Tensor | None = None
    v_open: torch.Tensor | None = None


class KVCache:
    """Owns the K/V tensors. ``layers[i]`` is layer i's :class:`LayerKVCache`. ``swap`` (and
    ``swap_k_params``/``swap_v_params``/``host_kv_open`` for a quantized cache) is the host
    swap pool, shaped like ``kv`` (and the parameters, and ``kv_open``) with ``num_swap_blocks`` blocks (PagedAttention
    sec. 4.5) and ``num_open`` open rows, pinned when the cache is on CUDA."""

    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int,
                 spec: KVCacheSpec, device: torch.device, num_swap_blocks: int = 0,
                 layout: kv_spec.KVLayout | None = None, num_open: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.spec = spec
        self.layout = layout = layout or kv_spec.kv_layout([None] * model.num_hidden_layers)
        kvh, hd, slots = model.num_key_value_heads, model.head_dim, layout.slots
        shape = (slots, 2, num_blocks, block_size, kvh, spec.code_dim(hd))
        pinned = device.type == "cuda"
        self.kv = _zeros(shape, spec.storage_dtype, device, huge_pages=True)
        self.swap = _host_zeros((*shape[:2], num_swap_blocks, *shape[3:]), spec.storage_dtype,
                                pinned)
        self.num_open = num_open if spec.quantized else 0
        self.k_params = self.v_params = self.kv_open = self.host_kv_open = None
        if spec.quantized:
            kp, vp = (slots, 2, num_blocks, kvh, hd), (slots, 1, num_blocks, block_size, kvh)
            self.k_params = _zeros(kp, PARAM_DTYPE, device, huge_pages=True)
            self.v_params = _zeros(vp, PARAM_DTYPE, device, huge_pages=True)
            self.swap_k_params, self.swap_v_params = (
                _host_zeros((*p[:2], num_swap_blocks, *p[3:]), PARAM_DTYPE, pinned)
                for p in (kp, vp))
            opened = (model.num_hidden_layers, 2, self.num_open, block_size, kvh, hd)
            self.kv_open = _zeros(opened, spec.compute_dtype, device)
            if num_swap_blocks:
                self.host_kv_open = _host_zeros(opened, spec.compute_dtype, pinned)
        self.layers = []
        for layer in range(model.num_hidden_layers):
            g, i = layout.layer_slot(layer)
            view = LayerKVCache(self.kv[i, 0], self.kv[i, 1], spec, g)
            if spec.quantized:
                view.k_scale, view.k_zero = self.k_params[i].unbind(0)
                view.v_scale = self.v_params[i, 0]
                view.k_open, view.v_open = self.kv_open[layer].unbind(0)
            self.layers.append(view)

    @classmethod
    def allocate(cls, model: ModelConfig, num_blocks: int, block_size: int, spec: KVCacheSpec,
                 device: torch.device, num_swap_blocks: int = 0,
                 layout: kv_spec.KVLayout | None = None, num_open: int = 0) -> KVCache:
        """Allocate after checking the memory exists. ``num_open``: rows of open blocks (a
        quantized cache's running sequences; ignored otherwise). Raises ValueError naming the
        sizes."""
        layout = layout or kv_spec.kv_layout([None] * model.num_hidden_layers)
        one = block_bytes(model, spec, layout, block_size)
        opened = open_rows_bytes(model, spec, block_size, num_open)
        nbytes = one * num_blocks + opened
        swap_bytes = one * num_swap_blocks + (opened if num_swap_blocks else 0)
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
            return cls(model, num_blocks, block_size, spec, device, num_swap_blocks, layout,
                       num_open)
        except (MemoryError, torch.OutOfMemoryError) as e:
            raise ValueError(f"cannot allocate a KV cache of {nbytes / 2**30:.2f} GiB: {e}") from e

    @property
    def nbytes(self) -> int:
        """Device bytes of K/V, their scales and offsets, and the open rows."""
        return sum(t.numel() * t.element_size() for t in
                   (self.kv, self.k_params, self.v_params, self.kv_open) if t is not None)

    @property
    def open_nbytes(self) -> int:
        """Device bytes of the open rows alone (beside the blocks, 0 for full precision)."""
        return 0 if self.kv_open is None else self.kv_open.numel() * self.kv_open.element_size()

    def _index(self, ids: list[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=device)

    def _pairs(self):
        """(device tensor, host tensor) pairs a block operation moves along dim 2: codes (or
        K/V), then their scales and offsets."""
        yield self.kv, self.swap
        if self.k_params is not None:
            yield self.k_params, self.swap_k_params
            yield self.v_params, self.swap_v_params

    @staticmethod
    def _move(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int],
              dim: int) -> None:
        rows = src.index_select(dim, torch.tensor(src_ids, dtype=torch.int64,
                                                  device=src.device))
        dst.index_copy_(dim, torch.tensor(dst_ids, dtype=torch.int64, device=dst.device),
                        rows.to(dst.device))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src -> block dst in every layer, for each (src, dst)."""
        src, dst = zip(*pairs)
        for t, _ in self._pairs():
            self._move(t, src, t, dst, 2)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device block -> host block, for each (device, host)."""
        dev_ids, host_ids = zip(*pairs)
        for dev, host in self._pairs():
            self._move(dev, dev_ids, host, host_ids, 2)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host block -> device block, for each (host, device)."""
        host_ids, dev_ids = zip(*pairs)
        for dev, host in self._pairs():
            self._move(host, host_ids, dev, dev_ids, 2)

    def move_open(self, copies: list[tuple[int, int]], swap_out: list[tuple[int, int]],
                  swap_in: list[tuple[int, int]]) -> None:
        """Open rows: device row src -> device row dst (a fork), device -> host (swap out),
        host -> device (swap in), for each pair, in that order."""
        for pairs, src, dst in ((copies, self.kv_open, self.kv_open),
                                (swap_out, self.kv_open, self.host_kv_open),
                                (swap_in, self.host_kv_open, self.kv_open)):
            if pairs:
                self._move(src, [a for a, _ in pairs], dst, [b for _, b in pairs], 2)
