"""Quantized KV cache storage: 8 bits (int8, fp8 e4m3) or 4 bits (int4, two per byte).

Each full block is quantized once: K per channel (one scale and one offset per block, KV head
and channel, over the block's ``block_size`` tokens), V per token (one scale per token and KV
head). K per channel because a few of a model's K channels are many times larger than the rest
(SmolLM2 has one about 10x the others): a scale per token spreads one outlier's range over
every channel of the row, while over the tokens of one channel the values stay close. V per
token because attention often puts most of its weight on a few tokens whose values are small
(the first token, an "attention sink"), which a per-channel scale would round coarsely; this
is the split KIVI (Liu et al., ICML 2024, sec. 3) found. Measured on SmolLM2 (int8,
benchmarks/kv_quant.py): the relative error of K falls from 1.1% per token to 0.19% per block
and channel (a bfloat16 cache: 0.16%); V per channel would cut V's error from 0.69% to 0.36%
yet keeps fewer greedy continuations (69% against 78% of 32 chats).

The block is the natural group: a paged cache already treats it as one unit (hashing,
sharing, copy, swap), and its values are all known once it is full. Until a sequence's current
block is full, its K/V rows stay unquantized in the sequence's *open row* of ``kv_open``
(kv/cache.py) and are quantized once into the block when it fills (KIVI's full-precision
residual). A query reads the blocks before its own block quantized and its own block from the
open rows: a rule of positions only, so any chunking of a prompt, a prefix-cache hit, a
preemption or a swap reads the same values.

Codes. K, for the values x of one (block, KV head, channel), lo/hi their least/greatest:

    zero  = bfloat16((lo + hi) / 2);   half = max(hi - zero, zero - lo)
    scale = bfloat16 rounded up from half / QMAX;   code = (x - zero) / scale

V, for one token's row: zero = 0, half = max |x|, the same scale and code. Stored:

    int8  round(code) as int8, |code| <= 127
    fp8   e4m3(code), |code| <= 448 (3 mantissa bits)
    int4  round(code) + 8 as a nibble, |code| <= 7; byte i of a row holds channel 2i in its
          low nibble and channel 2i + 1 in its high one
    value = scale * code + zero

The half range is measured from the rounded offset, so the offset's bfloat16 rounding costs
no accuracy; the scale is rounded up so no value clips. Error bounds per element (dequantized
to float32):

    int8: |x - x'| <= half / 250     int4: |x - x'| <= half / 13.8
    fp8:  |x - x'| <= |x - zero| / 16 + half / 400_000

fp8's error is relative to each value's distance from the offset: its 3 mantissa bits bound
it, and no choice of scale can do better; only K's offset, which removes a channel's common
part, can. Storage per block, layer and KV head (head_dim D, block_size B): codes 2 B D bytes
(int4: B D), plus 4 D bytes of K scales and offsets and 2 B of V scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.config import KV_CACHE_DTYPES, canonical_dtype
from pagedserve.kv.spec import QUANTIZED_KV

PARAM_DTYPE = torch.bfloat16  # scales and offsets
FP8 = torch.float8_e4m3fn
QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}
assert set(QMAX) == set(QUANTIZED_KV)
# Scales are rounded to bfloat16 (relative error <= 2**-8); this margin keeps them >= half/QMAX.
_SCALE_MARGIN = 1 + 2**-7
_MIN_SCALE = 1e-30  # an all-zero group: any positive scale stores its zeros exactly
_FP8_BF16_MASK = 0x87F0 - 0x10000  # sign bit and bits 4..10, as a signed int16


@dataclass(frozen=True)
class KVCacheSpec:
    """How the cache stores K/V. ``name`` is one of KV_CACHE_DTYPES (resolved, never "auto");
    ``storage_dtype`` is the element dtype of the code tensors (int8 for int8, uint8 holding
    e4m3 bits for fp8 or two nibbles for int4); ``compute_dtype`` is the model's dtype, which
    attention reads K/V back in and the open rows are held in."""

    name: str
    storage_dtype: torch.dtype
    compute_dtype: torch.dtype

    @property
    def quantized(self) -> bool:
        return self.name in QMAX

    @property
    def packed(self) -> bool:
        """Two codes per byte (int4)."""
        return self.name == "int4"

    def code_dim(self, head_dim: int) -> int:
        """Bytes (elements) of one stored row of ``head_dim`` values."""
        return head_dim // 2 if self.packed else head_dim


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVCacheSpec:
    """``"auto"`` stores K/V in the model's dtype. Raises ValueError for an unknown name."""
    if kv_cache_dtype == "auto":
        name = str(model_dtype).removeprefix("torch.")
    else:
        name = canonical_dtype(kv_cache_dtype, KV_CACHE_DTYPES[1:], "kv_cache_dtype")
    storage = {"int8": torch.int8, "fp8": torch.uint8, "int4": torch.uint8}.get(name) \
        or getattr(torch, name)
    return KVCacheSpec(name, storage, model_dtype)


