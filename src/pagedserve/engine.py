"""LLMEngine: add_request / step / abort_request over one scheduler, one runner, one cache.

One step, one way (vLLM v1's shape):

    sched = scheduler.schedule()                # running, swapped, waiting under one budget
    result = runner.execute(sched)              # block copies, forward, logits
    scheduler.update_from_output(...)           # tokens, forks, beams, stops, frees;
                                                # rejected drafts rolled back
    output_processor.make_output(request)       # detokenized text, logprobs, RequestOutput
    spec.propose(...)                           # speculative decoding: the next drafts

Prompts are validated and tokenized by the InputProcessor before anything is queued; a bad
one raises ValueError in ``add_request``. A failure while handling one request finishes that
request with ``finish_reason="error"`` and frees its blocks; the others go on.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from pagedserve import envs, kernels
from pagedserve.beam_search import BeamSearchState
from pagedserve.config import CacheConfig, EngineArgs, resolve_device, resolve_dtype
from pagedserve.core.block_manager import BlockManager, ContiguousBlockManager, cdiv
from pagedserve.core.block_pool import root_hash
from pagedserve.core.scheduler import Scheduler, SchedulerOutput
from pagedserve.distributed.executor import Driver
from pagedserve.distributed.parallel_state import check_tensor_parallel
from pagedserve.inputs import InputProcessor, PromptType
from pagedserve.kv.quant import resolve_kv_cache_dtype
from pagedserve.loader import open_model
from pagedserve.output_processor import OutputProcessor
from pagedserve.outputs import KVCacheStats, RequestMetrics, RequestOutput
from pagedserve.sampler import Sampler, sample_requests, sequence_seed
from pagedserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedserve.sequence import Request, Sequence
from pagedserve.spec_decode import make_spec_decoder
from pagedserve.stats import EngineStats, StatsTracker
from pagedserve.tokenizer import load_tokenizer
from pagedserve.worker import build_rank0

logger = logging.getLogger("pagedserve")

# A failed forward pass fails only its step's requests; this many in a row mark the engine
# unhealthy (a transient failure should not make an orchestrator restart the server).
MAX_CONSECUTIVE_STEP_FAILURES = 3


class LLMEngine:
    """The serving engine: owns the model, the KV cache, the scheduler and the requests.

    Takes ``model`` and the keyword options of ``EngineArgs`` (their defaults and meanings:
    ``pagedserve.config.EngineArgs``, or ``pagedserve serve --help``). With
    ``tensor_parallel_size`` > 1, call ``shutdown()`` (or let the engine be collected) to stop
    the workers.

    Raises FileNotFoundError or ValueError (ModelLoadError) for a bad model path or file, an
    unknown option or options that do not fit together (naming the numbers); WorkerDiedError
    when a tensor-parallel worker fails to start (or, later from ``step``, dies).
    """

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.args = args = EngineArgs.from_kwargs(model, **kwargs)
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.kv_cache_spec = spec = resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        source = open_model(args.model)
        self.model_path = source.path
        self.model_config = cfg = source.config
        check_tensor_parallel(cfg, args.tensor_parallel_size)  # before the tokenizer's seconds
        self.tokenizer = None if args.skip_tokenizer_init else (
            load_tokenizer(args.tokenizer) if args.tokenizer is not None else source.tokenizer())
        model_limit = cfg.max_position_embeddings
        if args.max_model_len is not None and args.max_model_len > model_limit:
            raise ValueError(f"max_model_len={args.max_model_len} exceeds the model's limit of "
                             f"{model_limit} positions")
        self.driver: Driver | None = None
        if args.tensor_parallel_size > 1:  # workers start importing while rank 0 loads
            self.driver = Driver(args.tensor_parallel_size, spawn=not envs.tp_external())
            self._finalizer = weakref.finalize(self, self.driver.close)
        try:
            self.runner, sizing = build_rank0(args, source, self.device, self.dtype, spec,
                                              model_limit, self.driver)
        except BaseException:
            if self.driver is not None:
                self.driver.close()
            raise
        local = getattr(self.runner, "runner", self.runner)  # rank 0's own under TP
        self.model, self.kv_cache = local.model, local.kv_cache
        self.kv_bytes_per_token = sizing.kv_bytes_per_token
        bs, blocks, max_len = args.block_size, sizing.num_kv_blocks, sizing.max_model_len
        self.cache_config = CacheConfig(bs, blocks, spec.name, sizing.layout.windows)
        self.scheduler_config = args.scheduler_config(max_len)
        rows = self.kv_cache.num_open  # a quantized cache's open-block rows
        if args.kv_allocator == "contiguous":  # the pre-paging baseline, no prefix caching
            self.block_manager = ContiguousBlockManager(blocks, bs, cdiv(max_len, bs), rows)
        else:
            self.block_manager = BlockManager(blocks, bs, args.enable_prefix_caching,
                                              sizing.num_swap_blocks, sizing.layout.windows, rows)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager, args.preemption_mode)
        self.input_processor = InputProcessor(self.tokenizer, cfg.vocab_size,
                                              self.scheduler_config, self.cache_config,
                                              one_sequence=args.kv_allocator == "contiguous")
        self.output_processor = OutputProcessor(self.tokenizer)
        self.spec = make_spec_decoder(args, self)
        self.stats = StatsTracker(self.scheduler, self.block_manager, bs,
                                  self.kv_bytes_per_token, self.kv_cache.layout,
                                  self.cache_config.debug_checks, self.spec)
        self.sampler = Sampler(kernels.load() if self.device.type == "cpu" else None)
        self.generator = torch.Generator(device=self.device).manual_seed(args.seed)
        self.requests = self.scheduler.requests  # every unfinished request, by id
        self._ids, self._seq_ids, self._arrivals = (itertools.count() for _ in range(3))
        self.num_consecutive_step_failures = 0

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | BeamSearchParams | None = None,
                    arrival_time: float | None = None) -> Request:
        """Validate and queue a request. ``prompt`` is a string or a dict with "prompt" and/or
        "prompt_token_ids" and optionally "cache_salt" (requests with different salts never
        share prefix-cache blocks).

        Raises:
            ValueError: a duplicate id; a bad prompt or parameter, checked against the model
                (``InputProcessor``; ``ContextLengthError`` for a prompt or prompt +
                max_tokens beyond max_model_len); a request whose sequences could never fit
                in the KV cache together; stop strings without a tokenizer.
        """
        params = self.input_processor.check_request(request_id, params, arrival_time)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids, salt = self.input_processor.process_prompt(
            prompt, getattr(params, "truncate_prompt_tokens", None))
        max_tokens = self.input_processor.resolve_max_tokens(params, len(ids))
        self.input_processor.check_fits(params, len(ids) + max_tokens)
        beam = isinstance(params, BeamSearchParams)
        request = Request(
            request_id=request_id, prompt=text, prompt_token_ids=ids, params=params,
            max_tokens=max_tokens, eos_token_ids=frozenset(self.model_config.eos_token_ids),
            metrics=RequestMetrics(arrival_time or time.time()), root_hash=root_hash(salt),
            arrival_index=next(self._arrivals))
        request.grammar, request.bad_words_ids = self.input_processor.constraints(params)
        if beam:
            request.beam = BeamSearchState(params, len(ids), request.eos_token_ids)
        elif params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(ids)
        request.seqs.append(self._new_sequence(request, 0, list(ids)))
        self.scheduler.add_request(request)
        return request

    def _new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(next(self._seq_ids), request, index, token_ids)
        if request.grammar is not None:  # n > 1 forks happen before any output token
            seq.matcher = request.grammar.new_matcher()
        self.output_processor.attach(seq)
        seed = getattr(request.params, "seed", None)
        if seed is not None:
            seq.seed = sequence_seed(seed, index)
        return seq

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now and free their blocks. Unknown or finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        elif not isinstance(request_ids, Iterable):
            raise ValueError(f"request_ids must be a string or a list of strings, "
                             f"got {request_ids!r}")
        self.scheduler.abort_requests(list(request_ids))

    def is_healthy(self) -> bool:
        """False once a tensor-parallel worker died or the engine was shut down (noticed
        within a second even while idle), or after MAX_CONSECUTIVE_STEP_FAILURES forward
        passes failed in a row (one success makes it healthy again)."""
        if self.num_consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            return False
        return self.driver is None or self.driver.alive

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (if any); the engine is unusable afterwards."""
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
        step (as its ``output_kind`` asks; beam search requests only when finished). Raises
        only for a broken engine (a dead tensor-parallel worker, a scheduler defect)."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if (self.scheduler.waiting or self.scheduler.swapped) and not sched.preempted:
                # Cannot happen: add_request checked that every request fits an empty cache.
                raise RuntimeError("the scheduler could not run any waiting or swapped request")
            return []
        try:
            result = self.runner.execute(sched)
        except Exception as e:
            if self.driver is not None and not self.driver.alive:
                raise  # the ranks are out of step: nothing more can run
            return self._fail_step(sched, e)
        self.num_consecutive_step_failures = 0
        self.scheduler.update_from_output(sched)
        self.stats.record_step()
        failed: dict[int, Request] = {}

        def fail(request: Request, error: BaseException) -> None:
            self.scheduler.fail_request(request, error)
            failed[id(request)] = request

        if result.prompt_rows:
            self.output_processor.record_prompt_logprobs_per_request(
                result.prompt_rows, result.prompt_logits, fail)
        seqs, logits, first = result.sample_seqs, result.logits, result.first_rows
        rows = self.scheduler.fork_parallel(
            [(s, i) for s, i in zip(seqs, first) if s.request.beam is None and not s.is_finished],
            self._new_sequence, fail)
        samples = sample_requests(  # a sequence's spec_token_ids: the drafts it verifies
            self.sampler, [(s, i, len(s.spec_token_ids)) for s, i in rows if not s.is_finished],
            logits, self.generator, self.model_config.vocab_size, fail)
        if self.spec is not None:  # the rejected drafts roll back before appends
            self.spec.observe(self.scheduler.settle_drafts(seqs, samples))
        self.scheduler.append_sampled(samples, self.output_processor, self.stats, fail)
        self.scheduler.step_beams(seqs, first, logits, self._new_sequence, self.stats, fail)
        touched = {id(s.request): s.request for s in seqs}
        touched.update(failed)  # a request failed before sampling (prompt logprobs) too
        done: list[Request] = []
        outputs = [out for r in touched.values() if (out := self._output(r, fail, done))]
        self.scheduler.finish_requests(done)  # once per step: it rebuilds the queues
        self.stats.finished(outputs)
        if self.spec is not None:  # the next step's drafts
            self.spec.propose(self.scheduler.running, done)
        self.scheduler.observe_step(sched)
        if self.cache_config.debug_checks:
            self.scheduler.check_invariants()
        return outputs

    def _output(self, request: Request, fail, done: list[Request]) -> RequestOutput | None:
        """This step's output of ``request`` (or None); a finished one joins ``done``."""
        if request.error is None:
            try:
                if request.is_finished:
                    out = self.output_processor.make_output(request)
                    request.metrics.finished_time = time.time()
                    done.append(request)
                    return out
                if request.beam is None and \
                        request.params.output_kind != RequestOutputKind.FINAL_ONLY:
                    return self.output_processor.make_output(request)
                return None
            except Exception as e:
                fail(request, e)
        return self.output_processor.error_output(request)

    # ---- failures -------------------------------------------------------------------------

    def _fail_step(self, sched: SchedulerOutput, error: BaseException) -> list[RequestOutput]:
        """The forward pass (or a block copy) failed: finish every request of this step with
        the error (their blocks freed, and their prefix-cache entries of this step dropped:
        those blocks hold no valid K/V)."""
        self.num_consecutive_step_failures += 1
        logger.error("step failed (%d in a row): %s: %s", self.num_consecutive_step_failures,
                     type(error).__name__, error, exc_info=error)
        requests = self.scheduler.requests_of_failed_step(sched)
        for request in requests:
            self.scheduler.fail_request(request, error)
        outputs = [self.output_processor.error_output(r) for r in requests]
        self.stats.finished(outputs)
        if self.cache_config.debug_checks:
            self.scheduler.check_invariants()
        return outputs

    # ---- introspection --------------------------------------------------------------------

    def kv_cache_stats(self) -> KVCacheStats:
        return self.stats.kv_cache_stats()

    def engine_stats(self) -> EngineStats:
        """Gauges, counters, and the first tokens and finished requests since the last call."""
        return self.stats.snapshot()
