"""KV cache storage dtypes: full precision, or 8 bits (int8 or fp8 e4m3) with scales.

An 8-bit cache stores one byte per element plus one bfloat16 scale per token and KV head
(``scale = absmax(row) / QMAX``, rounded up so no value clips). Tokens are quantized when
their K/V are written into their slots and dequantized when attention gathers them, so a
token's stored bytes depend only on its own K/V: never on its block-mates, the batch or the
chunk it was computed in. That is why the scale is per token rather than per block: a block
is filled one token at a time by decodes, and a per-block scale would have to be fixed before
the block's values are known, or the whole block re-quantized on every write. The scales live
in their own tensor indexed by the same block ids, so prefix-cache reuse, copy-on-write
copies and swap move them with their blocks. Cost: 2 bytes per head_dim bytes (3% for
head_dim 64). Idea: vLLM's fp8 KV cache (per-tensor scales) and KIVI (Liu et al., ICML 2024)
for finer scales.

Error bounds (per element x of a row whose largest magnitude is ``absmax``, dequantized to
float32; a bfloat16 model adds bfloat16's own rounding, 2**-9 relative):
    int8:  |x - x'| <= absmax / 250                  (half a step of absmax / 127)
    fp8:   |x - x'| <= |x| / 16 + absmax / 400_000   (3 mantissa bits; subnormals near 0)
An all-zero row stores zeros and comes back as zeros; nothing is ever NaN or inf for finite
input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.config import KV_CACHE_DTYPES, canonical_dtype
from pagedserve.kv.spec import KV_SCALE_BYTES

SCALE_DTYPE = torch.bfloat16
assert KV_SCALE_BYTES == 2  # the arithmetic counts a bfloat16 scale per token and KV head
FP8 = torch.float8_e4m3fn
QMAX = {"int8": 127.0, "fp8": 448.0}
# Scales are rounded to bfloat16 (relative error <= 2**-8); this margin keeps them >= absmax/QMAX.
_SCALE_MARGIN = 1 + 2**-7
_MIN_SCALE = 1e-30  # an all-zero row: any positive scale stores zeros
_FP8_BF16_MASK = 0x87F0 - 0x10000  # sign bit and bits 4..10, as a signed int16



@dataclass(frozen=True)
class KVCacheSpec:
    """How the cache stores K/V. ``name`` is one of KV_CACHE_DTYPES (resolved, never "auto");
    ``storage_dtype`` is the element dtype of the cache tensors (int8 for int8, uint8 holding
    e4m3 bits for fp8); ``compute_dtype`` is the model's dtype attention reads K/V back in."""

    name: str
    storage_dtype: torch.dtype
    compute_dtype: torch.dtype

    @property
    def quantized(self) -> bool:
        return self.name in QMAX

    @property
    def element_bytes(self) -> int:
        return torch.tensor([], dtype=self.storage_dtype).element_size()

    @property
    def scale_bytes(self) -> int:
        """Bytes of scale per token and KV head (K and V each)."""
        return KV_SCALE_BYTES if self.quantized else 0


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVCacheSpec:
    """``"auto"`` stores K/V in the model's dtype. Raises ValueError for an unknown name."""
    if kv_cache_dtype == "auto":
        name = str(model_dtype).removeprefix("torch.")
    else:
        name = canonical_dtype(kv_cache_dtype, KV_CACHE_DTYPES[1:], "kv_cache_dtype")
    storage = {"int8": torch.int8, "fp8": torch.uint8}.get(name) or getattr(torch, name)
    return KVCacheSpec(name, storage, model_dtype)


def quantize(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] float -> (bytes [..., head_dim] int8 (int8) or uint8 holding e4m3 bits
    (fp8), scales [...] bfloat16), one scale per row."""
    xf = x.float()
    qmax = QMAX[name]
    absmax = xf.abs().amax(dim=-1)
    scale = (absmax * (_SCALE_MARGIN / qmax)).clamp_min(_MIN_SCALE).to(SCALE_DTYPE)
    y = (xf / scale.float().unsqueeze(-1)).clamp_(-qmax, qmax)
    if name == "int8":
        return y.round_().to(torch.int8), scale
    return y.to(FP8).view(torch.uint8), scale


def fp8_to_bfloat16(data: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 bits -> bfloat16 values, exactly. On CPU, torch converts float8 one element
    at a time (about 8x slower than this): the byte, sign-extended to 16 bits and moved up by
    4, then masked to its sign and 7 exponent+mantissa bits, is a bfloat16 of the same
    mantissa and an exponent 120 too small (subnormals included), which a multiply by 2**120
    corrects."""
    if data.device.type != "cpu":
        return data.view(FP8).to(torch.bfloat16)
    v = data.view(torch.int8).to(torch.int16)
    v <<= 4
    v &= _FP8_BF16_MASK
    out = v.view(torch.bfloat16)
    out *= 2.0**120
    return out


def dequantize(data: torch.Tensor, scale: torch.Tensor, name: str,
               out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(bytes [..., head_dim], scales [...]) -> values [..., head_dim] of ``out``'s dtype (or
    ``dtype``), written into ``out`` when given."""
    if out is None:
        out = torch.empty(data.shape, dtype=dtype, device=data.device)
    out.copy_(data if name == "int8" else fp8_to_bfloat16(data))
    out.mul_(scale.unsqueeze(-1))
    return out
