"""Batched sampling: penalties, temperature, top-k, top-p, min-p, seeds, logprobs.

One call handles every request that samples this step, greedy and random mixed. Random draws
use the exponential race (argmax of p_i / q_i with q_i ~ Exp(1) samples i with probability
proportional to p_i; no normalisation needed after filtering). A seeded request draws the q of
each token from a generator seeded by its seed, sequence and the token's position, so its
tokens do not depend on its batch-mates, batch position or speculation; unseeded requests
share the engine's generator (seeded by ``LLM(seed=...)``).
Logprobs are taken from the raw model logits (before penalties and temperature), as vLLM does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from pagedserve.sequence import Sequence


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of one step, for ``B`` rows.

    Shapes: ``temperature`` [B] float32 (1.0 on greedy rows); ``greedy`` [B] bool; ``top_k``
    [B] int64 (vocab size where disabled) or None; ``top_p``/``min_p`` [B] float32 or None;
    penalty tensors [B] float32 or None, with ``output_counts`` [B, V] float32 and
    ``prompt_mask`` [B, V] bool; ``banned``: (row, token ids) masked to -inf (min_tokens,
    bad_words); ``bias``: (row, ids [k] int64, biases [k] float32) added (logit_bias);
    ``allowed``: (rows, [len(rows), V] bool) the tokens a grammar (structured outputs) and
    ``allowed_token_ids`` leave to those rows.
    """

    temperature: torch.Tensor
    greedy: torch.Tensor
    all_greedy: bool
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    presence_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    output_counts: torch.Tensor | None
    prompt_mask: torch.Tensor | None
    banned: list[tuple[int, list[int]]]
    max_num_logprobs: int | None
    bias: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    allowed: tuple[list[int], torch.Tensor] | None = None


@dataclass
class SamplerOutput:
    """``token_ids`` [B] sampled tokens; with logprobs requested: ``sampled_logprobs`` [B],
    ``sampled_ranks`` [B] (1 = most likely), ``top_ids``/``top_logprobs`` [B][k]."""

    token_ids: list[int]
    sampled_logprobs: list[float] | None = None
    sampled_ranks: list[int] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    accepted: list[bool] | None = None  # with drafts: whether row i's draft was accepted

    def select(self, rows: list[int]) -> SamplerOutput:
        """The output of ``rows`` only, in that order."""
        def pick(values):
            return None if values is None else [values[i] for i in rows]
        return SamplerOutput(pick(self.token_ids), pick(self.sampled_logprobs),
                             pick(self.sampled_ranks), pick(self.top_ids),
                             pick(self.top_logprobs), pick(self.accepted))


def build_sampling_metadata(seqs: list[Sequence], vocab_size: int,
                            device: torch.device) -> SamplingMetadata:
    """Tensors for the rows of ``seqs`` (one row each, in order)."""
    params = [s.request.params for s in seqs]
    b = len(params)
    greedy = [p.is_greedy for p in params]

    def tensor(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=device)

    top_k = top_p = min_p = None
    if any(p.top_k > 0 and not g for p, g in zip(params, greedy)):
        top_k = tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], torch.int64)
    if any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)):
        top_p = tensor([p.top_p for p in params])
    if any(p.min_p > 0.0 and not g for p, g in zip(params, greedy)):
        min_p = tensor([p.min_p for p in params])
    presence = frequency = repetition = counts = prompt_mask = None
    if any(p.has_penalties for p in params):
        presence = tensor([p.presence_penalty for p in params])
        frequency = tensor([p.frequency_penalty for p in params])
        repetition = tensor([p.repetition_penalty for p in params])
        counts = torch.zeros(b, vocab_size, device=device)
        prompt_mask = torch.zeros(b, vocab_size, dtype=torch.bool, device=device)
        for i, (seq, p) in enumerate(zip(seqs, params)):
            if not p.has_penalties:
                continue
            out = seq.output_token_ids
            if out:
                counts[i].index_add_(0, tensor(out, torch.int64), torch.ones(len(out), device=device))
            prompt_mask[i, tensor(seq.request.prompt_token_ids, torch.int64)] = True
    banned = []
    for i, (seq, p) in enumerate(zip(seqs, params)):
        ids = []
        if seq.num_output_tokens < p.min_tokens:
            ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(seq.request.eos_token_ids))
        if seq.request.bad_words_ids:
            ids += bad_word_ends(seq.request.bad_words_ids, seq.output_token_ids)
        if ids:
            banned.append((i, ids))
    bias = [(i, tensor(list(p.logit_bias), torch.int64), tensor(list(p.logit_bias.values())))
            for i, p in enumerate(params) if p.logit_bias]
    logprobs = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        # NOTE: capped so float32 keeps it finite (-inf / inf would be NaN); the distribution
        # at 1e6 is already uniform over the surviving tokens.
        temperature=tensor([1.0 if g else min(p.temperature, 1e6) for p, g in zip(params, greedy)]),
        greedy=tensor(greedy, torch.bool),
        all_greedy=all(greedy),
        top_k=top_k, top_p=top_p, min_p=min_p,
        generators={i: position_generator(seq.seed, seq.num_tokens, device)
                    for i, seq in enumerate(seqs) if seq.seed is not None and not greedy[i]},
        presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
        output_counts=counts, prompt_mask=prompt_mask,
        banned=banned, bias=bias, allowed=allowed_tokens(seqs, vocab_size, device),
        max_num_logprobs=max(logprobs) if logprobs else None,
    )


