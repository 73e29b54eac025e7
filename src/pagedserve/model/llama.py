"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Input is a flat batch: ``input_ids`` and ``positions`` [num_tokens] of all scheduled requests,
with their attention described by one AttentionMetadata. Weights are loaded from transformers'
tensor names (``model.layers.N.self_attn.q_proj.weight`` ...), whatever the file format.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.config import ModelConfig
from pagedserve.distributed.parallel_state import SINGLE, TPGroup, local_config, shard_weight
from pagedserve.kv.cache import LayerKVCache
from pagedserve.model import quant
from pagedserve.model.layers import (
    PANEL,
    Attention,
    GatedMLP,
    KernelState,
    PackedLinear,
    RMSNorm,
    RotaryEmbedding,
    pack_linear_weight,
    unpack_linear_weight,
)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, kernels: KernelState):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, kernels)
        self.self_attn = Attention(config, tp, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, kernels)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, tp, kernels)

    def forward(self, residual, y, rope, kv_cache, md):
        """vLLM's residual form: ``residual`` [T, hidden] gets ``y`` (the previous layer's
        output, or None) added in place; returns this layer's output, not yet added."""
        h = self.self_attn(self.input_layernorm(residual, y), rope, kv_cache, md)
        return self.mlp(self.post_attention_layernorm(residual, h))


