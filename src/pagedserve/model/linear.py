"""Linear layers, each fixed at construction to one way of holding and multiplying its weight.

Every kind is built with the checkpoint's layout (``weight`` [out, in], what ``load_weights``
copies into) and turns it into the form it multiplies by in ``finish_loading``, called once
after the last tensor is loaded. A model is thus built completely in one place: its
constructor chooses the kinds (``LinearOptions.linear``), loading finishes them.

- ``Linear``: torch's F.linear on the float weight, the reference and what other devices run.
- ``PackedLinear``: float32 weights kept only as the column panels of the CPU kernel
  ``packed_linear`` (register-blocked, no per-call re-pack of the weight as a BLAS call does);
  ``gated=True`` computes SwiGLU in the matmul's epilogue.
- ``Int4Linear`` (model/quant.py): 4-bit groups of 32 with bfloat16 scales and offsets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PANEL = 48  # output columns per panel of a packed weight (PANEL in kernels/linear.cpp)


class Linear(nn.Module):
    """y = x W^T (+ b) by torch: x [..., in] -> [..., out], W [out, in] and b [out] in the
    model's dtype. The base of the other kinds: they share its constructor (the checkpoint
    layout) and override ``finish_loading`` and ``forward``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False)
                     if bias else None)

    def finish_loading(self) -> None:
        """Turn the loaded checkpoint weight into the form ``forward`` multiplies by."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / PANEL), K, PANEL], same dtype: the weight as the column panels
    that the ``packed_linear`` kernel streams (the last panel zero-padded)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight.new_zeros(panels * PANEL, k)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def pack_gated_weight(weight: torch.Tensor) -> torch.Tensor:
    """A SwiGLU gate|up weight [2I, K] (gate rows first) -> [ceil(I / H), K, PANEL] with
    H = PANEL // 2: each panel holds H gate columns then the H matching up columns (zero-padded
    at the end), the layout of ``packed_linear(..., gated=True)``."""
    inter, k = weight.shape[0] // 2, weight.shape[1]
    half = PANEL // 2
    panels = -(-inter // half)
    padded = weight.new_zeros(2, panels * half, k)
    padded[0, :inter], padded[1, :inter] = weight[:inter], weight[inter:]
    return padded.view(2, panels, half, k).permute(1, 3, 0, 2).reshape(panels, k, PANEL).contiguous()


class PackedLinear(Linear):
    """A float32 Linear multiplied by the CPU kernel ``ops.packed_linear``; after loading the
    weight is kept only packed (pack_linear_weight). x [..., in] float32 -> [..., out] float32.

    gated=True (a SwiGLU gate|up projection without bias, ``out_features`` = 2I): the weight
    is packed by pack_gated_weight and forward returns silu(gate) * up, [..., I], from the
    matmul's epilogue. Raises ValueError for a gated projection with a bias or an odd width.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, ops,
                 gated: bool = False):
        if gated and (bias or out_features % 2):
            raise ValueError("a gated PackedLinear needs a gate|up projection without bias")
        super().__init__(in_features, out_features, bias)
        self.ops, self.gated = ops, gated

    def finish_loading(self) -> None:
        pack = pack_gated_weight if self.gated else pack_linear_weight
        self.weight = nn.Parameter(pack(self.weight.detach()), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.out_features // 2 if self.gated else self.out_features
        y = self.ops.packed_linear(x.reshape(-1, self.in_features), self.weight, self.bias, n,
                                   None, self.gated)
        return y.view(*x.shape[:-1], n)
