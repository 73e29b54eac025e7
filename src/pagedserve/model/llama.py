"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2) over a paged KV cache.

Input is a flat batch: ``input_ids`` and ``positions`` [num_tokens] of all scheduled requests,
with their attention described by one AttentionMetadata. Weights are loaded from transformers'
tensor names (``model.layers.N.self_attn.q_proj.weight`` ...), whatever the file format.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.config import ModelConfig
from pagedserve.distributed.parallel_state import SINGLE, TPGroup, local_config, shard_weight
from pagedserve.kv.cache import LayerKVCache
from pagedserve.kv.quant import KVCacheSpec
from pagedserve.model.layers import (
    Attention,
    GatedMLP,
    KernelState,
    LinearOptions,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
)
from pagedserve.model.linear import Linear


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, kernels: KernelState,
                 linear: LinearOptions, window: int | None):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, kernels)
        self.self_attn = Attention(config, tp, kernels, linear, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, kernels)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, tp, kernels, linear)

    def forward(self, residual, y, rope, kv_cache, md):
        """vLLM's residual form: ``residual`` [T, hidden] gets ``y`` (the previous layer's
        output, or None) added in place; returns this layer's output, not yet added."""
        h = self.self_attn(self.input_layernorm(residual, y), rope, kv_cache, md)
        return self.mlp(self.post_attention_layernorm(residual, h))