class LlamaForCausalLM(nn.Module):
    """Decoder stack plus LM head (tied to the embedding when the config says so).

    ``config`` is the whole model's; under tensor parallelism (``tp``, see
    pagedserve.distributed.parallel_state) the layers hold this rank's heads and MLP columns,
    and the embedding and LM head this rank's vocabulary slice. ``rotary`` is set by the owner once max_model_len
    is known (its cos/sin table covers it). ``ops`` (see ``use_kernels``) selects the fused
    CPU kernels; None runs the torch path.
    """

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        local = local_config(config, tp)
        self.vocab_start, vocab_rows = tp.vocab_shard(config.vocab_size)
        self.vocab_rows = vocab_rows
        self.embed_tokens = nn.Embedding(vocab_rows, config.hidden_size)
        # one state every layer reads (use_kernels and forward set it)
        self.kernels = KernelState()
        self.layers = nn.ModuleList(DecoderLayer(local, tp, self.kernels)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.kernels)
        self.rotary: RotaryEmbedding | None = None
        # (int8 [vocab rows, hidden], float32 scales [vocab rows, hidden / 32]) for
        # quantization="int4" (model/quant.py); None: the float LM head only
        self.lm_head_q8: tuple[torch.Tensor, torch.Tensor] | None = None
        # [vocab rows / PANEL, hidden, PANEL]: the LM head packed for the CPU kernels
        # (use_kernels), which then replaces the float copy; None: the float copy
        self.lm_head_packed: torch.Tensor | None = None
        self._logits_buffer: torch.Tensor | None = None  # compute_logits(reuse=True)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, vocab_rows, bias=False)

    def set_tp(self, tp: TPGroup) -> None:
        """Point every layer at ``tp`` (the same ranks; e.g. with its NCCL group added)."""
        for module in self.modules():
            if hasattr(module, "tp"):
                module.tp = tp

    def use_kernels(self, ops, pack_weights: bool = True) -> bool:
        """Run the fused CPU kernels ``ops`` (pagedserve.kernels.load()) from now on, or the
        torch path for None. They serve only a float32 model on the CPU (other models keep the
        torch path); the fused layer path also needs an unquantized KV cache. With ``ops`` and
        ``pack_weights`` the float32 nn.Linear layers and the LM head (the embedding too when
        tied: the lookup reads the packed rows) are kept only packed for ``ops.packed_linear``
        (False keeps torch's matmuls, for benchmarks); None unpacks them. The projections take
        ``act_dtype``: bfloat16 for int4 layers, else float32. Returns whether the kernels are
        used."""
        self._unpack()
        embed = self.embed_tokens.weight
        usable = ops is not None and embed.dtype == torch.float32 and embed.device.type == "cpu"
        self.kernels.ops = ops if usable else None
        qkv = self.layers[0].self_attn.qkv_proj
        self.kernels.act_dtype = torch.float32 if isinstance(qkv, nn.Linear) else torch.bfloat16
        if self.ops is not None and pack_weights:
            self._pack(self.ops)
        return self.ops is not None

    @property
    def ops(self):
        """The CPU kernels the model uses (pagedserve.kernels), or None."""
        return self.kernels.ops

    def _linear_slots(self):
        """(module, attribute name) of every decoder projection."""
        for layer in self.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, child in parent.named_children():
                    if isinstance(child, (nn.Linear, PackedLinear)):
                        yield parent, name

    def _pack(self, ops) -> None:
        for parent, name in self._linear_slots():
            child = getattr(parent, name)
            if type(child) is nn.Linear and child.weight.dtype == torch.float32:
                gated = name == "gate_up_proj" and child.bias is None
                setattr(parent, name, PackedLinear(child, ops, gated))
        self.lm_head_packed = pack_linear_weight(self.lm_head_weight().detach())
        # the float copy is dropped: the packed one serves the LM head and the lookup
        head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        head.weight = nn.Parameter(head.weight.new_empty(0, head.weight.shape[1]),
                                   requires_grad=False)

    def _unpack(self) -> None:
        """Undo _pack, also a partial one (each part is checked on its own)."""
        for parent, name in self._linear_slots():
            child = getattr(parent, name)
            if isinstance(child, PackedLinear):
                setattr(parent, name, child.to_linear())
        if self.lm_head_packed is not None:
            head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
            head.weight = nn.Parameter(unpack_linear_weight(self.lm_head_packed, self.vocab_rows),
                                       requires_grad=False)
            self.lm_head_packed = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, hidden]; a vocabulary-parallel lookup summed over the ranks."""
        if self.tp.world_size == 1:
            return self._embedding_rows(input_ids)
        ids = input_ids - self.vocab_start
        inside = (ids >= 0) & (ids < self.vocab_rows)
        x = self._embedding_rows(torch.where(inside, ids, 0)) * inside[:, None]
        return self.tp.all_reduce(x)

    def _embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.lm_head_packed is not None and self.config.tie_word_embeddings:
            # nn.Embedding's bounds check (the padded panel would read zeros, -1 would wrap)
            low, high = torch.aminmax(ids) if ids.numel() else (0, 0)
            if not 0 <= int(low) <= int(high) < self.vocab_rows:
                raise IndexError(f"token id out of range [0, {self.vocab_rows})")
            return self.lm_head_packed[ids // PANEL, :, ids % PANEL]
        return self.embed_tokens(ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[LayerKVCache], md: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden]."""
        x = self.embed(input_ids)
        rope = self.rotary(positions, x.dtype)
        # the fused layers read and write an unquantized cache only
        self.kernels.fused = self.ops is not None and kv_caches[0].k_scale is None
        y = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            y = layer(x, y, rope, kv_cache, md)
        return self.norm(x, y, out_dtype=torch.float32)

    def lm_head_weight(self) -> torch.Tensor:
        """[vocab rows, hidden]: the LM head, or the embedding when they are tied ([0, hidden]
        while the kernels keep it packed: see ``lm_head_packed``)."""
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, reuse: bool = False) -> torch.Tensor | None:
        """hidden [N, hidden] -> logits [N, vocab] float32 (under tensor parallelism gathered
        on rank 0; None on the other ranks). With an 8-bit LM head and the CPU kernels, up to
        SMALL_ROWS rows multiply the int8 copy (a quarter of the bytes), more the float one.
        ``reuse``: the packed LM head may write into a buffer the model keeps (a fresh
        [256, 49152] tensor costs ~8 ms of page faults); the result is then valid only until
        the next call with ``reuse``."""
        if (self.lm_head_q8 is not None and self.ops is not None
                and hidden.shape[0] <= quant.SMALL_ROWS):
            logits = self.ops.int8_linear(hidden.float(), *self.lm_head_q8)
        elif self.lm_head_packed is not None:
            buffer = None
            if reuse:
                size = hidden.shape[0] * self.vocab_rows
                if self._logits_buffer is None or self._logits_buffer.numel() < size:
                    self._logits_buffer = hidden.new_empty(size, dtype=torch.float32)
                buffer = self._logits_buffer
            logits = self.ops.packed_linear(hidden.float(), self.lm_head_packed, None,
                                            self.vocab_rows, buffer)
        else:
            logits = F.linear(hidden, self.lm_head_weight()).float()
        return self.tp.gather_vocab(logits, self.config.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """Copy checkpoint tensors (transformers names) into the fused parameters.

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
            tensor = shard_weight(name, tensor, self.config, self.tp)
            size = tensor.shape[0]
            dst = param.data if offset is None else param.data.narrow(0, offset, size)
            if dst.shape != tensor.shape:
                raise ValueError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(name)
        missing = [n for n in _expected_names(self.config) if n not in loaded]
        if missing:
            raise ValueError(f"{source}: missing tensors {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}")


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
    return [f"model.layers.{i}.{n}" for i in range(c.num_hidden_layers) for n in per_layer] + names
