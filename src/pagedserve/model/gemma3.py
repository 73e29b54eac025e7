"""Gemma 3 text decoder (Gemma Team, "Gemma 3 Technical Report", 2025) over the paged KV cache.

What differs from the Llama family, each on top of its pieces in model/llama.py:

- hybrid attention: five of every six layers attend a sliding window of the last
  ``sliding_window`` positions with rope base ``rope_local_theta``; the others attend every
  position with ``rope_theta`` (config.layer_types says which is which);
- per-head RMSNorm of q and k before rotary, scores scaled by ``query_pre_attn_scalar``^-1/2;
- four norms per layer: before and after attention, before and after the MLP; GeGLU MLP;
- RMSNorm scales by (1 + w): the checkpoint's w are stored as 1 + w when loaded, so the
  ordinary RMSNorm (and its CPU kernel) compute Gemma's norm;
- the embedding is scaled by sqrt(hidden_size) (rounded to the model's dtype), the LM head
  tied to it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pagedserve.config import ModelConfig
from pagedserve.distributed.parallel_state import TPGroup
from pagedserve.model.layers import (
    Attention,
    GatedMLP,
    KernelState,
    LinearOptions,
    RMSNorm,
    RotaryEmbedding,
)
from pagedserve.model.llama import LlamaForCausalLM


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, kernels: KernelState,
                 linear: LinearOptions, window: int | None):
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, kernels)
        self.self_attn = Attention(config, tp, kernels, linear, window)
        self.post_attention_layernorm = RMSNorm(hidden, eps, kernels)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, kernels)
        self.mlp = GatedMLP(hidden, config.intermediate_size, tp, kernels, linear, "gelu_tanh")
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, kernels)

    def forward(self, residual, y, rope, kv_cache, md):
        """The residual form of llama.DecoderLayer; the post-norms normalize a block's output
        before it joins the residual stream."""
        h = self.self_attn(self.input_layernorm(residual, y), rope, kv_cache, md)
        h = self.post_attention_layernorm(h.to(residual.dtype), out_dtype=residual.dtype)
        m = self.mlp(self.pre_feedforward_layernorm(residual, h))
        return self.post_feedforward_layernorm(m.to(residual.dtype), out_dtype=residual.dtype)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's decoder stack and tied LM head; the constructor, weight loading and tensor
    parallelism are LlamaForCausalLM's."""

    layer_class = Gemma3DecoderLayer

    def init_rotary(self, max_positions: int) -> None:
        super().init_rotary(max_positions)
        local = dataclasses.replace(self.config, rope_theta=self.config.rope_local_theta,
                                    rope_scaling=None)
        self.rotary_local = RotaryEmbedding(local, max_positions).to(self.rotary.cos.device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        return x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)

    def convert_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        # every norm scales by (1 + w); float32 as transformers computes it
        return tensor.float() + 1 if name.endswith("norm.weight") else tensor

    def expected_names(self) -> list[str]:
        norms = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        return super().expected_names() + [
            f"model.layers.{i}.{n}.weight" for i in range(self.config.num_hidden_layers)
            for n in norms]
