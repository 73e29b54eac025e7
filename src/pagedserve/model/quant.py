"""Weight-only 4-bit quantization of the decoder's linear layers (``quantization="int4"``).

Decode is bound by reading the weights: a float32 SmolLM2 streams 540 MB per step. Stored in
4 bits with a bfloat16 scale and offset per group of 32 input channels (the layout of GGUF's
Q4_1), the projections read about 60 MB. Invariants:

- ``w ~= (q - 8) * scale + zero`` with q in 0..15, per output row and group of 32 columns
  (torch's int4 convention). The offset is the group minimum + 8 * scale, so a group's minimum
  and maximum are exact up to the bfloat16 rounding of scale and offset: a model read from a
  Q4_1 GGUF (``d * q + m``, which spans q = 0..15 in every group) is re-packed losslessly but
  for that rounding. Other sources are quantized (error <= scale / 2 per weight).
- Matmul inputs are rounded to bfloat16, and so are the outputs on every path, which then
  come back in the caller's dtype: one result whatever that dtype. The residual stream, norms,
  attention, KV cache and embedding keep the model's dtype.
- With the CPU kernels, the LM head (the largest matrix a decode step reads: 113 MB in
  float32) also gets an 8-bit copy (model/layers.py LMHead): int8 with a float32 scale per
  group of 32 (GGUF's Q8_0, the type of the default model's own token_embd), used for up to
  ``SMALL_ROWS`` rows through the fused CPU kernel ``int8_linear``; a Q8_0 source is
  re-packed exactly. The embedding lookup and larger batches keep the float32 table.
- Up to ``SMALL_ROWS`` rows (decode of a few sequences) read the packed codes: with the CPU
  kernels through ``int4_linear`` (kernels/linear.cpp: activations rounded to int16 per group
  of 32, integer dot products, the group offset times the exact activation sum), else
  through torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``, for out_features
  divisible by 16). Larger batches, other shapes and other devices multiply by a bfloat16
  copy of the same dequantized weights, which is faster there; on a CPU where
  ``model.linear.packed_bf16`` holds, that copy is packed for the kernel
  ``packed_linear_bf16`` and serves from ``PACKED_SMALL_ROWS + 1`` rows (it multiplies 4
  rows faster than the int4 kernel: the codes' unpacking and per-group scaling cost more
  than reading 4x the bytes). A CPU without a bfloat16
  matmul unit (``cpu.matrix_unit() == "none"``, e.g. AVX2 only) keeps that copy in float32
  instead: its bfloat16 matmuls are emulated and 3-7x slower than float32 ones
  (docs/performance.md). The paths differ by float rounding only, so tokens can depend on the
  batch size, as with any reduced precision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.config import QUANTIZATIONS
from pagedserve.cpu import matrix_unit
from pagedserve.model.linear import Linear, pack_bf16_weight, packed_bf16

GROUP_SIZE = 32
# the measured crossovers of the int4 kernel (docs/performance.md): against bf16 F.linear, and
# against the packed bfloat16 kernel (where model.linear.packed_bf16)
SMALL_ROWS = 12
PACKED_SMALL_ROWS = 3


def check_quantization(method: str) -> None:
    """Raise ValueError unless ``method`` is one of QUANTIZATIONS."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {method!r}; choose None or "
                         f"{', '.join(QUANTIZATIONS)}")


