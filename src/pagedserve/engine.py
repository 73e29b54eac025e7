"""LLMEngine (add_request / step / abort_request) and the offline ``LLM`` API on top of it.

One step = schedule -> run the model -> sample (forking n > 1 requests at their first token)
or select beams -> update sequences (detokenize, stop checks) -> free the blocks of finished
sequences. Bad input is refused in ``add_request`` with a ValueError before anything is
queued, so the engine keeps serving the other requests.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import time
import weakref
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Any

import torch
from tqdm.auto import tqdm

from pagedserve import kernels
from pagedserve.beam_search import BeamSearchState
from pagedserve.config import CacheConfig, SchedulerConfig, resolve_device, resolve_dtype
from pagedserve.core.block_manager import BlockManager, ContiguousBlockManager, cdiv
from pagedserve.core.block_pool import root_hash
from pagedserve.core.scheduler import Scheduler, SchedulerOutput
from pagedserve.distributed import (
    DistributedRunner,
    Driver,
    TPGroup,
    check_tensor_parallel,
    device_group,
    local_config,
)
from pagedserve.inputs import InputProcessor, ProcessedPrompt, PromptType
from pagedserve.kv.cache import (
    KVCache,
    default_kv_cache_memory,
    kv_bytes_per_token,
    num_blocks_for_memory,
)
from pagedserve.kv.quant import resolve_kv_cache_dtype
from pagedserve.loader import open_model
from pagedserve.model.layers import RotaryEmbedding
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.model.quant import check_quantization, quantize_linear_layers
from pagedserve.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    KVCacheStats,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from pagedserve.runner import ModelRunner
from pagedserve.sampler import Sampler, SamplerOutput, build_sampling_metadata
from pagedserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedserve.sequence import Request, Sequence, SequenceStatus
from pagedserve.tokenizer import (
    IncrementalDetokenizer,
    load_tokenizer,
)

logger = logging.getLogger("pagedserve")

# A failed forward pass fails only its step's requests; this many in a row mark the engine
# unhealthy (a transient failure should not make an orchestrator restart the server).
MAX_CONSECUTIVE_STEP_FAILURES = 3

class LLMEngine:
    """The serving engine: owns the model, the KV cache, the scheduler and the requests.

    Args:
        model: a GGUF file, an HF directory, or None for SmolLM2-135M-Instruct.
        tokenizer: tokenizer directory overriding the model's own.
        dtype: "auto" (float32 on CPU, bfloat16 on CUDA; README "Choosing the dtype"),
            "float32", "bfloat16", "float16".
        device: "auto", "cpu", "cuda" or "cuda:N".
        block_size: token slots per KV block.
        max_model_len: longest prompt + output; default min(model's limit, KV capacity).
        max_num_seqs: most sequences running at once (a request counts n, or its beam width).
        max_num_batched_tokens: most tokens computed in one step (prefill chunks + decodes).
        kv_cache_memory: KV cache bytes; default see ``pagedserve.kv.cache``.
        num_kv_blocks: exact number of KV blocks (overrides kv_cache_memory).
        seed: seed of the generator that unseeded random requests share.
        skip_tokenizer_init: run without a tokenizer (prompts as token ids, no text output).
        enable_prefix_caching: reuse the KV blocks of equal prompt prefixes (default True).
        preemption_mode: "recompute" (free blocks, re-prefill later) or "swap" (copy blocks
            to a host pool of ``swap_space`` GiB; recompute when it is full).
        swap_space: host swap pool size in GiB (used with preemption_mode="swap").
        kv_cache_dtype: how K/V are stored: "auto" (the model's dtype), "float32", "bfloat16",
            "float16", or 8 bits with a scale per token and KV head: "int8" or "fp8" (e4m3);
            see ``pagedserve.kv.quant`` for the error bounds.
        kv_allocator: "paged" or "contiguous" (the pre-paging ablation: max_model_len slots
            reserved per request).
        quantization: None (weights in ``dtype``) or "int4": the decoder's linear layers in
            4-bit groups of 32 with bfloat16 matmul inputs (``pagedserve.model.quant``; about 1.7x
            faster decode on CPU, README "Speed").
        tensor_parallel_size: N > 1 shards the model over N processes (torch.distributed;
            ``pagedserve.distributed``): ranks 1..N-1 are started on this host, or, with
            PAGEDSERVE_TP_EXTERNAL=1, met through MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE.
            ``kv_cache_memory`` and ``num_kv_blocks`` are per worker. Call ``shutdown()`` (or
            let the LLM be collected) to stop the workers.
    Raises:
        FileNotFoundError, ValueError (ModelLoadError): bad model path or file, or options
        that do not fit together (the message names the numbers). WorkerDiedError: a
        tensor-parallel worker failed to start (or, later from ``step``, died).
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None,
                 dtype: str | torch.dtype = "auto", device: str = "auto", block_size: int = 16,
                 max_model_len: int | None = None, max_num_seqs: int = 128,
                 max_num_batched_tokens: int = 512, kv_cache_memory: int | None = None,
                 num_kv_blocks: int | None = None, seed: int = 0,
                 skip_tokenizer_init: bool = False, enable_prefix_caching: bool = True,
                 preemption_mode: str = "recompute", swap_space: float = 4.0,
                 kv_cache_dtype: str = "auto", kv_allocator: str = "paged",
                 quantization: str | None = None, tensor_parallel_size: int = 1):
        _check_options(block_size=block_size, max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       kv_cache_memory=kv_cache_memory, num_kv_blocks=num_kv_blocks)
        if not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < 2**64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {seed!r}")
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise ValueError(f"model must be a path or None, got {model!r}")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', "
                             f"got {preemption_mode!r}")
        if not isinstance(swap_space, (int, float)) or isinstance(swap_space, bool) \
                or not 0 <= swap_space < 2**20:
            raise ValueError(f"swap_space must be a number of GiB in [0, 2**20), "
                             f"got {swap_space!r}")
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, "
                             f"got {enable_prefix_caching!r}")
        if kv_allocator not in ("paged", "contiguous"):
            raise ValueError(f"kv_allocator must be 'paged' or 'contiguous', got {kv_allocator!r}")
        if kv_allocator == "contiguous" and preemption_mode == "swap":
            raise ValueError("kv_allocator='contiguous' reserves max_model_len per request and "
                             "never preempts: preemption_mode='swap' does not apply")
        if quantization is not None:
            check_quantization(quantization)
        self.kv_allocator = kv_allocator
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.kv_cache_spec = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)
        source = open_model(model)
        self.model_path = source.path
        self.model_config = cfg = source.config
        check_tensor_parallel(cfg, tensor_parallel_size)  # before the tokenizer's seconds
        if skip_tokenizer_init:
            self.tokenizer = None
        elif tokenizer is not None:
            self.tokenizer = load_tokenizer(tokenizer)
        else:
            self.tokenizer = source.tokenizer()

        model_limit = cfg.max_position_embeddings
        if cfg.sliding_window is not None:
            model_limit = min(model_limit, cfg.sliding_window)
        if max_model_len is not None and max_model_len > model_limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's limit of "
                             f"{model_limit} positions")

        tp = TPGroup(0, tensor_parallel_size)
        self.driver: Driver | None = None
        if tensor_parallel_size > 1:  # workers start importing while rank 0 loads
            self.driver = Driver(tensor_parallel_size,
                                 spawn=os.environ.get("PAGEDSERVE_TP_EXTERNAL") != "1")
        try:
            t0 = time.perf_counter()
            net, weight_bytes = load_model(source, self.dtype, self.device, quantization, tp)
            self.model = net
            shard = local_config(cfg, tp)
            spec = self.kv_cache_spec
            # per worker: each rank holds 1/N of the KV heads of every block
            self.kv_bytes_per_token = per_token = kv_bytes_per_token(shard, spec)
            if num_kv_blocks is None:
                if kv_cache_memory is None:
                    local_ranks = 1 if self.driver is None or not self.driver.procs \
                        else tensor_parallel_size
                    kv_cache_memory = default_kv_cache_memory(self.device) // local_ranks
                num_kv_blocks = num_blocks_for_memory(kv_cache_memory, shard, block_size, spec)
                if num_kv_blocks < 1:
                    raise ValueError(f"kv_cache_memory={kv_cache_memory} bytes holds no block "
                                     f"of {per_token * block_size} bytes")
            capacity = num_kv_blocks * block_size
            if max_model_len is None:
                max_model_len = min(model_limit, capacity)
            elif max_model_len > capacity:
                raise ValueError(
                    f"max_model_len={max_model_len} needs {cdiv(max_model_len, block_size)} KV "
                    f"blocks but the cache has {num_kv_blocks}; lower max_model_len or raise "
                    "kv_cache_memory")
            num_swap_blocks = 0
            if preemption_mode == "swap":
                num_swap_blocks = int(swap_space * 2**30) // (per_token * block_size)
            options = ShardOptions(str(source.path), str(self.dtype).removeprefix("torch."),
                                   str(self.device), quantization, spec.name, num_kv_blocks,
                                   block_size, num_swap_blocks, max_model_len)
            if self.driver is not None:
                self.driver.send(options)
                tp = device_group(tp, options.device)
                net.set_tp(tp)
            self.kv_cache = finish_shard(net, options, tp)
            local_runner = ModelRunner(self.model, self.kv_cache, self.device)
            if self.driver is not None:
                self.driver.wait_ready()
                self.runner = DistributedRunner(local_runner, self.driver)
            else:
                self.runner = local_runner
        except BaseException:
            if self.driver is not None:
                self.driver.close()
            raise
        if self.driver is not None:  # stop the workers when the engine goes (or at exit)
            self._finalizer = weakref.finalize(self, self.driver.close)
        self.cache_config = CacheConfig(block_size, num_kv_blocks, spec.name)
        self.scheduler_config = SchedulerConfig(max_num_seqs, max_num_batched_tokens,
                                                max_model_len)
        if kv_allocator == "contiguous":  # the pre-paging baseline, no prefix caching
            self.block_manager = ContiguousBlockManager(num_kv_blocks, block_size,
                                                        cdiv(max_model_len, block_size))
        else:
            self.block_manager = BlockManager(num_kv_blocks, block_size, enable_prefix_caching,
                                              num_swap_blocks)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager, preemption_mode)
        self.input_processor = InputProcessor(self.tokenizer, cfg.vocab_size, max_model_len)
        self.sampler = Sampler(kernels.load() if self.device.type == "cpu" else None)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.peak_used_blocks = 0
        self.kv_token_utilization = 0.0
        self._block_steps = [0, 0]  # sums over steps of (physical, logical) blocks in use
        self._slot_steps = [0, 0]  # sums over steps of (slots holding K/V, slots reserved)
        self._peak_reserved = (0, 0.0)  # (reserved slots, utilization) at the peak
        self.max_num_running = 0
        self.num_prompt_tokens = 0  # prompts of requests that produced a first token
        self.num_generation_tokens = 0  # tokens sampled (every sequence, every beam)
        self.num_consecutive_step_failures = 0

        logger.info(
            "model %s (%s, %d layers, %d/%d query/KV heads, head_dim %d): %.1f MB of %s weights%s "
            "on %s, loaded in %.1fs", source.path.name, cfg.architecture, cfg.num_hidden_layers,
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, weight_bytes / 1e6,
            str(self.dtype).removeprefix("torch."),
            f" ({quantization} linear layers)" if quantization else "", self.device,
            time.perf_counter() - t0)
        logger.info(
            "KV cache: %d bytes per token (%s), %d blocks of %d tokens (%.2f GiB), capacity %d "
            "tokens, max concurrency %.2fx at max_model_len=%d", per_token, spec.name, num_kv_blocks,
            block_size, self.kv_cache.nbytes / 2**30, capacity, capacity / max_model_len,
            max_model_len)

    # ---- requests -------------------------------------------------------------------------

    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        """(text, token ids, cache_salt) of a prompt string or dict, checked as add_request
        checks it (``InputProcessor.process_prompt``). Thread-safe: it reads only the
        tokenizer and the model's limits. Raises ValueError naming the numbers."""
        return self.input_processor.process_prompt(prompt)

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | BeamSearchParams | None = None,
                    arrival_time: float | None = None) -> Request:
        """Validate and queue a request. ``prompt`` is a string or a dict with "prompt" or
        "prompt_token_ids" and optionally "cache_salt" (requests with different salts never
        share prefix-cache blocks).

        Raises:
            ValueError: duplicate id; empty prompt; token id outside the vocabulary; prompt
                longer than max_model_len, or prompt + max_tokens beyond it (the message
                states the numbers); a request whose sequences could never fit in the KV
                cache together; stop strings without a tokenizer.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        if not isinstance(params, (SamplingParams, BeamSearchParams)):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids, salt = self.input_processor.process_prompt(prompt)
        max_tokens = self.input_processor.resolve_max_tokens(params, len(ids))
        beam = isinstance(params, BeamSearchParams)
        width = params.beam_width if beam else params.n
        if width > 1 and self.kv_allocator == "contiguous":
            raise ValueError("kv_allocator='contiguous' runs one sequence per request "
                             f"(got {'beam_width' if beam else 'n'}={width})")
        self._check_fits(width, len(ids) + max_tokens)
        if not beam and params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        request = Request(
            request_id=request_id, prompt=text, prompt_token_ids=ids, params=params,
            max_tokens=max_tokens, eos_token_ids=frozenset(self.model_config.eos_token_ids),
            metrics=RequestMetrics(arrival_time or time.time()), root_hash=root_hash(salt),
            arrival_index=next(self._arrivals),
        )
        if beam:
            request.beam = BeamSearchState(params, len(ids), request.eos_token_ids)
        elif params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(ids)
        request.seqs.append(self._new_sequence(request, 0, list(ids)))
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def _check_fits(self, num_seqs: int, seq_len: int) -> None:
        cfg = self.scheduler_config
        if num_seqs > cfg.max_num_seqs:
            raise ValueError(f"the request runs {num_seqs} sequences, more than "
                             f"max_num_seqs={cfg.max_num_seqs}")
        need = num_seqs * cdiv(seq_len, self.cache_config.block_size)
        if need > self.cache_config.num_blocks:
            raise ValueError(
                f"the request's {num_seqs} sequences of up to {seq_len} tokens need up to "
                f"{need} KV blocks, more than the {self.cache_config.num_blocks} the cache has")
        if num_seqs > cfg.max_num_batched_tokens:
            raise ValueError(f"{num_seqs} sequences need max_num_batched_tokens >= {num_seqs}, "
                             f"it is {cfg.max_num_batched_tokens}")

    def _new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        params = request.params
        seq = Sequence(next(self._seq_ids), request, index, token_ids)
        if isinstance(params, SamplingParams):
            if self.tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(
                    self.tokenizer, request.prompt_token_ids, params.stop_strings,
                    params.include_stop_str_in_output, params.skip_special_tokens)
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.device)
                seq.generator.manual_seed(_derive_seed(params.seed, index))
            if params.logprobs is not None:
                seq.logprobs = []
        return seq

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now and free their blocks. Unknown or finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        elif not isinstance(request_ids, Iterable):
            raise ValueError(f"request_ids must be a string or a list of strings, "
                             f"got {request_ids!r}")
        aborted = [self.requests.pop(i) for i in request_ids if i in self.requests]
        for r in aborted:
            for s in r.live_seqs:
                s.status = SequenceStatus.FINISHED_ABORTED
            if r.beam is not None:
                r.beam.done = True
            r.metrics.finished_time = time.time()
        self.scheduler.finish_requests(aborted)

    def is_healthy(self) -> bool:
        """False once a tensor-parallel worker died or the engine was shut down (noticed
        within a second even while idle), or after MAX_CONSECUTIVE_STEP_FAILURES forward
        passes failed in a row (one success makes it healthy again); the server's /health
        reports it."""
        if self.num_consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            return False
        return self.driver is None or self.driver.alive

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (no-op without them); the engine is unusable
        afterwards."""
        if self.driver is not None:
            self.driver.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def next_request_id(self) -> str:
        """A request id not in use."""
        while (rid := str(next(self._ids))) in self.requests:
            pass
        return rid

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration. Returns an output for each request that produced something this
        step (as its ``output_kind`` asks; beam search requests only when finished).

        Failures stay with their request: an exception while sampling, detokenizing, checking
        stops, recording logprobs or building the output of one request finishes that request
        with ``finish_reason="error"`` (``RequestOutput.error`` says why) and frees its blocks;
        a failed forward pass does that to the requests of this step. The others go on. Raises
        only for a broken engine (a dead tensor-parallel worker, a scheduler defect)."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.waiting and not sched.preempted:
                # Cannot happen: add_request checked that every request fits an empty cache.
                raise RuntimeError("the scheduler could not admit any waiting request")
            return []
        now = time.time()
        for seq, _ in sched.scheduled:
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
        try:
            result = self.runner.execute(sched)
        except Exception as e:
            if self.driver is not None and not self.driver.alive:
                raise  # the ranks are out of step: nothing more can run
            return self._fail_step(sched, e)
        self.num_consecutive_step_failures = 0
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
        self._track_usage()
        failed: dict[int, Request] = {}
        if result.prompt_rows:
            self._record_prompt_logprobs_isolated(result.prompt_rows, result.prompt_logits,
                                                  failed)
        seqs, logits = result.sample_seqs, result.logits
        touched = {id(s.request): s.request for s in seqs}
        self._sample([(s, i) for i, s in enumerate(seqs)
                      if s.request.beam is None and id(s.request) not in failed], logits, failed)
        row = {id(s): i for i, s in enumerate(seqs)}
        for request in touched.values():
            if request.beam is not None and id(request) not in failed:
                try:
                    self._beam_step(request, logits[[row[id(b)] for b in request.seqs]])
                except Exception as e:
                    self._fail(request, e, failed)
        outputs = []
        for request in touched.values():
            if id(request) not in failed:
                try:
                    out = self._finish_or_report(request, now)
                except Exception as e:
                    self._fail(request, e, failed)
                else:
                    if out is not None:
                        outputs.append(out)
            if id(request) in failed:
                outputs.append(self._error_output(request))
        if self.cache_config.debug_checks:
            self._check_kv()
        return outputs

    def _finish_or_report(self, request: Request, now: float) -> RequestOutput | None:
        """Free a finished request and return its output; a running one's output if its
        ``output_kind`` streams."""
        if request.is_finished:
            out = self._make_output(request)
            request.metrics.finished_time = now
            del self.requests[request.request_id]
            self.scheduler.finish_requests([request])
            return out
        if request.beam is None and request.params.output_kind != RequestOutputKind.FINAL_ONLY:
            return self._make_output(request)
        return None

    # ---- failures -------------------------------------------------------------------------

    def _fail(self, request: Request, error: BaseException, failed: dict[int, Request]) -> None:
        """Finish ``request`` with an error and free its blocks; the step goes on without it."""
        logger.error("request %s failed: %s: %s", request.request_id, type(error).__name__,
                     error, exc_info=error)
        request.error = f"{type(error).__name__}: {error}"
        for s in request.seqs:
            if not s.is_finished:
                s.status = SequenceStatus.FINISHED_ERROR
        if request.beam is not None:
            request.beam.done = True
        request.metrics.finished_time = time.time()
        self.requests.pop(request.request_id, None)
        self.scheduler.finish_requests([request])
        failed[id(request)] = request

    def _fail_step(self, sched: SchedulerOutput, error: BaseException) -> list[RequestOutput]:
        """The forward pass (or a block copy) failed: finish every request of this step with
        the error. Blocks registered in the prefix cache this step hold no valid K/V, so their
        hashes are dropped before the blocks are freed."""
        self.num_consecutive_step_failures += 1
        logger.error("step failed (%d in a row): %s: %s", self.num_consecutive_step_failures,
                     type(error).__name__, error, exc_info=error)
        requests = {id(s.request): s.request for s, _ in sched.scheduled}
        requests.update((id(r), r) for r in sched.preempted
                        if any(s.status == SequenceStatus.SWAPPED for s in r.seqs))
        for seq, _ in sched.scheduled:
            self.block_manager.forget_uncomputed(seq)
        failed: dict[int, Request] = {}
        for request in requests.values():
            self._fail(request, error, failed)
        if self.cache_config.debug_checks:
            self._check_kv()
        return [self._error_output(r) for r in requests.values()]

    def _error_output(self, request: Request) -> RequestOutput:
        """The final output of a failed request: no text, ``finish_reason="error"``."""
        completions = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="error")
                       for i in range(max(1, len(request.seqs) if request.beam is None else 1))]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             completions, True, num_cached_tokens=request.num_cached_tokens,
                             metrics=request.metrics, error=request.error)

    def _record_prompt_logprobs_isolated(self, items: list[tuple[Sequence, int, int]],
                                         logits: torch.Tensor,
                                         failed: dict[int, Request]) -> None:
        """``_record_prompt_logprobs`` for all rows at once; if that raises, for each request
        alone, failing the requests that still raise."""
        try:
            self._record_prompt_logprobs(items, logits)
            return
        except Exception:
            pass
        row = 0
        for seq, first, count in items:
            try:
                self._record_prompt_logprobs([(seq, first, count)], logits[row:row + count])
            except Exception as e:
                self._fail(seq.request, e, failed)
            row += count

    def _track_usage(self) -> None:
        pool = self.block_manager.pool
        live = [s for r in self.scheduler.running for s in r.live_seqs]
        self.max_num_running = max(self.max_num_running, len(self.scheduler.running))
        bs = self.cache_config.block_size
        # Slots holding K/V: the used blocks are exactly the running sequences' blocks, all
        # full but each sequence's last; a shared last block counts once, at its fullest.
        # O(batch) per step, not O(blocks).
        short: dict[int, int] = {}  # last block -> empty slots in it
        for s in live:
            if s.block_table:
                b = s.block_table[-1]
                empty = len(s.block_table) * bs - s.num_computed_tokens
                short[b] = min(short.get(b, bs), empty)
        filled = bs * pool.num_used_blocks - sum(short.values())
        if self.cache_config.debug_checks:
            held: dict[int, int] = {}
            for s in live:
                for i, b in enumerate(s.block_table):
                    held[b] = max(held.get(b, 0), min(bs, s.num_computed_tokens - i * bs))
            assert filled == sum(held.values()), (filled, sum(held.values()))
        reserved = bs * getattr(self.block_manager, "num_reserved_blocks", pool.num_used_blocks)
        self._slot_steps[0] += filled
        self._slot_steps[1] += reserved
        if reserved > self._peak_reserved[0]:
            self._peak_reserved = (reserved, filled / reserved)
        used = pool.num_used_blocks
        self._block_steps[0] += used
        self._block_steps[1] += sum(len(s.block_table) for s in live)
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used
            self.kv_token_utilization = filled / (used * bs)

    def _sample(self, rows: list[tuple[Sequence, int]], logits: torch.Tensor,
                failed: dict[int, Request]) -> None:
        """Sample one token for each (sequence, logits row) and apply it; an n > 1 request
        forks at its first token into n sequences sampling from the same row. A request whose
        handling raises is failed (``failed``), the others go on."""
        rows = self._fork_parallel(rows, failed)
        for group, out in self._run_sampler(rows, logits, failed):
            now = time.time()
            for j, (seq, _) in enumerate(group):
                if id(seq.request) in failed:
                    continue
                try:
                    self._append_sampled(seq, out, j, now)
                except Exception as e:
                    self._fail(seq.request, e, failed)

    def _fork_parallel(self, rows: list[tuple[Sequence, int]], failed: dict[int, Request]
                       ) -> list[tuple[Sequence, int]]:
        """``rows`` with the n - 1 children of each n > 1 request at its first token (they
        share the parent's blocks and sample from the parent's row)."""
        out = []
        for seq, i in rows:
            request = seq.request
            try:
                if request.params.n > 1 and len(request.seqs) == 1 and seq.num_output_tokens == 0:
                    for k in range(1, request.params.n):
                        child = self._new_sequence(request, k, list(seq.token_ids))
                        child.status = SequenceStatus.RUNNING
                        self.block_manager.fork(seq, child)
                        request.seqs.append(child)
                        out.append((child, i))
            except Exception as e:
                self._fail(request, e, failed)
                continue
            out.append((seq, i))
        return out

    def _run_sampler(self, rows: list[tuple[Sequence, int]], logits: torch.Tensor,
                     failed: dict[int, Request]
                     ) -> list[tuple[list[tuple[Sequence, int]], SamplerOutput]]:
        """The sampler over all ``rows`` in one batch: [(rows, output)]. If the batch raises,
        each request's rows are sampled alone and the requests that still raise are failed."""
        rows = [(s, i) for s, i in rows if id(s.request) not in failed]
        if not rows:
            return []
        try:
            return [(rows, self._sample_rows(rows, logits))]
        except Exception:
            pass
        groups: dict[int, list[tuple[Sequence, int]]] = {}
        for seq, i in rows:
            groups.setdefault(id(seq.request), []).append((seq, i))
        results = []
        for group in groups.values():
            try:
                results.append((group, self._sample_rows(group, logits)))
            except Exception as e:
                self._fail(group[0][0].request, e, failed)
        return results

    def _sample_rows(self, rows: list[tuple[Sequence, int]], logits: torch.Tensor
                     ) -> SamplerOutput:
        seqs = [s for s, _ in rows]
        index = [i for _, i in rows]
        smd = build_sampling_metadata(seqs, self.model_config.vocab_size, self.device)
        if index != list(range(logits.shape[0])):  # a copy of [B, vocab] only if needed
            logits = logits[index]
        return self.sampler(logits, smd, self.generator)

    def _append_sampled(self, seq: Sequence, out: SamplerOutput, j: int, now: float) -> None:
        """Append row ``j``'s token to ``seq``: metrics, logprobs, stop checks, and its blocks
        freed if that finished it."""
        token = out.token_ids[j]
        metrics = seq.request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            self.num_prompt_tokens += len(seq.request.prompt_token_ids)
        metrics.last_token_time = now
        seq.append_token(token)
        self.num_generation_tokens += 1
        metrics.num_generation_tokens = max(metrics.num_generation_tokens,
                                            seq.num_output_tokens)
        if out.sampled_logprobs is not None and seq.logprobs is not None:
            self._record_logprobs(seq, out, j)
        if self._check_stop(seq, token):
            if seq.detokenizer is not None and not seq.detokenizer.finished:
                stop = seq.detokenizer.flush()  # held-back text; may complete a stop string
                if stop is not None:
                    seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
            self.scheduler.finish_sequence(seq)

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        """Apply the stop rules in vLLM's order; set status/stop_reason. True if finished."""
        p = seq.request.params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in seq.request.eos_token_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
                return True
            if token in p.stop_token_ids:
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
                return True
        if seq.detokenizer is not None:
            stop = seq.detokenizer.add_token(token)
            if stop is not None:
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
                return True
        if seq.num_output_tokens >= seq.request.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH
            return True
        return False

    def _beam_step(self, request: Request, logits: torch.Tensor) -> None:
        """Select the next beams of a beam search request (``logits`` rows in
        ``request.seqs`` order): a beam chosen again is forked (blocks shared), a beam not
        chosen is freed."""
        beams = request.seqs
        chosen = request.beam.step(logits.log_softmax(dim=-1),
                                   [b.output_token_ids for b in beams], beams[0].num_tokens)
        continued: set[int] = set()
        next_beams = []
        for parent, token in chosen:  # best first, the order transformers keeps its beams in
            if parent in continued:
                child = self._new_sequence(request, 0, list(beams[parent].token_ids))
                child.status = SequenceStatus.RUNNING
                self.block_manager.fork(beams[parent], child)
                next_beams.append((child, token))
            else:
                continued.add(parent)
                next_beams.append((beams[parent], token))
        for i, beam in enumerate(beams):
            if i not in continued:
                self.block_manager.free(beam)
        for seq, token in next_beams:  # after the forks copied their parents' tokens
            seq.append_token(token)
        self.num_generation_tokens += len(next_beams)
        now = time.time()
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
            self.num_prompt_tokens += len(request.prompt_token_ids)
        request.metrics.last_token_time = now
        request.metrics.num_generation_tokens = max(
            (b.num_output_tokens for b in request.seqs),
            default=request.metrics.num_generation_tokens)
        request.seqs = [seq for seq, _ in next_beams]

    def _record_logprobs(self, seq: Sequence, out: SamplerOutput, i: int) -> None:
        token = seq.token_ids[-1]
        entry = {token: Logprob(out.sampled_logprobs[i], out.sampled_ranks[i],
                                self._decode_token(token))}
        k = seq.request.params.logprobs
        if k and out.top_ids is not None:
            for rank, (tid, lp) in enumerate(zip(out.top_ids[i][:k], out.top_logprobs[i][:k]), 1):
                if tid not in entry:
                    entry[tid] = Logprob(lp, rank, self._decode_token(tid))
        seq.logprobs.append(entry)
        seq.cumulative_logprob += out.sampled_logprobs[i]

    def _record_prompt_logprobs(self, items: list[tuple[Sequence, int, int]],
                                logits: torch.Tensor) -> None:
        """Row r of ``logits`` [rows, vocab] predicts the prompt token after its position."""
        targets = [t for seq, first, count in items
                   for t in seq.request.prompt_token_ids[first + 1:first + 1 + count]]
        logprobs = logits.log_softmax(dim=-1)
        chosen = logprobs.gather(1, torch.tensor(targets, device=logits.device)[:, None])
        ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        k = max(seq.request.params.prompt_logprobs for seq, _, _ in items)
        top = logprobs.topk(k, dim=-1) if k else None
        top_ids = top.indices.tolist() if k else None
        top_lps = top.values.tolist() if k else None
        chosen = chosen[:, 0].tolist()
        row = 0
        for seq, first, count in items:
            request = seq.request
            want = request.params.prompt_logprobs
            for pos in range(first + 1, first + 1 + count):
                token = request.prompt_token_ids[pos]
                entry = {token: Logprob(chosen[row], ranks[row], self._decode_token(token))}
                for rank, tid in enumerate(top_ids[row][:want] if want else (), 1):
                    if tid not in entry:
                        entry[tid] = Logprob(top_lps[row][rank - 1], rank,
                                             self._decode_token(tid))
                request.prompt_logprobs[pos] = entry
                row += 1

    def _decode_token(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _make_output(self, request: Request) -> RequestOutput:
        if request.beam is not None:
            completions = [
                CompletionOutput(index=i, text=self._decode(h.token_ids), token_ids=h.token_ids,
                                 cumulative_logprob=h.cum_logprob, finish_reason="stop"
                                 if h.token_ids[-1:] and h.token_ids[-1] in request.eos_token_ids
                                 else "length")
                for i, h in enumerate(request.beam.finished)]
        else:
            completions = [self._completion(s) for s in request.seqs]
        prompt_logprobs = None
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            prompt_logprobs = list(request.prompt_logprobs)
            # a DELTA stream carries them once, in its first output (as vLLM does)
            request.prompt_logprobs_sent = request.params.output_kind == RequestOutputKind.DELTA
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             completions, request.is_finished,
                             num_cached_tokens=request.num_cached_tokens, metrics=request.metrics,
                             prompt_logprobs=prompt_logprobs)

    def _completion(self, seq: Sequence) -> CompletionOutput:
        token_ids = seq.output_token_ids
        text = seq.detokenizer.stream_text() if seq.detokenizer is not None else ""
        logprobs = seq.logprobs
        if seq.request.params.output_kind == RequestOutputKind.DELTA:
            sent_tokens, sent_chars = seq.delta_offsets
            seq.delta_offsets = (len(token_ids), len(text))
            token_ids, text = token_ids[sent_tokens:], text[sent_chars:]
            logprobs = logprobs[sent_tokens:] if logprobs is not None else None
        return CompletionOutput(
            index=seq.index, text=text, token_ids=list(token_ids),
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason,
        )

    def _check_kv(self) -> None:
        s = self.scheduler
        requests = itertools.chain(s.running, s.waiting, s.swapped)
        seqs = [q for r in requests for q in r.seqs if not q.is_finished]
        self.block_manager.pool.check_invariants([q.block_table for q in seqs])
        if self.block_manager.swap_pool is not None:
            self.block_manager.swap_pool.check_invariants([q.swap_table for q in seqs])

    # ---- introspection --------------------------------------------------------------------

    def kv_cache_stats(self) -> KVCacheStats:
        bm = self.block_manager
        pool = bm.pool
        physical, logical = self._block_steps
        return KVCacheStats(
            num_blocks=pool.num_blocks, block_size=self.cache_config.block_size,
            num_free_blocks=pool.num_free_blocks - pool.num_cached_blocks,
            num_used_blocks=pool.num_used_blocks,
            peak_used_blocks=self.peak_used_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            kv_token_utilization=self.kv_token_utilization,
            kv_bytes_per_token=self.kv_bytes_per_token,
            num_cached_blocks=pool.num_cached_blocks,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            num_swapped_out_blocks=bm.num_swapped_out_blocks,
            num_swapped_in_blocks=bm.num_swapped_in_blocks,
            kv_sharing_saving=1 - physical / logical if logical else 0.0,
            reserved_slot_utilization=(self._slot_steps[0] / self._slot_steps[1]
                                       if self._slot_steps[1] else 0.0),
            reserved_slot_utilization_at_peak=self._peak_reserved[1],
            peak_reserved_slots=self._peak_reserved[0],
            max_num_running=self.max_num_running,
        )


