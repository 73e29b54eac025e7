"""Output processing: what the engine returns for each request, built outside the core loop.

The OutputProcessor owns everything that turns sampled token ids into what a user reads: the
incremental detokenizer of each sequence (``tokenizer.IncrementalDetokenizer``), stop tokens
and stop strings, sampled and prompt logprobs, and the ``RequestOutput`` of each step
(everything so far, only what is new for DELTA streams, or the final output). It reads request
state and writes only output state (text, logprobs, a sequence's finish status and stop
reason); block frees stay with the scheduler.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampler import SamplerOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.sequence import Request, Sequence, SequenceStatus
from pagedserve.tokenizer import IncrementalDetokenizer


class OutputProcessor:
    """Detokenizes, checks stops, records logprobs and builds RequestOutputs.

    Args:
        tokenizer: a transformers tokenizer, or None (outputs then carry token ids only).
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def attach(self, seq: Sequence) -> None:
        """Give a new sequence its detokenizer and logprob list, as its params ask."""
        params = seq.request.params
        if not isinstance(params, SamplingParams):
            return
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.request.prompt_token_ids, params.stop_strings,
                params.include_stop_str_in_output, params.skip_special_tokens)
        if params.logprobs is not None:
            seq.logprobs = []

    # ---- per sampled token ----------------------------------------------------------------

    def check_stop(self, seq: Sequence, token: int) -> bool:
        """Apply the stop rules in vLLM's order to the token just appended; set status and
        stop_reason. True if the sequence finished (its held-back text is then flushed)."""
        if self._stopped(seq, token):
            if seq.detokenizer is not None and not seq.detokenizer.finished:
                stop = seq.detokenizer.flush()  # held-back text; may complete a stop string
                if stop is not None:
                    seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
            return True
        return False

    def _stopped(self, seq: Sequence, token: int) -> bool:
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
        if seq.matcher is not None and seq.matcher.is_stopped():  # the grammar is complete
            seq.status = SequenceStatus.FINISHED_STOPPED
            return True
        if seq.num_output_tokens >= seq.request.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH
            return True
        return False

    def record_logprobs(self, seq: Sequence, out: SamplerOutput, i: int) -> None:
        """Row ``i`` of ``out``: the sampled token's logprob and rank, and the top-k."""
        token = seq.token_ids[-1]
        entry = {token: Logprob(out.sampled_logprobs[i], out.sampled_ranks[i],
                                self.decode_token(token))}
        k = seq.request.params.logprobs
        if k and out.top_ids is not None:
            for rank, (tid, lp) in enumerate(zip(out.top_ids[i][:k], out.top_logprobs[i][:k]), 1):
                if tid not in entry:
                    entry[tid] = Logprob(lp, rank, self.decode_token(tid))
        seq.logprobs.append(entry)
        seq.cumulative_logprob += out.sampled_logprobs[i]

    def record_prompt_logprobs(self, items: list[tuple[Sequence, int, int]],
                               logits: torch.Tensor) -> None:
        """Row r of ``logits`` [rows, vocab] predicts the prompt token after its position;
        ``items`` are (sequence, first position, rows) in row order."""
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
                entry = {token: Logprob(chosen[row], ranks[row], self.decode_token(token))}
                for rank, tid in enumerate(top_ids[row][:want] if want else (), 1):
                    if tid not in entry:
                        entry[tid] = Logprob(top_lps[row][rank - 1], rank,
                                             self.decode_token(tid))
                request.prompt_logprobs[pos] = entry
                row += 1

    def record_prompt_logprobs_per_request(self, items: list[tuple[Sequence, int, int]],
                                           logits: torch.Tensor, fail) -> None:
        """``record_prompt_logprobs`` for all rows at once; if that raises, for each request
        alone, calling ``fail(request, error)`` for those that still raise."""
        try:
            self.record_prompt_logprobs(items, logits)
            return
        except Exception:
            pass
        row = 0
        for seq, first, count in items:
            try:
                self.record_prompt_logprobs([(seq, first, count)], logits[row:row + count])
            except Exception as e:
                fail(seq.request, e)
            row += count

    def decode_token(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---- RequestOutputs -------------------------------------------------------------------

    def make_output(self, request: Request) -> RequestOutput:
        """The request's output now: all of it, or what is new for a DELTA stream."""
        if request.beam is not None:
            completions = [
                CompletionOutput(index=i, text=self.decode(h.token_ids), token_ids=h.token_ids,
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

    @staticmethod
    def error_output(request: Request) -> RequestOutput:
        """The final output of a failed request: no text, ``finish_reason="error"``."""
        n = len(request.seqs) if request.beam is None else 1
        completions = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="error")
                       for i in range(max(1, n))]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             completions, True, num_cached_tokens=request.num_cached_tokens,
                             metrics=request.metrics, error=request.error)
