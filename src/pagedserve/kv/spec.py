"""KV-cache arithmetic, torch-free: the bytes one block and one token cost and how many blocks
fit. The engine sizes its cache with these, and ``pagedserve plan`` imports them, so both agree.

    block_bytes        = num_layers * num_kv_heads * (2 * block_size * head_dim * dtype_bytes
                                                      + param_bytes)
    kv_bytes_per_token = block_bytes / block_size
    num_blocks         = kv_budget // block_bytes

``param_bytes`` (per block, layer and KV head) is 0 for a full-precision cache; a quantized one
(kv/quant.py) stores a bfloat16 scale and offset per K channel and a bfloat16 scale per V row:
``4 * head_dim + 2 * block_size``. Source: the PagedAttention paper (Kwon et al., SOSP 2023,
section 3) for the KV cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedserve.config import DTYPES

QUANTIZED_KV = ("int8", "fp8", "int4")  # kv_cache_dtype names that store codes and scales
PARAM_BYTES = 2  # a bfloat16 scale or offset


def kv_heads_per_worker(num_kv_heads: int, tensor_parallel_size: int = 1) -> int:
    """KV heads one tensor-parallel worker holds: its share, or one replicated head when
    there are fewer KV heads than workers (as vLLM does)."""
    return max(1, math.ceil(num_kv_heads / tensor_parallel_size))


def kv_param_bytes(kv_dtype: str, head_dim: int, block_size: int) -> int:
    """Scale and offset bytes per block, layer and KV head of a ``kv_dtype`` cache: K's scale
    and offset per channel, V's scale per token (0 for full precision)."""
    if DTYPES.get(kv_dtype, ("",))[0] not in QUANTIZED_KV:
        return 0
    return PARAM_BYTES * (2 * head_dim + block_size)


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float,
                   block_size: int, param_bytes: int = 0) -> int:
    """Bytes of one block of ``block_size`` tokens over ``num_layers`` layers: K and V of
    ``dtype_bytes`` per element plus ``param_bytes`` (``kv_param_bytes``) per layer and KV
    head."""
    return int(num_layers * num_kv_heads
               * (2 * block_size * head_dim * dtype_bytes + param_bytes))


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float,
                       param_bytes: int = 0, block_size: int = 16) -> int:
    """``kv_block_bytes / block_size``, rounded up to whole bytes (exact whenever
    ``block_size`` divides the parameter bytes, as for every power of two up to
    ``4 * head_dim``)."""
    return -(-kv_block_bytes(num_layers, num_kv_heads, head_dim, dtype_bytes, block_size,
                             param_bytes) // block_size)


def open_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, compute_bytes: int,
                     block_size: int, kv_dtype: str) -> int:
    """Bytes of one sequence's open rows in a quantized cache (kv/quant.py): a block of K
    and V in the model's dtype over every layer; 0 for a full-precision cache."""
    if DTYPES.get(kv_dtype, ("",))[0] not in QUANTIZED_KV:
        return 0
    return 2 * num_layers * num_kv_heads * block_size * head_dim * compute_bytes


def num_blocks(kv_budget_bytes: int, block_bytes: int) -> int:
    """Whole blocks of ``block_bytes`` that fit in ``kv_budget_bytes`` (the engine's own
    sizing rule)."""
    return max(0, int(kv_budget_bytes) // block_bytes)


# ---- KV groups: how layers share blocks (hybrid models) -------------------------------------

NULL_BLOCK = -1  # a block-table entry a sliding-window group no longer holds


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_blocks(window: int | None, num_tokens: int, block_size: int, chunk: int) -> int:
    """Most blocks one KV group holds for a sequence of ``num_tokens`` tokens computed in
    steps of at most ``chunk`` tokens: all of them under full attention; under a window W, a
    step computing n tokens from position c needs positions c - W + 1 .. c + n - 1, which span
    at most ``cdiv(W + n - 1, block_size) + 1`` blocks."""
    full = cdiv(num_tokens, block_size)
    if window is None:
        return full
    return min(full, cdiv(window + min(chunk, num_tokens) - 1, block_size) + 1)


def blocks_per_seq(windows: tuple[int | None, ...], num_tokens: int, block_size: int,
                   chunk: int) -> int:
    """Most blocks one sequence holds at once over KV groups with these ``windows``."""
    return sum(group_blocks(w, num_tokens, block_size, chunk) for w in windows)


@dataclass(frozen=True)
class KVGroupSpec:
    """Layers that share one block table: all full attention (``window`` None) or all sliding
    window ``window`` (each query sees itself and the ``window - 1`` positions before it)."""

    window: int | None
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVLayout:
    """How the layers' K/V are paged. Each physical block holds ``slots`` layers' K/V for
    ``block_size`` tokens, so one pool of equal blocks serves every group; group ``g`` keeps
    its own block table per sequence and its ``i``-th layer lives in slot ``i`` of the blocks
    that table names (vLLM's hybrid KV cache manager; Jenga, SOSP 2025, pages groups of layers
    the same way). A group with fewer layers than ``slots`` leaves the rest of each of its
    blocks unused. A model with one kind of attention has one group of all its layers, which is
    plain PagedAttention."""

    groups: tuple[KVGroupSpec, ...]
    slots: int

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1 or self.groups[0].window is not None

    def describe(self) -> str:
        """For example "3 full-attention + 15 sliding-window (512) layers in 6 KV groups of
        3" (the start-up log and ``pagedserve plan``)."""
        counts: dict[int | None, int] = {}
        for g in self.groups:
            counts[g.window] = counts.get(g.window, 0) + len(g.layers)
        kinds = " + ".join(f"{n} {'full-attention' if w is None else f'sliding-window ({w})'}"
                           for w, n in counts.items())
        return f"{kinds} layers in {len(self.groups)} KV groups of {self.slots}"

    def layer_slot(self, layer: int) -> tuple[int, int]:
        """(group, slot) of ``layer``. Raises ValueError for a layer in no group."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise ValueError(f"layer {layer} is in no KV group")

    def blocks_per_seq(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Most blocks (all groups) one sequence of ``num_tokens`` tokens holds at once."""
        return blocks_per_seq(self.windows, num_tokens, block_size, chunk)

    def max_tokens(self, num_blocks: int, block_size: int, chunk: int) -> int:
        """Longest sequence ``num_blocks`` blocks can hold (0 when not even one token fits)."""
        lo, hi = 0, num_blocks * block_size
        while lo < hi:  # blocks_per_seq grows with the length
            mid = (lo + hi + 1) // 2
            if self.blocks_per_seq(mid, block_size, chunk) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo


def kv_layout(layer_windows: list[int | None], hybrid: bool = True) -> KVLayout:
    """Group layers by their attention window. With ``hybrid`` False, or when every layer has
    the same window, one group holds every layer (its window: the common one, else None: every
    block kept, as full attention needs). Otherwise each kind of layer is cut, in layer order,
    into groups of as many layers as the rarest kind has (vLLM's rule), full attention first."""
    kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
    every = tuple(range(len(layer_windows)))
    if len(kinds) == 1 or not hybrid:
        return KVLayout((KVGroupSpec(kinds[0] if len(kinds) == 1 else None, every),),
                        len(every))
    by_kind = {w: [i for i, lw in enumerate(layer_windows) if lw == w] for w in kinds}
    size = min(len(layers) for layers in by_kind.values())
    groups = tuple(KVGroupSpec(w, tuple(layers[i:i + size]))
                   for w, layers in by_kind.items() for i in range(0, len(layers), size))
    return KVLayout(groups, size)
