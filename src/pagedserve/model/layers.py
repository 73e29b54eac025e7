"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, gated MLP, attention.

Projections are fused (q|k|v in one matmul, gate|up in another) to cut kernel launches and
Python overhead per layer; weight loading splits the checkpoint's separate tensors into them.
Each module has one forward, in vLLM's residual form (a norm adds the previous block's output
into the residual stream before normalizing it), and chooses inside itself between torch ops
(the reference, every device and dtype) and the fused CPU kernels of pagedserve.kernels, as the
model's shared ``KernelState`` says: the kernels for a float32 model with an unquantized KV
cache on the CPU. ``LinearOptions`` chooses every projection's kind (model/linear.py: torch,
packed for the kernels, int4) and the LM head's forms when the model is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.paged import (
    paged_attention,
    paged_attention_fused,
    rotary_write_kv_quantized,
)
from pagedserve.config import ModelConfig
from pagedserve.distributed.parallel_state import SINGLE, TPGroup
from pagedserve.kv.cache import LayerKVCache
from pagedserve.model import quant
from pagedserve.model.linear import (
    PANEL,
    Linear,
    PackedLinear,
    pack_bf16_weight,
    pack_linear_weight,
    packed_bf16,
)
from pagedserve.model.quant import Int4Linear, check_quantization, quantize_q8_0

HEAD_Q8_ROWS = 4  # int8_linear against packed_linear_bf16 for the LM head (measured crossover)


@dataclass
class KernelState:
    """What every layer of one model reads to choose its ops: ``ops`` (pagedserve.kernels, or
    None for torch), ``act_dtype`` (what the projections take: bfloat16 for int4 layers, else
    float32; per step bfloat16 too when prefill_bf16 and every row is a prompt token's: the
    projections round their inputs to bfloat16 then anyway, so the norms, attention and SwiGLU
    emit it instead of a float32 copy), ``prefill_bf16`` (packed projections multiply prompt
    tokens in bfloat16: see PackedLinear), and per step ``fused`` (the kernels run this step)
    and ``row_spans``: the step's rows as consecutive spans (start, end, is_prompt) covering
    them all, or empty when prefill_bf16 is off (AttentionMetadata.row_spans)."""

    ops: Any = None
    act_dtype: torch.dtype = torch.float32
    prefill_bf16: bool = False
    fused: bool = False
    row_spans: list[tuple[int, int, bool]] = field(default_factory=list)
    weights_act_dtype: torch.dtype = torch.float32  # act_dtype outside all-prompt steps

    def start_step(self, fused: bool, row_spans: list[tuple[int, int, bool]]) -> None:
        """Set the per-step fields (above) for a step of ``row_spans``."""
        self.fused, self.row_spans = fused, row_spans
        all_prompt = self.prefill_bf16 and len(row_spans) == 1 and row_spans[0][2]
        self.act_dtype = torch.bfloat16 if all_prompt else self.weights_act_dtype


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


@dataclass(frozen=True)
class LinearOptions:
    """How a model's linear layers hold and multiply their weights, fixed when it is built.

    ``ops``: the CPU kernels (pagedserve.kernels) for a float32 model on the CPU, else None
    (torch). ``pack``: with ``ops``, keep float32 weights only packed for ``packed_linear``
    (False: torch's matmuls beside the other kernels, for comparisons). ``quantization``:
    None or "int4" (Int4Linear projections; raises ValueError for another name).
    ``prefill_bf16``: packed projections multiply prompt tokens in bfloat16 (PackedLinear).
    ``state``: the one KernelState the model and all its layers share.
    """

    ops: Any = None
    pack: bool = True
    quantization: str | None = None
    prefill_bf16: bool = False
    state: KernelState = field(init=False, compare=False)

    def __post_init__(self):
        if self.quantization is not None:
            check_quantization(self.quantization)
        bf16 = self.prefill_bf16 and self.ops is not None and self.pack and not self.quantization
        act = torch.bfloat16 if self.quantization else torch.float32
        object.__setattr__(self, "state", KernelState(self.ops, act, bf16,
                                                      weights_act_dtype=act))

    def linear(self, in_features: int, out_features: int, bias: bool = False,
               gated: bool = False) -> Linear:
        """A projection of the chosen kind; ``gated`` marks a SwiGLU gate|up projection
        (its SwiGLU then runs in the packed kernel's epilogue)."""
        if self.quantization is not None:
            return Int4Linear(in_features, out_features, bias, ops=self.ops)
        if self.ops is not None and self.pack:
            return PackedLinear(in_features, out_features, bias, self.ops, gated, self.state)
        return Linear(in_features, out_features, bias)

    def kernel_state(self) -> KernelState:
        """The state a model's layers share: projections take bfloat16 under int4."""
        return self.state


