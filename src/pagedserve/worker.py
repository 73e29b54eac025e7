"""What every rank builds: its shard of the model with its weights, and its KV cache.

Rank 0 builds it in the engine's process; ranks > 0 in their worker processes, from the
``ShardOptions`` rank 0 resolved and sent (``distributed.executor``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from pagedserve import kernels
from pagedserve.config import EngineArgs, ModelConfig, resolve_device, resolve_dtype
from pagedserve.core.block_manager import cdiv
from pagedserve.cpu import matrix_unit, set_threads
from pagedserve.distributed.parallel_state import TPGroup, local_config
from pagedserve.kv.cache import (
    KVCache,
    block_bytes,
    default_kv_cache_memory,
    kv_bytes_per_token,
    num_blocks_for_memory,
    open_rows_bytes,
)
from pagedserve.kv.quant import KVCacheSpec, resolve_kv_cache_dtype
from pagedserve.kv.spec import KVLayout, kv_layout
from pagedserve.loader import open_model
from pagedserve.model.layers import LinearOptions
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.model.registry import model_class
from pagedserve.runner import ModelRunner


@dataclass(frozen=True)
class ShardOptions:
    """What every tensor-parallel rank builds, as rank 0 resolved it (sent to the others)."""

    model: str
    dtype: str
    device: str
    quantization: str | None
    kv_cache_dtype: str
    num_kv_blocks: int
    block_size: int
    num_swap_blocks: int
    max_model_len: int
    hybrid_kv: bool = True
    num_open: int = 0  # a quantized cache's open-block rows: one per sequence (max_num_seqs)
    prefill_bf16: bool = False  # resolved prefill_dtype (linear_options)


def model_kv_layout(cfg: ModelConfig, hybrid: bool) -> KVLayout:
    """The model's KV groups: its sliding-window layers paged apart from its full-attention
    ones unless ``hybrid`` is False (kv/spec.py)."""
    return kv_layout(cfg.layer_windows(), hybrid)


def prefill_bf16(prefill_dtype: str) -> bool:
    """Whether ``prefill_dtype`` (EngineArgs) asks for bfloat16 prompt matmuls: "auto" does
    where the CPU has a bfloat16 matrix unit (pagedserve.cpu.matrix_unit); elsewhere oneDNN
    emulates bfloat16 no faster than the float32 kernels."""
    return prefill_dtype == "bfloat16" or (prefill_dtype == "auto" and matrix_unit() != "none")


def linear_options(dtype: torch.dtype, device: torch.device, quantization: str | None,
                   bf16_prompts: bool = False) -> LinearOptions:
    """How the model's linear layers are built: the fused CPU kernels serve a float32 model
    on the CPU (``PAGEDSERVE_CPU_KERNELS``: see pagedserve.kernels), torch everything else;
    ``bf16_prompts`` gives the packed layers bfloat16 prompt matmuls (PackedLinear)."""
    ops = kernels.load() if device.type == "cpu" and dtype == torch.float32 else None
    return LinearOptions(ops, kernels.pack_weights(), quantization, bf16_prompts)


def load_model(source, dtype: torch.dtype, device: torch.device, quantization: str | None,
               tp: TPGroup, bf16_prompts: bool = False) -> tuple[LlamaForCausalLM, int]:
    """This rank's shard of the model, built as linear_options says and loaded; returns it
    and the bytes its weights take."""
    linear = linear_options(dtype, device, quantization, bf16_prompts)
    with torch.device("meta"):
        net = model_class(source.config.architecture)(source.config, tp, linear)
    net = net.to_empty(device=device).to(dtype)
    net.load_weights(source.weights(), str(source.path))
    return net.eval(), net.weight_bytes()


def finish_shard(net: LlamaForCausalLM, shard: ShardOptions, tp: TPGroup) -> KVCache:
    """Give ``net`` its rotary table and allocate this rank's KV cache (its KV heads)."""
    device = next(net.parameters()).device
    net.init_rotary(shard.max_model_len)
    spec = resolve_kv_cache_dtype(shard.kv_cache_dtype, next(net.parameters()).dtype)
    return KVCache.allocate(local_config(net.config, tp), shard.num_kv_blocks, shard.block_size,
                            spec, device, shard.num_swap_blocks,
                            model_kv_layout(net.config, shard.hybrid_kv), shard.num_open)


