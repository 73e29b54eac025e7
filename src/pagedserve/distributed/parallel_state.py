"""Tensor-parallel state: this process's place in the group and how weights split over it
(Megatron-LM, Shoeybi et al. 2019, sec. 3). Pure (no processes), so the model imports it.

Rank r of N holds heads [r*H/N, (r+1)*H/N) of the queries and of the KV heads (so its share of
every KV block), columns of gate|up and rows of down (one all-reduce after o_proj and one after
down), and a vocabulary slice of the embedding and LM head.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from pagedserve.config import ModelConfig


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group (world_size 1: no collectives).
    ``group``: the process group of the tensor collectives (None: the default gloo group; an
    NCCL group on CUDA, see ``device_group``)."""

    rank: int = 0
    world_size: int = 1
    group: Any = field(default=None, compare=False)

    def shard(self, n: int) -> tuple[int, int]:
        """(start, size) of this rank's slice of ``n`` (a multiple of world_size)."""
        size = n // self.world_size
        return self.rank * size, size

    def vocab_shard(self, vocab_size: int) -> tuple[int, int]:
        """(start, padded size) of this rank's vocabulary slice: ceil(vocab / N) rows, the
        last rank's tail padded (its rows are zero and their logits dropped)."""
        size = -(-vocab_size // self.world_size)
        return self.rank * size, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, x: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """[rows, vocab slice] on every rank -> [rows, vocab_size] on rank 0 (None elsewhere)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab_size] if self.rank == 0 else None


SINGLE = TPGroup()  # no tensor parallelism


def device_group(tp: TPGroup, device: str) -> TPGroup:
    """``tp`` with the group its tensors travel through: NCCL for CUDA (created on every rank
    at the same point, after the options are shared), the default gloo group otherwise.
    Control messages always go through gloo."""
    if tp.world_size == 1 or not device.startswith("cuda"):
        return tp
    return replace(tp, group=dist.new_group(backend="nccl"))


def check_tensor_parallel(cfg: ModelConfig, tensor_parallel_size: int) -> None:
    """Raise ValueError naming the numbers when the model's heads or MLP width do not split
    evenly over ``tensor_parallel_size`` ranks (KV heads are not replicated)."""
    n = tensor_parallel_size
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {n!r}")
    for what, count in (("query heads", cfg.num_attention_heads),
                        ("KV heads", cfg.num_key_value_heads),
                        ("MLP intermediate size", cfg.intermediate_size)):
        if count % n:
            counts = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size)
            fits = [d for d in range(1, cfg.num_key_value_heads + 1)
                    if all(c % d == 0 for c in counts)]
            raise ValueError(f"tensor_parallel_size={n} does not divide the model's {count} "
                             f"{what}; choose one of {fits} (it must divide the query heads, "
                             "the KV heads, which are split, not replicated, and the MLP width)")


def local_config(cfg: ModelConfig, tp: TPGroup) -> ModelConfig:
    """The config of one rank's shard: its heads, KV heads and MLP width (vocab unchanged)."""
    n = tp.world_size
    return replace(cfg, num_attention_heads=cfg.num_attention_heads // n,
                   num_key_value_heads=cfg.num_key_value_heads // n,
                   intermediate_size=cfg.intermediate_size // n)


def shard_weight(name: str, w: torch.Tensor, cfg: ModelConfig, tp: TPGroup) -> torch.Tensor:
    """This rank's slice of checkpoint tensor ``name`` (transformers names, full model)."""
    if tp.world_size == 1:
        return w
    d = cfg.head_dim
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        start, size = tp.vocab_shard(cfg.vocab_size)
        part = w[start:start + size]
        if part.shape[0] < size:  # the last rank's padding
            part = torch.cat([part, part.new_zeros(size - part.shape[0], *part.shape[1:])])
        return part
    if ".self_attn.q_proj." in name:
        start, size = tp.shard(cfg.num_attention_heads)
        return w[start * d:(start + size) * d]
    if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
        start, size = tp.shard(cfg.num_key_value_heads)
        return w[start * d:(start + size) * d]
    if ".self_attn.o_proj." in name:
        start, size = tp.shard(cfg.num_attention_heads)
        return w[:, start * d:(start + size) * d]
    if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
        start, size = tp.shard(cfg.intermediate_size)
        return w[start:start + size]
    if ".mlp.down_proj." in name:
        start, size = tp.shard(cfg.intermediate_size)
        return w[:, start:start + size]
    return w  # norms: replicated