class LMHead(nn.Module):
    """The LM head over this rank's vocabulary rows: hidden [N, H] -> logits [N, rows]
    float32. Its forms are fixed at construction from LinearOptions:

    - torch's F.linear over the float weight;
    - with the kernels and ``pack``: ``ops.packed_linear`` over the packed weight, the float
      copy dropped (a tied embedding then looks its rows up in the packed one: ``rows``);
    - with the kernels and int4 layers, also an int8 copy (GGUF's Q8_0 layout,
      quant.quantize_q8_0) for up to quant.SMALL_ROWS rows: a decode step of a few sequences
      reads a quarter of the bytes. Where ``linear.packed_bf16`` holds, a bfloat16 copy in
      the panels of ``packed_linear_bf16`` takes over from ``HEAD_Q8_ROWS + 1`` rows
      (int8_linear's per-group work grows with the rows; the bfloat16 kernel reads half the
      float32 bytes: docs/performance.md).

    ``weight`` [rows, H] is its own (loaded as ``lm_head.weight``) or, when ``tied``, None:
    the embedding's is given to ``finish_loading``.
    """

    def __init__(self, rows: int, hidden: int, tied: bool, options: LinearOptions):
        super().__init__()
        self.num_rows = rows
        self.weight = None if tied else nn.Parameter(torch.empty(rows, hidden),
                                                     requires_grad=False)
        self.ops = options.ops
        self.pack = options.ops is not None and options.pack
        self.with_q8 = options.ops is not None and options.quantization is not None
        self.packed: torch.Tensor | None = None  # [rows / PANEL, H, PANEL]
        self.q8: tuple[torch.Tensor, torch.Tensor] | None = None  # int8 [rows, H], scales
        self.packed_bf16: torch.Tensor | None = None  # [rows / PANEL, H / 2, PANEL, 2]
        self.float_weight: torch.Tensor | None = None
        self._buffer: torch.Tensor | None = None  # forward(reuse=True)

    def finish_loading(self, embedding: nn.Embedding) -> None:
        """Build the forms from the loaded weight (``embedding``'s when tied)."""
        owner = embedding if self.weight is None else self
        weight = owner.weight.detach()
        if self.with_q8:
            self.q8 = quantize_q8_0(weight)
            if packed_bf16(self.ops):
                self.packed_bf16 = pack_bf16_weight(weight)
        if self.pack:
            self.packed = pack_linear_weight(weight)
            # the packed copy serves the head and, when tied, the lookup: drop the float one
            owner.weight = nn.Parameter(weight.new_empty(0, weight.shape[1]), requires_grad=False)
        else:
            self.float_weight = weight

    def forward(self, hidden: torch.Tensor, reuse: bool = False) -> torch.Tensor:
        """``reuse``: the packed head may write into a buffer it keeps (a fresh [256, 49152]
        tensor costs page faults every step); the result is then valid only until the next
        call with ``reuse``."""
        rows = hidden.shape[0]
        q8_rows = quant.SMALL_ROWS if self.packed_bf16 is None else HEAD_Q8_ROWS
        if self.q8 is not None and rows <= q8_rows:
            return self.ops.int8_linear(hidden.float(), *self.q8)
        if self.packed is None and self.packed_bf16 is None:
            return F.linear(hidden, self.float_weight).float()
        buffer = None
        if reuse:
            size = rows * self.num_rows
            if self._buffer is None or self._buffer.numel() < size:
                self._buffer = hidden.new_empty(size, dtype=torch.float32)
            buffer = self._buffer
        if self.packed_bf16 is not None:  # built only beside q8, which took the few rows
            return self.ops.packed_linear_bf16(hidden.bfloat16(), self.packed_bf16,
                                               self.num_rows, torch.float32, buffer)
        return self.ops.packed_linear(hidden.float(), self.packed, None, self.num_rows, buffer)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows [T, H] of the packed weight for ids [T] (the tied embedding's lookup), with
        nn.Embedding's bounds check (the padded panel would read zeros, -1 would wrap).
        Raises IndexError for an id outside [0, rows)."""
        low, high = torch.aminmax(ids) if ids.numel() else (0, 0)
        if not 0 <= int(low) <= int(high) < self.num_rows:
            raise IndexError(f"token id out of range [0, {self.num_rows})")
        return self.packed[ids // PANEL, :, ids % PANEL]

    def nbytes(self) -> int:
        """Bytes of the forms built from the weight (the parameters are counted apart)."""
        tensors = [self.packed, self.packed_bf16, *(self.q8 or ())]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class GatedMLP(nn.Module):
    """Gated MLP (Shazeer 2020): down(act(gate(x)) * up(x)), gate|up fused; ``activation``
    "silu" (SwiGLU, Llama) or "gelu_tanh" (GeGLU, Gemma). Under tensor parallelism
    ``intermediate_size`` is this rank's columns and the output is all-reduced."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup = SINGLE,
                 kernels: KernelState | None = None, linear: LinearOptions | None = None,
                 activation: str = "silu"):
        super().__init__()
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported MLP activation {activation!r}")
        linear = linear or LinearOptions()
        self.activation = activation
        # the packed kernel's gated epilogue is SwiGLU
        self.gate_up_proj = linear.linear(hidden_size, 2 * intermediate_size,
                                          gated=activation == "silu")
        self.down_proj = linear.linear(intermediate_size, hidden_size)
        self.tp = tp
        self.kernels = kernels or KernelState()
        # SwiGLU in the packed matmul's epilogue
        self.gated = getattr(self.gate_up_proj, "gated", False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. With the kernels x and the result are of act_dtype
        (the result float32 under tensor parallelism, for the all-reduce)."""
        k = self.kernels
        if self.gated:
            h = self.gate_up_proj(x)
        elif k.fused and self.activation == "silu":
            h = k.ops.silu_and_mul(self.gate_up_proj(x), k.act_dtype)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            act = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
            h = act * up
        out = self.down_proj(h)
        if k.fused and self.tp.world_size > 1:
            out = out.float()
        return self.tp.all_reduce(out)


class Attention(nn.Module):
    """Multi-head attention with GQA/MQA over the paged KV cache; q|k|v fused (with bias for
    Qwen2; per-head q/k RMSNorm before rotary for Qwen3). Under tensor parallelism ``config`` is this rank's shard (its heads and KV heads)
    and the output is all-reduced."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE,
                 kernels: KernelState | None = None, linear: LinearOptions | None = None,
                 window: int | None = None):
        super().__init__()
        self.tp = tp
        self.kernels = kernels or KernelState()
        self.window = window  # a sliding-window layer's window (config.layer_window)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        linear = linear or LinearOptions()
        self.qkv_proj = linear.linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                      bias=config.qkv_bias)
        self.o_proj = linear.linear(self.q_size, config.hidden_size)
        # Qwen 3's per-head norms of q and k (torch: they see [T, heads, head_dim] slices)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _norm_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, (H + 2 KVH) D] with q and k normalized per head (Qwen 3), else as is."""
        if self.q_norm is None:
            return qkv
        t, q_end, k_end = qkv.shape[0], self.q_size, self.q_size + self.kv_size
        q = self.q_norm(qkv[:, :q_end].reshape(t, -1, self.head_dim))
        k = self.k_norm(qkv[:, q_end:k_end].reshape(t, -1, self.head_dim))
        return torch.cat([q.reshape(t, -1), k.reshape(t, -1), qkv[:, k_end:]], 1)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: LayerKVCache, md: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; writes this layer's new K/V into ``kv_cache``. With
        the kernels: rotary + K/V write and decode attention fused, x and the result of
        act_dtype (the result float32 under tensor parallelism)."""
        if self.kernels.fused:
            return self._forward_fused(x, rope, kv_cache, md)
        t = x.shape[0]
        qkv = self._norm_qk(self.qkv_proj(x))
        # q and k are adjacent in the fused output: rotate them in one go
        qk = apply_rotary(qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim), rope)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, md, self.scale, self.window)
        return self.tp.all_reduce(self.o_proj(out.reshape(t, self.q_size)))

    def _forward_fused(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                       kv_cache: LayerKVCache, md: AttentionMetadata) -> torch.Tensor:
        ops, act_dtype = self.kernels.ops, self.kernels.act_dtype
        qkv = self._norm_qk(self.qkv_proj(x))
        if kv_cache.spec.quantized:
            q = rotary_write_kv_quantized(qkv, rope, kv_cache, md, self.num_heads, ops)
        else:
            q = ops.rotary_write_kv(qkv, rope[0], rope[1], kv_cache.k, kv_cache.v,
                                    md.slot_mapping[kv_cache.group],
                                    self.num_heads, self.num_kv_heads, torch.float32)
        out = paged_attention_fused(q, kv_cache, md, self.scale, ops, act_dtype, self.window)
        out = self.o_proj(out.view(x.shape[0], self.q_size))
        return self.tp.all_reduce(out.float()) if self.tp.world_size > 1 else out