def bad_word_ends(words: list[list[int]], output: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens end ``output`` (a one-token word is
    always banned), as vLLM's bad_words."""
    return [w[-1] for w in words
            if len(w) == 1 or (len(output) >= len(w) - 1 and output[len(output) - len(w) + 1:]
                               == w[:-1])]


def allowed_tokens(seqs: list[Sequence], vocab_size: int, device: torch.device
                   ) -> tuple[list[int], torch.Tensor] | None:
    """(rows, bool [len(rows), V]) for the rows restricted by a grammar (structured outputs)
    or ``allowed_token_ids``, or None when no row is: the other rows are never touched."""
    rows = [i for i, s in enumerate(seqs)
            if s.matcher is not None or s.request.params.allowed_token_ids is not None]
    if not rows:
        return None
    mask = torch.ones(len(rows), vocab_size, dtype=torch.bool, device=device)
    grammar_rows = [j for j, i in enumerate(rows) if seqs[i].matcher is not None]
    if grammar_rows:
        from pagedserve.structured import fill_allowed

        matchers = [seqs[rows[j]].matcher for j in grammar_rows]
        mask[grammar_rows] = fill_allowed(matchers, vocab_size, device)
        for m in matchers:  # a limit of the grammar engine hit at run time
            if m.is_error():
                raise ValueError(f"the grammar failed: {m.get_error()[:300]}")
    for j, i in enumerate(rows):
        ids = seqs[i].request.params.allowed_token_ids
        if ids is not None:
            only = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            only[torch.tensor(ids, dtype=torch.int64, device=device)] = True
            mask[j] &= only
    return rows, mask


def restrict(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """logit_bias, then the allowed tokens (grammar, allowed_token_ids), then the banned ones
    (min_tokens, bad_words), in place on logits [B, V] float32. A restricted row whose every
    allowed token is banned keeps its allowed tokens: a grammar that can only end now ends
    (it wins over min_tokens), rather than sampling from nothing."""
    for row, ids, values in md.bias:
        logits[row, ids] += values
    restricted: set[int] = set()
    if md.allowed is not None:
        rows, allowed = md.allowed
        if not bool(allowed.any(dim=1).all()):
            raise ValueError("no token can be generated: the grammar (in an error state, or "
                             "with allowed_token_ids) allows none")
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
        restricted.update(rows)
    for row, ids in md.banned:
        kept = logits[row].clone() if row in restricted else None
        logits[row, ids] = float("-inf")
        if kept is not None and not bool(torch.isfinite(logits[row]).any()):
            logits[row] = kept
    return logits


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (CTRL, Keskar et al. 2019: positive
    logits divided, negative multiplied), then OpenAI's frequency and presence penalties over
    output tokens. logits [B, V] float32, modified in place and returned."""
    seen = md.prompt_mask | (md.output_counts > 0)
    rep = md.repetition_penalty[:, None].expand_as(logits)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits -= md.frequency_penalty[:, None] * md.output_counts
    logits -= md.presence_penalty[:, None] * (md.output_counts > 0).float()
    return logits


def _filter(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Temperature, then top-k and top-p (nucleus, Holtzman et al. 2020) masking to -inf.
    Returns probabilities [B, V] (unnormalised after min-p masking)."""
    logits = logits / md.temperature[:, None]
    if md.top_k is not None or md.top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if md.top_k is not None:
            ranks = torch.arange(logits.shape[-1], device=logits.device)
            remove |= ranks[None, :] >= md.top_k[:, None]
        if md.top_p is not None:
            probs = sorted_logits.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            remove |= mass_before >= md.top_p[:, None]
        remove[:, 0] = False  # the most likely token always survives (top_p may round to 0)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(remove, float("-inf")))
    probs = logits.softmax(dim=-1)
    if md.min_p is not None:
        threshold = md.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


class Sampler:
    """Picks one token per row from logits [B, V] float32. ``ops``: the fused CPU kernels
    (pagedserve.kernels), whose argmax replaces torch's scalar one for CPU logits."""

    def __init__(self, ops=None):
        self.ops = ops

    def _argmax(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.device.type == "cpu":
            return self.ops.argmax(x)
        return x.argmax(dim=-1)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata,
                 generator: torch.Generator, draft_ids: list[int] | None = None
                 ) -> SamplerOutput:
        """One token per row. With ``draft_ids`` [B] (a draft token per row, -1 for none;
        speculative decoding), ``accepted`` says which rows sampled exactly their draft.
        That is speculative sampling (Leviathan et al., ICML 2023, sec. 2.3; Chen et al.,
        2023) for a deterministic draft d (q one-hot): the draft is accepted with
        probability p(d) = min(1, p(d) / q(d)), and a rejected row's token follows p without
        d, renormalized: the residual max(0, p - q). The row's token is the one it samples
        without a draft, so a seeded request's tokens do not change with speculation."""
        raw_logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
        if md.banned or md.bias or md.allowed is not None:
            logits = restrict(logits.clone(), md)
        if md.output_counts is not None:
            logits = apply_penalties(logits, md)
        sampled = self._argmax(logits)
        if not md.all_greedy:
            probs = _filter(logits, md)
            q = torch.empty_like(probs).exponential_(generator=generator)
            for row, gen in md.generators.items():
                q[row].exponential_(generator=gen)
            # q == 0 happens (float rounding); clamping keeps p = 0 rows at 0 instead of NaN.
            random = self._argmax(probs.div_(q.clamp_min_(1e-10)))
            sampled = torch.where(md.greedy, sampled, random)
        accepted = None
        if draft_ids is not None:
            accepted = (sampled == torch.tensor(draft_ids, dtype=torch.int64,
                                                device=sampled.device)).tolist()
        out = SamplerOutput(token_ids=sampled.tolist(), accepted=accepted)
        if raw_logprobs is not None:
            chosen = raw_logprobs.gather(1, sampled[:, None])
            out.sampled_logprobs = chosen[:, 0].tolist()
            out.sampled_ranks = ((raw_logprobs > chosen).sum(dim=-1) + 1).tolist()
            if md.max_num_logprobs > 0:
                top = raw_logprobs.topk(md.max_num_logprobs, dim=-1)
                out.top_ids, out.top_logprobs = top.indices.tolist(), top.values.tolist()
        return out


class SampledRows(NamedTuple):
    """Sequences with their rows of the logits, and the sampler's output for them (row j of
    ``output`` is ``rows[j]``)."""

    rows: list[tuple[Sequence, int]]
    output: SamplerOutput


def sample_requests(sampler: Sampler, rows: list[tuple[Sequence, int, int]],
                    logits: torch.Tensor, generator: torch.Generator, vocab_size: int,
                    fail) -> list[SampledRows]:
    """Sample ``rows`` (sequence, its row of ``logits`` [B, vocab], drafts it verifies: 0
    unless speculating, see spec_decode/verify.py) in one batch. Each returned entry is a
    token a sequence appends (several for accepted drafts). If the batch raises, each
    request's rows are sampled alone, and ``fail(request, error)`` is called for the requests
    that still raise, so one request's failure is its own."""
    if not rows:
        return []
    try:
        return [_sample_rows(sampler, rows, logits, generator, vocab_size)]
    except Exception:
        pass
    groups: dict[int, list[tuple[Sequence, int, int]]] = {}
    for row in rows:
        groups.setdefault(id(row[0].request), []).append(row)
    results = []
    for group in groups.values():
        try:
            results.append(_sample_rows(sampler, group, logits, generator, vocab_size))
        except Exception as e:
            fail(group[0][0].request, e)
    return results


def _sample_rows(sampler: Sampler, rows: list[tuple[Sequence, int, int]], logits: torch.Tensor,
                 generator: torch.Generator, vocab_size: int) -> SampledRows:
    if any(k for _, _, k in rows):
        from pagedserve.spec_decode.verify import sample_with_drafts

        return sample_with_drafts(sampler, rows, logits, generator, vocab_size)
    seqs = [s for s, _, _ in rows]
    index = [i for _, i, _ in rows]
    smd = build_sampling_metadata(seqs, vocab_size, logits.device)
    if index != list(range(logits.shape[0])):  # a copy of [B, vocab] only if needed
        logits = logits[index]
    return SampledRows([(s, i) for s, i, _ in rows], sampler(logits, smd, generator))


def sequence_seed(seed: int, index: int) -> int:
    """The seed of sequence ``index`` of a request seeded with ``seed``: a hash of both, so the
    n sequences of a seeded request draw independent, reproducible streams, and distinct
    seeds anywhere in [-2**63, 2**64) distinct ones (torch's generator keeps 63 bits, so 0 and
    2**63 would otherwise collide)."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def position_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    """The generator of the token at ``position`` of a sequence with ``seed``
    (sequence_seed): each token's randomness depends on its position only, not on how many
    draws came before, so a seeded sequence samples the same tokens whatever its batch,
    chunking, preemption or speculation."""
    digest = hashlib.sha256(f"{seed}@{position}".encode()).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return generator
