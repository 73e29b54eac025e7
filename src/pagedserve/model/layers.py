"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, gated MLP, attention.

Projections are fused (q|k|v in one matmul, gate|up in another) to cut kernel launches and
Python overhead per layer; weight loading splits the checkpoint's separate tensors into them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.paged import paged_attention
from pagedserve.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in float32 as transformers does.
    x [..., hidden] -> same shape and dtype."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


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
    """Rotary position embedding with a precomputed cos/sin table [max_positions, head_dim]
    (the rotate-half layout of transformers' Llama)."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions).float(), rope_inv_freq(config))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, H, D], k [T, H_kv, D] -> rotated q, k."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class GatedMLP(nn.Module):
    """SwiGLU MLP (Shazeer 2020): down(silu(gate(x)) * up(x)), gate|up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Attention(nn.Module):
    """Multi-head attention with GQA/MQA over the paged KV cache; q|k|v fused (with bias for
    Qwen2)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding,
                kv_cache: tuple[torch.Tensor, torch.Tensor], md: AttentionMetadata
                ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this layer's new K/V into ``kv_cache``."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = rotary(positions, q.view(t, self.num_heads, self.head_dim),
                      k.view(t, self.num_kv_heads, self.head_dim))
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], md, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))
