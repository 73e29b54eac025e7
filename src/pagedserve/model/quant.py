"""Weight-only 4-bit quantization of the decoder's linear layers (``quantization="int4"``).

Decode is bound by reading the weights: a float32 SmolLM2 streams 540 MB per step. Stored in
4 bits with a bfloat16 scale and offset per group of 32 input channels (the layout of GGUF's
Q4_1), the projections read about 60 MB. Invariants:

- ``w ~= (q - 8) * scale + zero`` with q in 0..15, per output row and group of 32 columns
  (torch's int4 convention). The offset is the group minimum + 8 * scale, so a group's minimum
  and maximum are exact up to the bfloat16 rounding of scale and offset: a model read from a
  Q4_1 GGUF (``d * q + m``, which spans q = 0..15 in every group) is re-packed losslessly but
  for that rounding. Other sources are quantized (error <= scale / 2 per weight).
- Matmul inputs are rounded to bfloat16 and the outputs come back in the model's dtype; the
  residual stream, norms, attention, KV cache and embedding keep the model's dtype.
- The LM head (the largest matrix a decode step reads: 113 MB in float32) also gets an 8-bit
  copy: int8 with a float32 scale per group of 32 (GGUF's Q8_0, the type of the default model's
  own token_embd), used for up to ``SMALL_ROWS`` rows through the fused CPU kernel
  ``int8_linear``; a Q8_0 source is re-packed exactly. The embedding lookup and larger batches
  keep the float32 table.
- Up to ``SMALL_ROWS`` rows (decode of a few sequences) run torch's CPU int4 kernel
  (``_weight_int4pack_mm_for_cpu``, for out_features divisible by 16), which reads the packed
  weights; larger batches, other shapes and other devices multiply by a bfloat16 copy of the
  same dequantized weights, which is faster there. The two paths differ by float rounding
  only, so tokens can depend on the batch size, as with any reduced precision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.config import QUANTIZATIONS

GROUP_SIZE = 32
SMALL_ROWS = 12  # measured crossover of the int4 kernel against bf16 F.linear (docs/performance.md)


def check_quantization(method: str) -> None:
    """Raise ValueError unless ``method`` is one of QUANTIZATIONS."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {method!r}; choose None or "
                         f"{', '.join(QUANTIZATIONS)}")


class Int4Linear(nn.Module):
    """A bias-free nn.Linear [out, in] replaced by 4-bit groups (see the module docstring).

    x [..., in] of any float dtype -> [..., out] of x's dtype.
    Raises ValueError when ``in`` is not a multiple of GROUP_SIZE.
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        n, k = weight.shape
        if k % GROUP_SIZE:
            raise ValueError(f"int4 quantization needs in_features divisible by {GROUP_SIZE}, "
                             f"got a [{n}, {k}] weight")
        w = weight.detach().float().view(n, k // GROUP_SIZE, GROUP_SIZE)
        lo, hi = w.amin(-1), w.amax(-1)
        scale = (hi - lo) / 15
        q = ((w - lo[..., None]) / torch.where(scale == 0, 1.0, scale)[..., None])
        q = q.round_().clamp_(0, 15).to(torch.int32).view(n, k)
        # [k / group, n, 2] = (scale, zero) in bfloat16, the layout torch's kernel takes
        sz = torch.stack([scale.t(), (lo + 8 * scale).t()], -1).to(torch.bfloat16).contiguous()
        s, z = (sz[..., i].float().t().repeat_interleave(GROUP_SIZE, 1) for i in (0, 1))
        self.register_buffer("dense", ((q - 8) * s + z).to(torch.bfloat16), persistent=False)
        self.packed = self.scales_and_zeros = None
        if weight.device.type == "cpu" and n % 16 == 0:  # the kernel's layout needs n % 16 == 0
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            self.scales_and_zeros = sz
        self.in_features, self.out_features = k, n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if self.packed is not None and xb.dim() == 2 and xb.shape[0] <= SMALL_ROWS:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP_SIZE,
                                                           self.scales_and_zeros)
        else:
            y = F.linear(xb, self.dense)
        return y.to(x.dtype)

    def nbytes(self) -> int:
        """Bytes held: the packed weights, scales and offsets, and the bfloat16 copy."""
        return sum(t.numel() * t.element_size()
                   for t in (self.packed, self.scales_and_zeros, self.dense) if t is not None)


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


def quantize_linear_layers(model: nn.Module, method: str) -> int:
    """Replace every bias-free nn.Linear inside ``model.layers`` (q|k|v, o, gate|up, down) by
    an Int4Linear, in place, and give the model an 8-bit copy of its LM head
    (``model.lm_head_q8``, see quantize_q8_0); the embedding table is left alone. Returns the
    bytes the new tensors hold.

    Raises ValueError for an unknown ``method``, or a layer with a bias (Qwen2's q|k|v).
    """
    check_quantization(method)
    total = 0
    for name, module in list(model.layers.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                if child.bias is not None:
                    raise ValueError(f"quantization={method!r} does not support linear layers "
                                     f"with a bias (layers.{name}.{child_name})")
                new = Int4Linear(child.weight)
                total += new.nbytes()
                setattr(module, child_name, new)
    model.lm_head_q8 = quantize_q8_0(model.lm_head_weight())
    return total + sum(t.numel() * t.element_size() for t in model.lm_head_q8)