def build_worker(shard: ShardOptions, tp: TPGroup) -> ModelRunner:
    """A rank > 0's runner: its model shard and KV cache, on ``cuda:<rank>`` for CUDA."""
    device = resolve_device(shard.device)
    if device.type == "cuda":  # worker_main has made it the current device
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", tp.rank)))
    net, _ = load_model(open_model(shard.model), resolve_dtype(shard.dtype, device), device,
                        shard.quantization, tp, shard.prefill_bf16)
    return ModelRunner(net, finish_shard(net, shard, tp), device)


logger = logging.getLogger("pagedserve")


class KVSizing(NamedTuple):
    """The cache rank 0 resolved: blocks, the context length they allow, swap blocks, the
    bytes one token's K/V cost on one worker (every layer), and the KV groups."""

    num_kv_blocks: int
    max_model_len: int
    num_swap_blocks: int
    kv_bytes_per_token: int
    layout: KVLayout


def size_kv_cache(args: EngineArgs, shard: ModelConfig, spec: KVCacheSpec, model_limit: int,
                  device: torch.device, local_ranks: int) -> KVSizing:
    """Blocks from ``num_kv_blocks`` or ``kv_cache_memory`` (default: a share of free memory,
    split between the ranks on this host), and ``max_model_len`` (default: the model's limit
    or the longest sequence the blocks hold, if shorter). Raises ValueError naming the numbers
    when they do not fit."""
    per_token = kv_bytes_per_token(shard, spec, args.block_size)  # per worker: 1/N of the KV heads
    layout = model_kv_layout(shard, hybrid=not args.disable_hybrid_kv_cache_manager
                             and args.kv_allocator == "paged")
    bs, chunk = args.block_size, args.max_num_batched_tokens
    num_kv_blocks = args.num_kv_blocks
    if num_kv_blocks is None:
        memory = args.kv_cache_memory
        if memory is None:
            memory = default_kv_cache_memory(device) // local_ranks
        num_kv_blocks = num_blocks_for_memory(memory, shard, bs, spec, layout)
        if num_kv_blocks < 1:
            raise ValueError(f"kv_cache_memory={memory} bytes holds no block of "
                             f"{block_bytes(shard, spec, layout, bs)} bytes")
    source = "num_kv_blocks" if args.num_kv_blocks is not None else "kv_cache_memory"
    capacity = layout.max_tokens(num_kv_blocks, bs, chunk)
    max_model_len = args.max_model_len
    if max_model_len is None:
        max_model_len = min(model_limit, capacity)
        if max_model_len < 1:
            raise ValueError(f"{num_kv_blocks} KV blocks hold no sequence of the model's "
                             f"{len(layout.groups)} KV groups; raise {source}")
        if max_model_len < model_limit:
            logger.warning("max_model_len is %d, capped by the KV cache (%d blocks) below the "
                           "model's %d positions; raise %s for longer requests", max_model_len,
                           num_kv_blocks, model_limit, source)
    elif max_model_len > capacity:
        raise ValueError(
            f"max_model_len={max_model_len} needs "
            f"{layout.blocks_per_seq(max_model_len, bs, chunk)} KV blocks but the cache has "
            f"{num_kv_blocks}; lower max_model_len or raise {source}")
    num_swap_blocks = 0
    if args.preemption_mode == "swap":
        num_swap_blocks = int(args.swap_space * 2**30) // block_bytes(shard, spec, layout, bs)
    return KVSizing(num_kv_blocks, max_model_len, num_swap_blocks, per_token, layout)