def _round_up_scale(half: torch.Tensor, qmax: float) -> torch.Tensor:
    return (half * (_SCALE_MARGIN / qmax)).clamp_min(_MIN_SCALE).to(PARAM_DTYPE)


def _encode(code: torch.Tensor, name: str) -> torch.Tensor:
    """float codes (already within +-QMAX) -> stored bytes, last dim halved for int4."""
    if name == "int8":
        return code.round_().to(torch.int8)
    if name == "fp8":
        return code.to(FP8).view(torch.uint8)
    u = (code.round_() + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def quantize_blocks(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
    """Full blocks of keys x [blocks, block_size, kv_heads, head_dim] float -> (codes of the
    same shape, last dim halved for int4; scales [blocks, kv_heads, head_dim] bfloat16;
    offsets of the same shape), one scale and offset per block, KV head and channel. A
    block's codes depend on its own values only."""
    xf = x.float()
    qmax = QMAX[name]
    lo, hi = xf.amin(dim=1), xf.amax(dim=1)
    zero = ((lo + hi) * 0.5).to(PARAM_DTYPE)
    zf = zero.float()
    scale = _round_up_scale(torch.maximum(hi - zf, zf - lo), qmax)
    code = ((xf - zf[:, None]) / scale.float()[:, None]).clamp_(-qmax, qmax)
    return _encode(code, name), scale, zero


def quantize_rows(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Values x [..., head_dim] float -> (codes [..., head_dim], last dim halved for int4;
    scales [...] bfloat16), one scale per row (a token's V of one KV head)."""
    xf = x.float()
    qmax = QMAX[name]
    scale = _round_up_scale(xf.abs().amax(dim=-1), qmax)
    code = (xf / scale.float().unsqueeze(-1)).clamp_(-qmax, qmax)
    return _encode(code, name), scale


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


def decode_codes(data: torch.Tensor, name: str) -> torch.Tensor:
    """Stored bytes [..., code_dim] -> codes [..., head_dim] (exact; bfloat16 holds every
    int8, e4m3 and int4 code)."""
    if name == "int8":
        return data
    if name == "fp8":
        return fp8_to_bfloat16(data)
    lo = (data & 15).to(torch.int8) - 8
    hi = (data >> 4).to(torch.int8) - 8
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def dequantize_blocks(data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, name: str,
                      out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
                      ) -> torch.Tensor:
    """Keys: (codes [blocks, block_size, kv_heads, code_dim], scales and offsets [blocks,
    kv_heads, head_dim]) -> [blocks, block_size, kv_heads, head_dim] of ``out``'s dtype (or
    ``dtype``), written into ``out`` when given."""
    shape = (*data.shape[:-1], scale.shape[-1])
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=data.device)
    out.copy_(decode_codes(data, name))
    out.mul_(scale[:, None]).add_(zero[:, None])
    return out


def dequantize_rows(data: torch.Tensor, scale: torch.Tensor, name: str,
                    out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
                    ) -> torch.Tensor:
    """Values: (codes [..., code_dim], scales [...]) -> [..., head_dim] of ``out``'s dtype (or
    ``dtype``), written into ``out`` when given."""
    codes = decode_codes(data, name)
    if out is None:
        out = torch.empty(codes.shape, dtype=dtype, device=data.device)
    out.copy_(codes)
    out.mul_(scale.unsqueeze(-1))
    return out