def _derive_seed(seed: int, index: int) -> int:
    """Sequence ``index``'s seed: the request seed itself for 0, else a hash of both, so the
    n sequences of a seeded request draw independent, reproducible streams."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


_MAX_BLOCK_SIZE = 1024


def _check_options(**options: int | None) -> None:
    """Refuse bad engine options before the model is loaded. Raises ValueError."""
    for name, value in options.items():
        if value is None and name in ("max_model_len", "kv_cache_memory", "num_kv_blocks"):
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if options["block_size"] > _MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be at most {_MAX_BLOCK_SIZE}, "
                         f"got {options['block_size']}")


class LLM:
    """Offline batched inference with vLLM's API: ``LLM(...).generate(prompts, params)``.

    Takes the keyword arguments of :class:`LLMEngine`.
    """

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.llm_engine = LLMEngine(model, **kwargs)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def kv_cache_stats(self) -> KVCacheStats:
        return self.llm_engine.kv_cache_stats()

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput each, in input order.

        ``prompts``: strings or ``{"prompt_token_ids": [...]}`` dicts (or one of them).
        ``sampling_params``: one for all prompts or one per prompt (default SamplingParams()).
        Raises ValueError for a bad prompt or parameter; nothing is left queued then.
        """
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, BeamSearchParams) or (
                isinstance(sampling_params, (list, tuple))
                and any(isinstance(p, BeamSearchParams) for p in sampling_params)):
            raise ValueError("BeamSearchParams go to llm.beam_search(), not generate()")
        elif not isinstance(sampling_params, (list, tuple)):
            raise ValueError(f"sampling_params must be SamplingParams or a list of them, "
                             f"got {type(sampling_params).__name__}")
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params")
            if not all(isinstance(p, SamplingParams) for p in params):
                raise ValueError("sampling_params must be SamplingParams objects")
        final = [replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        return self._run(prompts, final, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a
        list of conversations, rendered with the model's chat template."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        conversations = messages if isinstance(messages[0], list) else [messages]
        prompts = []
        for conv in conversations:
            text, ids = self.llm_engine.input_processor.render_chat(
                conv, add_generation_prompt, **(chat_template_kwargs or {}))
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt (beams share KV blocks, copy-on-write); returns each
        prompt's finished beams, best first, in input order. Raises ValueError for bad input."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        prompts = _as_prompt_list(prompts)
        results = []
        for out in self._run(prompts, [params] * len(prompts), use_tqdm):
            results.append(BeamSearchOutput([
                BeamSearchSequence(
                    tokens=out.prompt_token_ids + c.token_ids, text=c.text,
                    cum_logprob=c.cumulative_logprob,
                    score=c.cumulative_logprob / len(c.token_ids) ** params.length_penalty)
                for c in out.outputs]))
        return results

    def _run(self, prompts: list[PromptType], params: list[SamplingParams | BeamSearchParams],
             use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                rid = engine.next_request_id()
                engine.add_request(rid, prompt, p)
                ids.append(rid)
            results: dict[str, RequestOutput] = {}
            pending = set(ids)
            bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                       dynamic_ncols=True)
            t0, out_tokens = time.perf_counter(), 0
            with bar:
                while len(results) < len(ids):
                    for out in engine.step():  # other queued requests step along too
                        if out.finished and out.request_id in pending:
                            pending.discard(out.request_id)
                            results[out.request_id] = out
                            out_tokens += sum(len(c.token_ids) for c in out.outputs)
                            bar.update(1)
                            bar.set_postfix_str(
                                f"output {out_tokens / (time.perf_counter() - t0):.1f} tok/s")
            return [results[i] for i in ids]
        finally:
            engine.abort_request(ids)  # nothing of ours stays queued after an error



def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a dict or a list of them, "
                         f"got {type(prompts).__name__}")
    return list(prompts)


# ---- building one rank's model and KV cache (rank 0 here, ranks > 0 in their workers) ----------

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


def load_model(source, dtype: torch.dtype, device: torch.device, quantization: str | None,
               tp: TPGroup) -> tuple[LlamaForCausalLM, int]:
    """This rank's shard of the model with its weights (quantized if asked); returns it and
    the bytes its weights take."""
    with torch.device("meta"):
        net = LlamaForCausalLM(source.config, tp)
    net = net.to_empty(device=device).to(dtype)
    net.load_weights(source.weights(), str(source.path))
    weight_bytes = 0
    if quantization is not None:
        weight_bytes = quantize_linear_layers(net, quantization)
    weight_bytes += sum(p.numel() * p.element_size() for p in net.parameters())
    net.use_kernels(kernels.load() if device.type == "cpu" else None)
    return net.eval(), weight_bytes


def finish_shard(net: LlamaForCausalLM, shard: ShardOptions, tp: TPGroup) -> KVCache:
    """Give ``net`` its rotary table and allocate this rank's KV cache (its KV heads)."""
    device = next(net.parameters()).device
    net.rotary = RotaryEmbedding(net.config, shard.max_model_len).to(device)
    spec = resolve_kv_cache_dtype(shard.kv_cache_dtype, next(net.parameters()).dtype)
    return KVCache.allocate(local_config(net.config, tp), shard.num_kv_blocks, shard.block_size,
                            spec, device, shard.num_swap_blocks)


def build_worker(shard: ShardOptions, tp: TPGroup) -> ModelRunner:
    """A rank > 0's runner: its model shard and KV cache, on ``cuda:<rank>`` for CUDA."""
    device = resolve_device(shard.device)
    if device.type == "cuda":  # worker_main has made it the current device
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", tp.rank)))
    net, _ = load_model(open_model(shard.model), resolve_dtype(shard.dtype, device), device,
                        shard.quantization, tp)
    return ModelRunner(net, finish_shard(net, shard, tp), device)
