"""KV-cache arithmetic, torch-free: the bytes one token costs and how many blocks fit. The
engine sizes its cache with these, and ``pagedserve plan`` imports them, so both agree.

    kv_bytes_per_token = 2 * num_layers * num_kv_heads * (head_dim * dtype_bytes + scale_bytes)
    num_blocks         = kv_budget // (kv_bytes_per_token * block_size)

Source: the PagedAttention paper (Kwon et al., SOSP 2023, section 3) for the KV cost.
"""

from __future__ import annotations

import math

from pagedserve.config import DTYPES

# An 8-bit KV cache also stores one bfloat16 scale per token and KV head, for K and for V
# (pagedserve.kv.quant); full-precision caches store none.
KV_SCALE_BYTES = 2


def kv_heads_per_worker(num_kv_heads: int, tensor_parallel_size: int = 1) -> int:
    """KV heads one tensor-parallel worker holds: its share, or one replicated head when
    there are fewer KV heads than workers (as vLLM does)."""
    return max(1, math.ceil(num_kv_heads / tensor_parallel_size))


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype_bytes: float, scale_bytes: int = 0) -> int:
    """``2 (K and V) * num_layers * num_kv_heads * (head_dim * dtype_bytes + scale_bytes)``,
    in bytes; ``scale_bytes`` per token and KV head for an 8-bit cache's scales."""
    return int(2 * num_layers * num_kv_heads * (head_dim * dtype_bytes + scale_bytes))


def kv_scale_bytes(kv_dtype: str) -> int:
    """Scale bytes per token and KV head that a KV cache of ``kv_dtype`` stores."""
    return KV_SCALE_BYTES if DTYPES.get(kv_dtype, ("",))[0] in ("fp8", "int8") else 0


def num_blocks(kv_budget_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """Whole blocks of ``block_size`` tokens that fit in ``kv_budget_bytes`` (the engine's
    own sizing rule)."""
    return max(0, int(kv_budget_bytes) // (bytes_per_token * block_size))
