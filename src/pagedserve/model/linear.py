"""Linear layers, each fixed at construction to one way of holding and multiplying its weight.

Every kind is built with the checkpoint's layout (``weight`` [out, in], what ``load_weights``
copies into) and turns it into the form it multiplies by in ``finish_loading``, called once
after the last tensor is loaded. A model is thus built completely in one place: its
constructor chooses the kinds (``LinearOptions.linear``), loading finishes them.

- ``Linear``: torch's F.linear on the float weight, the reference and what other devices run.
- ``PackedLinear``: float32 weights kept only as the column panels of the CPU kernel
  ``packed_linear`` (register-blocked, no per-call re-pack of the weight as a BLAS call does);
  ``gated=True`` computes SwiGLU in the matmul's epilogue. With ``prefill_dtype`` bfloat16 it
  also keeps a bfloat16 copy of the weight for the rows of prompt tokens (below), packed
  the same way for ``packed_linear_bf16`` where ``packed_bf16`` says so.
- ``Int4Linear`` (model/quant.py): 4-bit groups of 32 with bfloat16 scales and offsets.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.cpu import matrix_unit

PANEL = 48  # output columns per panel of a packed weight (PANEL in kernels/linear.cpp)


def packed_bf16(ops) -> bool:
    """Whether bfloat16 matmuls run the CPU kernel ``packed_linear_bf16`` over a weight
    packed once (pack_bf16_weight) instead of oneDNN over the [out, in] copy: with the kernels
    on a CPU whose bfloat16 unit is AVX512-BF16 (Zen 4, Cooper Lake), where it measured 1.1x
    oneDNN's rate at 512 rows and 2.3x at 16 (docs/performance.md). With AMX, oneDNN's tiles
    keep the matmul."""
    return ops is not None and matrix_unit() == "avx512_bf16"


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


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] (K even) -> bfloat16 [ceil(N / PANEL), K / 2, PANEL, 2]: the column panels of
    ``packed_linear_bf16``, each input pair's two weights side by side for ``vdpbf16ps`` (the
    last panel zero-padded). Raises ValueError for an odd K."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"pack_bf16_weight needs an even number of input features, got {k}")
    panels = -(-n // PANEL)
    padded = weight.new_zeros(panels * PANEL, k, dtype=torch.bfloat16)
    padded[:n] = weight
    return padded.view(panels, PANEL, k // 2, 2).transpose(1, 2).contiguous()


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

    ``state`` (model/layers.py KernelState) with ``prefill_bf16``: the layer also keeps the
    weight in bfloat16 (``weight_bf16`` [out, in]) and multiplies the rows of the step's
    ``state.row_spans`` marked low-precision (the prompt tokens) by it, inputs rounded to
    bfloat16 and products accumulated in float32 by oneDNN on the CPU's matrix units (AMX
    tiles, or AVX-512 BF16's ``vdpbf16ps``; where ``packed_bf16(ops)``, the copy is packed
    in panels, ``packed_bf16_weight`` [P, in / 2, PANEL, 2], and multiplied by the kernel
    ``packed_linear_bf16`` instead, with the same bfloat16 rounding of the result). Prefill is compute-bound and those units nominally
    multiply 2x (AVX-512 BF16; 1.6-1.8x measured on Zen 4) to ~16x (AMX) faster than float32
    FMAs; decode rows are bound by reading
    the weight and keep the float32 panels, so generated tokens are computed exactly as in
    float32 mode. Whether a row is low-precision depends only on its token being a prompt
    token, never on the batch, and a row's product does not depend on the other rows. The
    rounding to bfloat16 would turn any float32 noise between two chunkings of a prompt into
    bfloat16-sized differences; the prefill attention kernel gives each prompt row the same
    bits in every chunking, so none reaches here (docs/performance.md).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, ops,
                 gated: bool = False, state: Any = None):
        if gated and (bias or out_features % 2):
            raise ValueError("a gated PackedLinear needs a gate|up projection without bias")
        super().__init__(in_features, out_features, bias)
        self.ops, self.gated, self.state = ops, gated, state
        self.register_buffer("weight_bf16", None, persistent=False)
        self.register_buffer("packed_bf16_weight", None, persistent=False)

    def finish_loading(self) -> None:
        if self.state is not None and self.state.prefill_bf16:
            if packed_bf16(self.ops):
                self.packed_bf16_weight = pack_bf16_weight(self.weight.detach())
            else:
                self.weight_bf16 = self.weight.detach().to(torch.bfloat16)
        pack = pack_gated_weight if self.gated else pack_linear_weight
        self.weight = nn.Parameter(pack(self.weight.detach()), requires_grad=False)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        n = self.out_features // 2 if self.gated else self.out_features
        return self.ops.packed_linear(x, self.weight, self.bias, n, None, self.gated)

    def _bf16(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_bf16_weight is not None:
            y = self.ops.packed_linear_bf16(x.to(torch.bfloat16), self.packed_bf16_weight,
                                            self.out_features, torch.bfloat16)
        else:
            y = F.linear(x.to(torch.bfloat16), self.weight_bf16)
        if self.gated:  # SwiGLU computed in float32, output in the step's act_dtype
            return self.ops.silu_and_mul(y, self.state.act_dtype)
        y = y.float()
        return y if self.bias is None else y.add_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        low = self.weight_bf16 is not None or self.packed_bf16_weight is not None
        spans = self.state.row_spans if low else None
        if not spans:
            y = self._packed(x2)
        elif len(spans) == 1:
            y = self._bf16(x2) if spans[0][2] else self._packed(x2)
        else:
            y = torch.cat([(self._bf16 if low else self._packed)(x2[a:b])
                           for a, b, low in spans])
        return y.view(*x.shape[:-1], y.shape[-1])

    def nbytes(self) -> int:
        """Bytes of the bfloat16 copy (the packed weight is a parameter)."""
        w = self.weight_bf16 if self.packed_bf16_weight is None else self.packed_bf16_weight
        return 0 if w is None else w.numel() * w.element_size()