class Int4Linear(Linear):
    """A bias-free linear layer [out, in] held in 4-bit groups (see the module docstring):
    built like Linear, quantized by ``finish_loading``, which then drops the float weight.

    x [..., in] of any float dtype -> [..., out] of x's dtype.
    Raises ValueError when ``in`` is not a multiple of GROUP_SIZE or a bias is asked for.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dense_dtype: torch.dtype | None = None, ops=None):
        """``dense_dtype``: the dequantized copy's dtype (default: bfloat16, or float32 on a
        CPU without a bfloat16 matmul unit when the weights are on the CPU). ``ops``: the CPU
        kernels (pagedserve.kernels), whose ``int4_linear`` then serves the few-row path."""
        if bias:
            raise ValueError("quantization='int4' does not support linear layers with a bias")
        if in_features % GROUP_SIZE:
            raise ValueError(f"int4 quantization needs in_features divisible by {GROUP_SIZE}, "
                             f"got a [{out_features}, {in_features}] weight")
        super().__init__(in_features, out_features)
        self.register_buffer("dense", None, persistent=False)
        self.register_buffer("dense_packed", None, persistent=False)  # pack_bf16_weight(dense)
        self.packed = self.scales_and_zeros = None
        self.codes = self.scale_zero = None  # the CPU kernel's form (see finish_loading)
        self.dense_dtype = dense_dtype
        self.ops = ops

    @classmethod
    def from_weight(cls, weight: torch.Tensor, dense_dtype: torch.dtype | None = None,
                    ops=None) -> Int4Linear:
        """An Int4Linear holding ``weight`` [out, in] quantized."""
        layer = cls(weight.shape[1], weight.shape[0], dense_dtype=dense_dtype,
                    ops=ops).to(weight.device)
        layer.weight.data = weight.detach().float()
        layer.finish_loading()
        return layer

    def finish_loading(self) -> None:
        n, k = self.out_features, self.in_features
        w = self.weight.detach().float().view(n, k // GROUP_SIZE, GROUP_SIZE)
        lo, hi = w.amin(-1), w.amax(-1)
        scale = (hi - lo) / 15
        q = ((w - lo[..., None]) / torch.where(scale == 0, 1.0, scale)[..., None])
        q = q.round_().clamp_(0, 15).to(torch.int32).view(n, k)
        # [k / group, n, 2] = (scale, zero) in bfloat16, the layout torch's kernel takes
        sz = torch.stack([scale.t(), (lo + 8 * scale).t()], -1).to(torch.bfloat16).contiguous()
        s, z = (sz[..., i].float().t().repeat_interleave(GROUP_SIZE, 1) for i in (0, 1))
        dtype = self.dense_dtype
        if dtype is None:
            dtype = torch.float32 if w.device.type == "cpu" and matrix_unit() == "none" \
                else torch.bfloat16
        # bfloat16 values either way: float32 only holds them for float32 matmuls
        dense = ((q - 8) * s + z).to(torch.bfloat16).to(dtype)
        if dtype == torch.bfloat16 and w.device.type == "cpu" and packed_bf16(self.ops):
            self.dense_packed = pack_bf16_weight(dense)
        else:
            self.dense = dense
        if w.device.type == "cpu" and self.ops is not None:
            # int4_linear's form: per group of 32, channel i in byte i's low nibble and
            # 16 + i in its high one; (scale, zero) per row and group
            g = q.view(n, k // GROUP_SIZE, 2, GROUP_SIZE // 2)
            self.codes = (g[:, :, 0] | (g[:, :, 1] << 4)).to(torch.uint8).view(n, k // 2)
            self.scale_zero = sz.transpose(0, 1).contiguous()
        elif w.device.type == "cpu" and n % 16 == 0:  # torch's layout needs n % 16 == 0
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            self.scales_and_zeros = sz
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        small = SMALL_ROWS if self.dense_packed is None else PACKED_SMALL_ROWS
        if rows <= small and self.codes is not None:
            # bfloat16 in and out: the engine's [T, in] bfloat16 activations go as they are
            # (at one row a step, each avoided view or conversion is a measurable share);
            # [batch, 1, in] (HF's decode) and float32 callers are reshaped and converted
            if x.dim() == 2 and x.dtype == torch.bfloat16:
                return self.ops.int4_linear(x, self.codes, self.scale_zero)
            flat = x.reshape(rows, self.in_features).bfloat16()
            y = self.ops.int4_linear(flat, self.codes, self.scale_zero)
            return y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        xb = x.to(torch.bfloat16)
        if self.dense_packed is not None:
            y = self.ops.packed_linear_bf16(xb.reshape(rows, self.in_features),
                                            self.dense_packed, self.out_features,
                                            torch.bfloat16).view(*x.shape[:-1], self.out_features)
        elif rows <= SMALL_ROWS and self.packed is not None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                xb.reshape(rows, self.in_features), self.packed, GROUP_SIZE,
                self.scales_and_zeros).view(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(xb.to(self.dense.dtype), self.dense)
        # rounded to bfloat16 on every path (torch's kernel returns it): a layer's result is
        # then the same whatever the caller's dtype (the engine's bfloat16 activations, a
        # float32 reference model)
        return y.bfloat16().to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight as the copy holds it: [out, in] float32, bfloat16 values."""
        if self.dense is not None:
            return self.dense.float()
        p = self.dense_packed  # [P, in / 2, PANEL, 2] (pack_bf16_weight)
        return p.transpose(1, 2).reshape(-1, self.in_features)[:self.out_features].float()

    def nbytes(self) -> int:
        """Bytes held: the packed weights, scales and offsets, and the dequantized copy."""
        return sum(t.numel() * t.element_size()
                   for t in (self.packed, self.scales_and_zeros, self.codes, self.scale_zero,
                             self.dense, self.dense_packed) if t is not None)


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], float32 scales [N, K / 32]) with weight ~= q * scale per
    group of 32 (GGUF's Q8_0 rule: scale = max |w| / 127). Exact for weights that came from a
    Q8_0 file (each group is then an fp16 scale times integers reaching +-127), else within
    half a step. Raises ValueError when K is not a multiple of 32."""
    n, k = weight.shape
    if k % GROUP_SIZE:
        raise ValueError(f"8-bit groups need K divisible by {GROUP_SIZE}, got [{n}, {k}]")
    w = weight.detach().float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    scale = w.abs().amax(-1) / 127
    q = (w / torch.where(scale == 0, 1.0, scale)[..., None]).round_().clamp_(-127, 127)
    return q.to(torch.int8).view(n, k), scale.contiguous()