class LlamaForCausalLM(nn.Module):
    layer_class = DecoderLayer

    """Decoder stack plus LM head (tied to the embedding when the config says so).

    ``config`` is the whole model's; under tensor parallelism (``tp``, see
    pagedserve.distributed.parallel_state) the layers hold this rank's heads and MLP columns,
    and the embedding and LM head this rank's vocabulary slice. ``linear`` fixes how every
    projection and the LM head hold their weights and whether the fused CPU kernels run
    (model/layers.py LinearOptions); ``load_weights`` fills and finishes them. ``rotary`` is
    set by the owner once max_model_len is known (its cos/sin table covers it).
    """

    layer_class = DecoderLayer

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE,
                 linear: LinearOptions | None = None):
        super().__init__()
        linear = linear or LinearOptions()
        self.config = config
        self.tp = tp
        local = local_config(config, tp)
        self.vocab_start, vocab_rows = tp.vocab_shard(config.vocab_size)
        self.vocab_rows = vocab_rows
        self.embed_tokens = nn.Embedding(vocab_rows, config.hidden_size)
        self.kernels = linear.kernel_state()  # one state every layer reads
        self.layers = nn.ModuleList(self.layer_class(local, tp, self.kernels, linear,
                                                     config.layer_window(i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.kernels)
        self.lm_head = LMHead(vocab_rows, config.hidden_size, config.tie_word_embeddings, linear)
        self.rotary: RotaryEmbedding | None = None  # init_rotary
        self.rotary_local: RotaryEmbedding | None = None  # sliding-window layers' own, if any

    def init_rotary(self, max_positions: int) -> None:
        """Build the rotary tables for positions below ``max_positions`` (once max_model_len
        is known)."""
        device = self.embed_tokens.weight.device
        self.rotary = RotaryEmbedding(self.config, max_positions).to(device)

    def set_tp(self, tp: TPGroup) -> None:
        """Point every layer at ``tp`` (the same ranks; e.g. with its NCCL group added)."""
        for module in self.modules():
            if hasattr(module, "tp"):
                module.tp = tp

    @property
    def ops(self):
        """The CPU kernels the model uses (pagedserve.kernels), or None."""
        return self.kernels.ops

    def weight_bytes(self) -> int:
        """Bytes the weights hold in every form kept (parameters, int4 groups, packed and
        8-bit LM heads)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        return total + sum(m.nbytes() for m in self.modules() if hasattr(m, "nbytes"))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, hidden]; a vocabulary-parallel lookup summed over the ranks."""
        if self.tp.world_size == 1:
            return self._embedding_rows(input_ids)
        ids = input_ids - self.vocab_start
        inside = (ids >= 0) & (ids < self.vocab_rows)
        x = self._embedding_rows(torch.where(inside, ids, 0)) * inside[:, None]
        return self.tp.all_reduce(x)

    def _embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.lm_head.packed is not None and self.config.tie_word_embeddings:
            return self.lm_head.rows(ids)
        return self.embed_tokens(ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[LayerKVCache], md: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden]."""
        x = self.embed(input_ids)
        rope = self.rotary(positions, x.dtype)
        local = rope if self.rotary_local is None else self.rotary_local(positions, x.dtype)
        self.kernels.start_step(self.fused_kernels(kv_caches[0].spec), md.row_spans)
        y = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            y = layer(x, y, rope if layer.self_attn.window is None else local, kv_cache, md)
        return self.norm(x, y, out_dtype=torch.float32)

    def fused_kernels(self, kv: KVCacheSpec) -> bool:
        """Whether the fused CPU kernels run the layers over a KV cache stored as ``kv``: with
        ops, for a float32 or bfloat16 cache, or a quantized one whose head_dim is a multiple of
        16 (what its kernels decode at a time); a float16 cache takes the torch path."""
        if self.ops is None:
            return False
        if kv.quantized:
            return self.config.head_dim % 16 == 0
        return kv.storage_dtype in (torch.float32, torch.bfloat16)

    def compute_logits(self, hidden: torch.Tensor, reuse: bool = False) -> torch.Tensor | None:
        """hidden [N, hidden] -> logits [N, vocab] float32 (under tensor parallelism gathered
        on rank 0; None on the other ranks). ``reuse``: see LMHead.forward."""
        return self.tp.gather_vocab(self.lm_head(hidden, reuse), self.config.vocab_size)

    def convert_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as this model stores it (a family may override)."""
        return tensor

    def expected_names(self) -> list[str]:
        """The transformers tensor names a checkpoint of this model must provide."""
        return _expected_names(self.config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """Copy checkpoint tensors (transformers names) into the fused parameters, then
        finish every linear layer and the LM head (pack or quantize them, as built).

        Raises ValueError naming ``source`` and the tensor when a shape is wrong, a name is
        unknown, or a parameter is left without weights.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        local = local_config(self.config, self.tp)
        for name, tensor in weights:
            target = _map_name(name, local)
            if target is None:
                continue
            pname, offset = target
            if pname not in params:
                raise ValueError(f"{source}: unexpected tensor {name!r}")
            param = params[pname]
            tensor = shard_weight(name, self.convert_weight(name, tensor), self.config, self.tp)
            size = tensor.shape[0]
            dst = param.data if offset is None else param.data.narrow(0, offset, size)
            if dst.shape != tensor.shape:
                raise ValueError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(name)
        missing = [n for n in self.expected_names() if n not in loaded]
        if missing:
            raise ValueError(f"{source}: missing tensors {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}")
        for module in self.layers.modules():
            if isinstance(module, Linear):
                module.finish_loading()
        self.lm_head.finish_loading(self.embed_tokens)


_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _map_name(name: str, c: ModelConfig) -> tuple[str, int | None] | None:
    """transformers tensor name -> (our parameter name, row offset into a fused tensor)."""
    if name in ("model.embed_tokens.weight", "model.norm.weight"):
        return name.removeprefix("model."), None
    if name == "lm_head.weight":
        return None if c.tie_word_embeddings else ("lm_head.weight", None)
    m = _LAYER_RE.fullmatch(name)
    if m is None:
        return None  # e.g. rotary_emb.inv_freq in old checkpoints
    i, rest = m.groups()
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", q),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", c.intermediate_size),
    }
    module, _, kind = rest.rpartition(".")
    if module in fused:
        target, offset = fused[module]
        return f"layers.{i}.{target}.{kind}", offset
    return f"layers.{i}.{rest}", None


def _expected_names(c: ModelConfig) -> list[str]:
    """The transformers tensor names a checkpoint of this config must provide."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not c.tie_word_embeddings:
        names.append("lm_head.weight")
    per_layer = [f"self_attn.{x}_proj.weight" for x in "qkvo"]
    per_layer += [f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    per_layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if c.qkv_bias:
        per_layer += [f"self_attn.{x}_proj.bias" for x in "qkv"]
    if c.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    return [f"model.layers.{i}.{n}" for i in range(c.num_hidden_layers) for n in per_layer] + names
