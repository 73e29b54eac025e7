"""The offline API with vLLM's names: ``LLM(...).generate(prompts, params)``, ``chat``,
``beam_search``. It adds every prompt to an LLMEngine and steps it until they finish."""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from pagedserve.engine import LLMEngine
from pagedserve.inputs import PromptType
from pagedserve.outputs import BeamSearchOutput, BeamSearchSequence, KVCacheStats, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    """Offline batched inference with vLLM's API: ``LLM(...).generate(prompts, params)``.

    Takes ``model`` and the keyword options of ``EngineArgs`` (``pagedserve.config``).
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
             chat_template_kwargs: dict[str, Any] | None = None,
             chat_template: str | None = None,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a
        list of conversations, rendered with the model's chat template or ``chat_template``
        (a Jinja template, as transformers takes it; for a model without one).
        ``continue_final_message`` continues the final (assistant) message instead of
        starting a new one (use it with ``add_generation_prompt=False``)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        conversations = messages if isinstance(messages[0], list) else [messages]
        prompts = []
        for conv in conversations:
            kwargs = dict(chat_template_kwargs or {})
            if chat_template is not None:
                kwargs["chat_template"] = chat_template
            if continue_final_message:
                kwargs["continue_final_message"] = True
            text, ids = self.llm_engine.input_processor.render_chat(
                conv, add_generation_prompt, **kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt (beams share KV blocks, copy-on-write); returns each
        prompt's finished beams, best first, in input order. Raises ValueError for bad input,
        RuntimeError if the engine failed on a request."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        prompts = _as_prompt_list(prompts)
        results = []
        for out in self._run(prompts, [params] * len(prompts), use_tqdm):
            if out.error is not None:
                raise RuntimeError(f"beam search of request {out.request_id} failed in the "
                                   f"engine: {out.error}")
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