def build_rank0(args: EngineArgs, source: Any, device: torch.device, dtype: torch.dtype,
                spec: KVCacheSpec, model_limit: int, driver: Any) -> tuple[ModelRunner, KVSizing]:
    """Rank 0's model, KV cache and runner; with ``driver`` (tensor parallelism) the options
    go to the other ranks and the runner drives them (``distributed.executor``)."""
    from pagedserve.distributed.executor import DistributedRunner
    from pagedserve.distributed.parallel_state import device_group

    cfg = source.config
    tp = TPGroup(0, args.tensor_parallel_size)
    if driver is None:  # a driver sizes the ranks' threads itself
        set_threads(1)
    t0 = time.perf_counter()
    bf16_prompts = prefill_bf16(args.prefill_dtype)
    net, weight_bytes = load_model(source, dtype, device, args.quantization, tp, bf16_prompts)
    local_ranks = args.tensor_parallel_size if driver is not None and driver.procs else 1
    sizing = size_kv_cache(args, local_config(cfg, tp), spec, model_limit, device, local_ranks)
    options = ShardOptions(str(source.path), str(dtype).removeprefix("torch."), str(device),
                           args.quantization, spec.name, sizing.num_kv_blocks, args.block_size,
                           sizing.num_swap_blocks, sizing.max_model_len,
                           sizing.layout.is_hybrid, args.max_num_seqs if spec.quantized else 0,
                           bf16_prompts)
    if driver is not None:
        driver.send(options)
        tp = device_group(tp, options.device)
        net.set_tp(tp)
    runner = ModelRunner(net, finish_shard(net, options, tp), device)
    if driver is not None:
        driver.wait_ready()
        runner = DistributedRunner(runner, driver)
    logger.info(
        "model %s (%s, %d layers, %d/%d query/KV heads, head_dim %d): %.1f MB of %s weights%s "
        "on %s, loaded in %.1fs", source.path.name, cfg.architecture, cfg.num_hidden_layers,
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, weight_bytes / 1e6,
        options.dtype, f" (but the linear layers: {args.quantization}, with bfloat16 copies)"
        if args.quantization else
        " (+ bfloat16 copies for prompt tokens)" if net.kernels.prefill_bf16 else "",
        device, time.perf_counter() - t0)
    blocks, bs, max_len = sizing.num_kv_blocks, args.block_size, sizing.max_model_len
    cache = getattr(runner, "runner", runner).kv_cache
    gib = (cache.nbytes - cache.open_nbytes) / 2**30  # the blocks; the open rows come apart
    if sizing.layout.is_hybrid:
        logger.info("KV cache: %d bytes per token in every layer (%s), %d blocks of %d tokens "
                    "(%.2f GiB); %s", sizing.kv_bytes_per_token, spec.name, blocks, bs, gib,
                    describe_kv_groups(sizing.layout, sizing.kv_bytes_per_token, blocks, bs,
                                       max_len))
    else:
        logger.info(
            "KV cache: %d bytes per token (%s), %d blocks of %d tokens (%.2f GiB), capacity %d "
            "tokens, max concurrency %.2fx at max_model_len=%d", sizing.kv_bytes_per_token,
            spec.name, blocks, bs, gib, blocks * bs, blocks * bs / max_len, max_len)
    if options.num_open:
        logger.info("KV cache: each running sequence's open block of K/V held in %s until it "
                    "fills: %d open rows (max_num_seqs) of %.1f MiB, %.1f MiB besides the blocks",
                    options.dtype, options.num_open,
                    open_rows_bytes(local_config(cfg, tp), spec, bs, 1) / 2**20,
                    cache.open_nbytes / 2**20)
    return runner, sizing


def describe_kv_groups(layout: KVLayout, bytes_per_token: int, num_blocks: int,
                       block_size: int, max_len: int) -> str:
    """One line on the KV groups of a model with sliding-window layers: what a block holds
    and what a sequence of max_model_len tokens holds when decoding."""
    held = layout.blocks_per_seq(max_len, block_size, 1)
    full = len(layout.groups) * cdiv(max_len, block_size)
    per_layer = bytes_per_token // sum(len(g.layers) for g in layout.groups)
    return (f"KV groups: {layout.describe()}, {per_layer * layout.slots} bytes per token "
            f"slot; a {max_len}-token sequence "
            f"(max_model_len) holds {held} blocks while decoding ({full} with every layer kept "
            f"whole, {full / held:.2f}x), max concurrency {num_blocks / held:.2f}x")
