"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, gated MLP, attention.

Projections are fused (q|k|v in one matmul, gate|up in another) to cut kernel launches and
Python overhead per layer; weight loading splits the checkpoint's separate tensors into them.
Each module has one forward, in vLLM's residual form (a norm adds the previous block's output
into the residual stream before normalizing it), and chooses inside itself between torch ops
(the reference, every device and dtype) and the fused CPU kernels of pagedserve.kernels, as the
model's shared ``KernelState`` says: the kernels for a float32 model with an unquantized KV
cache on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.paged import paged_attention, paged_attention_fused
from pagedserve.config import ModelConfig
from pagedserve.distributed.parallel_state import SINGLE, TPGroup
from pagedserve.kv.cache import LayerKVCache


@dataclass
class KernelState:
    """What every layer of one model reads to choose its ops: ``ops`` (pagedserve.kernels, or
    None for torch), ``act_dtype`` (what the projections take: bfloat16 for int4 layers, else
    float32) and ``fused`` (the kernels run this step: ops and an unquantized KV cache)."""

    ops: Any = None
    act_dtype: torch.dtype = torch.float32
    fused: bool = False


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019) in residual form: ``forward(residual, y)``
    adds ``y`` (the previous block's output, or None) into ``residual`` [T, hidden] in place and
    returns RMSNorm(residual), in ``out_dtype`` with the fused kernel (the layer's act_dtype by
    default), else in residual's dtype."""

    def __init__(self, hidden_size: int, eps: float, kernels: KernelState | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernels = kernels or KernelState()

    def forward(self, residual: torch.Tensor, y: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        k = self.kernels
        if k.fused:
            return k.ops.add_rms_norm(residual, y, self.weight, self.eps,
                                      out_dtype or k.act_dtype)
        if y is not None:
            residual.add_(y)
        return F.rms_norm(residual, self.weight.shape, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32 of rotary embedding (Su et al. 2021),
    with ``rope_scaling`` applied: "linear" (position interpolation, Chen et al. 2023) divides
    them by ``factor``; "llama3" (Llama 3.1 report) divides only the low frequencies and blends
    the band between ``low_freq_factor`` and ``high_freq_factor``; "freq_factors" divides each
    frequency by its own factor (GGUF's ``rope_freqs`` tensor).

    Raises ValueError for another rope type.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(in_band, blended, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with precomputed tables [max_positions, head_dim] in the
    rotate-half layout of transformers' Llama. ``sin`` is stored with its first half negated
    so that rotate_half(x) * sin == x.roll(head_dim // 2) * sin_signed: one op instead of
    three, bit-identical."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions).float(), rope_inv_freq(config))
        self.register_buffer("cos", torch.cat([freqs.cos(), freqs.cos()], -1), persistent=False)
        self.register_buffer("sin", torch.cat([-freqs.sin(), freqs.sin()], -1), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, signed sin), each [T, 1, head_dim] of ``dtype``; looked up
        once per step and shared by every layer."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))


def apply_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by the (cos, signed sin) of RotaryEmbedding."""
    cos, sin = rope
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


PANEL = 48  # output columns per panel of a packed weight (PANEL in kernels/linear.cpp)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / PANEL), K, PANEL], same dtype: the weight as the column panels
    that the ``packed_linear`` kernel streams (the last panel zero-padded)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight.new_zeros(panels * PANEL, k)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def unpack_linear_weight(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_linear_weight: [P, K, PANEL] -> [n, K] (contiguous)."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n].contiguous()


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


def unpack_gated_weight(packed: torch.Tensor, inter: int) -> torch.Tensor:
    """The inverse of pack_gated_weight: -> [2 * inter, K] (contiguous)."""
    panels, k = packed.shape[:2]
    halves = packed.view(panels, k, 2, PANEL // 2).permute(2, 0, 3, 1).reshape(2, -1, k)
    return halves[:, :inter].reshape(2 * inter, k).contiguous()


class PackedLinear(nn.Module):
    """nn.Linear for the CPU kernels: the weight is kept only in the packed layout of
    pack_linear_weight, multiplied by ``ops.packed_linear`` (register-blocked, no per-call
    re-pack of the weight as a BLAS call does). x [..., in_features] float32 ->
    [..., out_features] float32. ``to_linear`` gives the plain module back.

    gated=True (a SwiGLU gate|up projection without bias, ``out_features`` = 2I): the weight
    is packed by pack_gated_weight and forward returns silu(gate) * up, [..., I], from the
    matmul's epilogue."""

    def __init__(self, linear: nn.Linear, ops, gated: bool = False):
        super().__init__()
        if gated and (linear.bias is not None or linear.out_features % 2):
            raise ValueError("a gated PackedLinear needs a gate|up projection without bias")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.gated = gated
        pack = pack_gated_weight if gated else pack_linear_weight
        self.weight = nn.Parameter(pack(linear.weight.detach()), requires_grad=False)
        self.bias = linear.bias
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.out_features // 2 if self.gated else self.out_features
        y = self.ops.packed_linear(x.reshape(-1, self.in_features), self.weight, self.bias, n,
                                   None, self.gated)
        return y.view(*x.shape[:-1], n)

    def to_linear(self) -> nn.Linear:
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device="meta")
        weight = (unpack_gated_weight(self.weight, self.out_features // 2) if self.gated
                  else unpack_linear_weight(self.weight, self.out_features))
        linear.weight = nn.Parameter(weight, requires_grad=False)
        linear.bias = self.bias
        return linear


class GatedMLP(nn.Module):
    """SwiGLU MLP (Shazeer 2020): down(silu(gate(x)) * up(x)), gate|up fused. Under tensor
    parallelism ``intermediate_size`` is this rank's columns and the output is all-reduced."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup = SINGLE,
                 kernels: KernelState | None = None):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.tp = tp
        self.kernels = kernels or KernelState()

    def _gated(self) -> bool:
        return getattr(self.gate_up_proj, "gated", False)  # SwiGLU in the matmul's epilogue

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. With the kernels x and the result are of act_dtype
        (the result float32 under tensor parallelism, for the all-reduce)."""
        k = self.kernels
        if self._gated():
            h = self.gate_up_proj(x)
        elif k.fused:
            h = k.ops.silu_and_mul(self.gate_up_proj(x), k.act_dtype)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            h = F.silu(gate) * up
        out = self.down_proj(h)
        if k.fused and self.tp.world_size > 1:
            out = out.float()
        return self.tp.all_reduce(out)


class Attention(nn.Module):
    """Multi-head attention with GQA/MQA over the paged KV cache; q|k|v fused (with bias for
    Qwen2). Under tensor parallelism ``config`` is this rank's shard (its heads and KV heads)
    and the output is all-reduced."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE,
                 kernels: KernelState | None = None):
        super().__init__()
        self.tp = tp
        self.kernels = kernels or KernelState()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: LayerKVCache, md: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this layer's new K/V into ``kv_cache``. With
        the kernels: rotary + K/V write and decode attention fused, x and the result of
        act_dtype (the result float32 under tensor parallelism)."""
        if self.kernels.fused:
            return self._forward_fused(x, rope, kv_cache, md)
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k are adjacent in the fused output: rotate them in one go
        qk = apply_rotary(qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim), rope)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, md, self.scale)
        return self.tp.all_reduce(self.o_proj(out.reshape(t, self.q_size)))

    def _forward_fused(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       kv_cache: LayerKVCache, md: AttentionMetadata) -> torch.Tensor:
        ops, act_dtype = self.kernels.ops, self.kernels.act_dtype
        qkv = self.qkv_proj(x)
        q = ops.rotary_write_kv(qkv, rope[0], rope[1], kv_cache.k, kv_cache.v, md.slot_mapping,
                                self.num_heads, self.num_kv_heads, torch.float32)
        out = paged_attention_fused(q, kv_cache, md, self.scale, ops, act_dtype)
        out = self.o_proj(out.view(x.shape[0], self.q_size))
        return self.tp.all_reduce(out.float()) if self.tp.world_size > 1 else out
