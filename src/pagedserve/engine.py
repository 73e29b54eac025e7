"""LLMEngine (add_request / step / abort_request) and the offline ``LLM`` API on top of it.

One step = schedule -> run the model -> sample -> update requests (detokenize, stop checks) ->
free the blocks of finished requests. Bad input is refused in ``add_request`` with a
ValueError before anything is queued, so the engine keeps serving the other requests.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch
from tqdm.auto import tqdm

from pagedserve.config import CacheConfig, SchedulerConfig, resolve_device, resolve_dtype
from pagedserve.core.block_manager import BlockManager, cdiv
from pagedserve.core.scheduler import Scheduler
from pagedserve.kv.cache import KVCache, default_kv_cache_memory, num_blocks_for_memory
from pagedserve.loader import open_model
from pagedserve.model.layers import RotaryEmbedding
from pagedserve.model.llama import LlamaForCausalLM
from pagedserve.outputs import (
    CompletionOutput,
    KVCacheStats,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from pagedserve.runner import ModelRunner
from pagedserve.sampler import SamplerOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.sequence import Request, RequestStatus
from pagedserve.tokenizer import (
    IncrementalDetokenizer,
    apply_chat_template,
    encode,
    load_tokenizer,
)

logger = logging.getLogger("pagedserve")

PromptType = str | dict[str, Any]


class LLMEngine:
    """The serving engine: owns the model, the KV cache, the scheduler and the requests.

    Args:
        model: a GGUF file, an HF directory, or None for SmolLM2-135M-Instruct.
        tokenizer: tokenizer directory overriding the model's own.
        dtype: "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "bfloat16", "float16".
        device: "auto", "cpu", "cuda" or "cuda:N".
        block_size: token slots per KV block.
        max_model_len: longest prompt + output; default min(model's limit, KV capacity).
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: most tokens computed in one step (prefill chunks + decodes).
        kv_cache_memory: KV cache bytes; default see ``pagedserve.kv.cache``.
        num_kv_blocks: exact number of KV blocks (overrides kv_cache_memory).
        seed: seed of the generator that unseeded random requests share.
        skip_tokenizer_init: run without a tokenizer (prompts as token ids, no text output).
    Raises:
        FileNotFoundError, ValueError (ModelLoadError): bad model path or file, or options
        that do not fit together (the message names the numbers).
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None,
                 dtype: str | torch.dtype = "auto", device: str = "auto", block_size: int = 16,
                 max_model_len: int | None = None, max_num_seqs: int = 128,
                 max_num_batched_tokens: int = 512, kv_cache_memory: int | None = None,
                 num_kv_blocks: int | None = None, seed: int = 0,
                 skip_tokenizer_init: bool = False):
        _check_options(block_size=block_size, max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       kv_cache_memory=kv_cache_memory, num_kv_blocks=num_kv_blocks)
        if not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < 2**64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {seed!r}")
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise ValueError(f"model must be a path or None, got {model!r}")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        source = open_model(model)
        self.model_path = source.path
        self.model_config = cfg = source.config
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

        t0 = time.perf_counter()
        with torch.device("meta"):
            net = LlamaForCausalLM(cfg)
        net = net.to_empty(device=self.device).to(self.dtype)
        net.load_weights(source.weights(), str(source.path))
        self.model = net.eval()
        weight_bytes = sum(p.numel() * p.element_size() for p in net.parameters())

        kv_bytes_per_token = cfg.kv_bytes_per_token(self.dtype)
        if num_kv_blocks is None:
            if kv_cache_memory is None:
                kv_cache_memory = default_kv_cache_memory(self.device)
            num_kv_blocks = num_blocks_for_memory(kv_cache_memory, cfg, block_size, self.dtype)
            if num_kv_blocks < 1:
                raise ValueError(f"kv_cache_memory={kv_cache_memory} bytes holds no block of "
                                 f"{kv_bytes_per_token * block_size} bytes")
        capacity = num_kv_blocks * block_size
        if max_model_len is None:
            max_model_len = min(model_limit, capacity)
        elif max_model_len > capacity:
            raise ValueError(
                f"max_model_len={max_model_len} needs {cdiv(max_model_len, block_size)} KV blocks "
                f"but the cache has {num_kv_blocks}; lower max_model_len or raise kv_cache_memory")
        self.cache_config = CacheConfig(block_size, num_kv_blocks, self.dtype)
        self.scheduler_config = SchedulerConfig(max_num_seqs, max_num_batched_tokens,
                                                max_model_len)
        self.model.rotary = RotaryEmbedding(cfg, max_model_len).to(self.device)
        self.kv_cache = KVCache.allocate(cfg, num_kv_blocks, block_size, self.dtype, self.device)
        self.block_manager = BlockManager(num_kv_blocks, block_size)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, seed)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.peak_used_blocks = 0
        self.kv_token_utilization = 0.0

        logger.info(
            "model %s (%s, %d layers, %d/%d query/KV heads, head_dim %d): %.1f MB of %s weights "
            "on %s, loaded in %.1fs", source.path.name, cfg.architecture, cfg.num_hidden_layers,
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, weight_bytes / 1e6,
            str(self.dtype).removeprefix("torch."), self.device, time.perf_counter() - t0)
        logger.info(
            "KV cache: %d bytes per token, %d blocks of %d tokens (%.2f GiB), capacity %d tokens, "
            "max concurrency %.2fx at max_model_len=%d", kv_bytes_per_token, num_kv_blocks,
            block_size, self.kv_cache.nbytes / 2**30, capacity, capacity / max_model_len,
            max_model_len)

    # ---- requests -------------------------------------------------------------------------

    def _prompt_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                        isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" not in prompt:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError("the engine runs without a tokenizer: pass prompt_token_ids")
        return prompt, encode(self.tokenizer, prompt)

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None, arrival_time: float | None = None
                    ) -> Request:
        """Validate and queue a request.

        Raises:
            ValueError: duplicate id; empty prompt; token id outside the vocabulary; prompt
                longer than max_model_len, or prompt + max_tokens beyond it (the message
                states the numbers); stop strings without a tokenizer.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._prompt_token_ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        max_len = self.scheduler_config.max_model_len
        if len(ids) > max_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than "
                             f"max_model_len={max_len}")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max_len - len(ids)
            if max_tokens < 1:
                raise ValueError(f"the prompt has {len(ids)} tokens, which leaves no room to "
                                 f"generate within max_model_len={max_len}")
        elif len(ids) + max_tokens > max_len:
            raise ValueError(f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) is "
                             f"{len(ids) + max_tokens} tokens, more than max_model_len={max_len}")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop_strings,
                                           params.include_stop_str_in_output,
                                           params.skip_special_tokens)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        request = Request(
            request_id=request_id, prompt=text, prompt_token_ids=ids, sampling_params=params,
            max_tokens=max_tokens, eos_token_ids=frozenset(self.model_config.eos_token_ids),
            metrics=RequestMetrics(arrival_time or time.time()),
            detokenizer=detok, generator=generator,
        )
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now and free their blocks. Unknown or finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        elif not isinstance(request_ids, Iterable):
            raise ValueError(f"request_ids must be a string or a list of strings, "
                             f"got {request_ids!r}")
        aborted = [self.requests.pop(i) for i in request_ids if i in self.requests]
        for r in aborted:
            r.status = RequestStatus.FINISHED_ABORTED
            r.metrics.finished_time = time.time()
        self.scheduler.finish_requests(aborted)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def next_request_id(self) -> str:
        """A request id not in use."""
        while (rid := str(next(self._ids))) in self.requests:
            pass
        return rid

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration. Returns an output for each request that produced something this
        step (as its ``output_kind`` asks), finished ones included."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.waiting and not sched.preempted:
                # Cannot happen: a request of max_model_len tokens fits in an empty cache.
                raise RuntimeError("the scheduler could not admit any waiting request")
            return []
        now = time.time()
        for r, _ in sched.scheduled:
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = now
        sampled_reqs, sampler_out = self.runner.execute(sched)
        for r, n in sched.scheduled:
            r.num_computed_tokens += n
        self._track_usage()
        finished = self._process_samples(sampled_reqs, sampler_out) if sampler_out else []
        outputs = [self._make_output(r) for r in sampled_reqs
                   if r.is_finished or r.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY]
        for r in finished:
            del self.requests[r.request_id]
        self.scheduler.finish_requests(finished)
        if self.cache_config.debug_checks:
            self._check_kv()
        return outputs

    def _track_usage(self) -> None:
        used = self.block_manager.pool.num_used_blocks
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used
            tokens = sum(r.num_computed_tokens for r in self.scheduler.running)
            self.kv_token_utilization = tokens / (used * self.cache_config.block_size)

    def _process_samples(self, requests: list[Request], out: SamplerOutput) -> list[Request]:
        now = time.time()
        finished = []
        for i, (r, token) in enumerate(zip(requests, out.token_ids)):
            if r.metrics.first_token_time is None:
                r.metrics.first_token_time = now
            r.metrics.last_token_time = now
            r.append_token(token)
            if out.sampled_logprobs is not None and r.logprobs is not None:
                self._record_logprobs(r, out, i)
            if self._check_stop(r, token):
                if r.detokenizer is not None and not r.detokenizer.finished:
                    stop = r.detokenizer.flush()  # held-back text; may complete a stop string
                    if stop is not None:
                        r.status, r.stop_reason = RequestStatus.FINISHED_STOPPED, stop
                r.metrics.finished_time = now
                finished.append(r)
        return finished

    def _check_stop(self, r: Request, token: int) -> bool:
        """Apply the stop rules in vLLM's order; set status/stop_reason. True if finished."""
        p = r.sampling_params
        if r.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in r.eos_token_ids:
                r.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in p.stop_token_ids:
                r.status, r.stop_reason = RequestStatus.FINISHED_STOPPED, token
                return True
        if r.detokenizer is not None:
            stop = r.detokenizer.add_token(token)
            if stop is not None:
                r.status, r.stop_reason = RequestStatus.FINISHED_STOPPED, stop
                return True
        if r.num_output_tokens >= r.max_tokens:
            r.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _record_logprobs(self, r: Request, out: SamplerOutput, i: int) -> None:
        token = r.token_ids[-1]
        entry = {token: Logprob(out.sampled_logprobs[i], out.sampled_ranks[i],
                                self._decode_token(token))}
        k = r.sampling_params.logprobs
        if k and out.top_ids is not None:
            for rank, (tid, lp) in enumerate(zip(out.top_ids[i][:k], out.top_logprobs[i][:k]), 1):
                if tid not in entry:
                    entry[tid] = Logprob(lp, rank, self._decode_token(tid))
        r.logprobs.append(entry)
        r.cumulative_logprob += out.sampled_logprobs[i]

    def _decode_token(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _make_output(self, r: Request) -> RequestOutput:
        kind = r.sampling_params.output_kind
        token_ids = r.output_token_ids
        text = r.detokenizer.stream_text() if r.detokenizer is not None else ""
        logprobs = r.logprobs
        if kind == RequestOutputKind.DELTA:
            sent_tokens, sent_chars = r.delta_offsets
            r.delta_offsets = (len(token_ids), len(text))
            token_ids, text = token_ids[sent_tokens:], text[sent_chars:]
            logprobs = logprobs[sent_tokens:] if logprobs is not None else None
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(token_ids),
            cumulative_logprob=r.cumulative_logprob if r.logprobs is not None else None,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=r.status.finish_reason, stop_reason=r.stop_reason,
        )
        return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, [completion],
                             r.is_finished, num_cached_tokens=0, metrics=r.metrics)

    def _check_kv(self) -> None:
        s = self.scheduler
        self.block_manager.pool.check_invariants(
            [r.block_table for r in itertools.chain(s.running, s.waiting)])

    # ---- introspection --------------------------------------------------------------------

    def kv_cache_stats(self) -> KVCacheStats:
        pool = self.block_manager.pool
        return KVCacheStats(
            num_blocks=pool.num_blocks, block_size=self.cache_config.block_size,
            num_free_blocks=pool.num_free_blocks, num_used_blocks=pool.num_used_blocks,
            peak_used_blocks=self.peak_used_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            kv_token_utilization=self.kv_token_utilization,
            kv_bytes_per_token=self.model_config.kv_bytes_per_token(self.dtype),
        )


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

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput each, in input order.

        ``prompts``: strings or ``{"prompt_token_ids": [...]}`` dicts (or one of them).
        ``sampling_params``: one for all prompts or one per prompt (default SamplingParams()).
        Raises ValueError for a bad prompt or parameter; nothing is left queued then.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a dict or a list of them, "
                             f"got {type(prompts).__name__}")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params")
            if not all(isinstance(p, SamplingParams) for p in params):
                raise ValueError("sampling_params must be SamplingParams objects")
        final = [replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        return self._run(prompts, final, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a
        list of conversations, rendered with the model's chat template."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        conversations = messages if isinstance(messages[0], list) else [messages]
        prompts = []
        for conv in conversations:
            text, ids = apply_chat_template(tokenizer, conv, add_generation_prompt,
                                            **(chat_template_kwargs or {}))
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list[PromptType], params: list[SamplingParams],
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
                            out_tokens += len(out.outputs[0].token_ids)
                            bar.update(1)
                            bar.set_postfix_str(
                                f"output {out_tokens / (time.perf_counter() - t0):.1f} tok/s")
            return [results[i] for i in ids]
        finally:
            engine.abort_request(ids)  # nothing of ours stays queued after an error

