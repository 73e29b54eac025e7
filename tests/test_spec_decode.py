"""Speculative decoding: greedy outputs equal the plain run's token for token with every
drafter (ngram, suffix, a draft model, and an oracle that mixes right and wrong drafts) under
chunk budgets, prefix hits, preemption, quantized and sliding-window caches, stops, logprobs,
penalties and grammars; rejected drafts' blocks return the same step; the acceptance rule
keeps the target's distribution (chi-square tests); options are checked."""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import TINY_VOCAB, make_sequence, save_tiny_model, shared_prefix_workload

from pagedserve import LLM, SamplingParams
from pagedserve.config import SpeculativeConfig
from pagedserve.sampling_params import StructuredOutputsParams

# tiny models: every sequence speculates, whatever the batch
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 0}


def tokens(outs):
    return [c.token_ids for o in outs for c in o.outputs]


class Oracle:
    """Drafts from known full sequences (prompt + the plain run's output): right tokens,
    except every ``every``-th position (counted from the sequence's start), which is wrong.
    Every acceptance length happens, rollbacks included; unknown sequences get no drafts."""

    def __init__(self, full: list[list[int]], every: int = 5):
        self.full, self.every = full, every
        self.calls = 0

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        self.calls += 1
        n = len(token_ids)
        for seq in self.full:
            if seq[:n] == token_ids:
                return [(t + 1) % TINY_VOCAB if (n + j) % self.every == 0 else t
                        for j, t in enumerate(seq[n:n + k])]
        return []


def with_oracle(llm: LLM, refs: list[list[int]], prompts, every: int = 5) -> Oracle:
    full = [list(p["prompt_token_ids"]) + r for p, r in zip(prompts, refs)]
    oracle = Oracle(full, every)
    llm.llm_engine.spec.proposer = oracle
    return oracle


@pytest.fixture(scope="module")
def workload():
    return shared_prefix_workload(10, 30)


@pytest.fixture(scope="module")
def reference(tiny_llama, workload):
    prompts, params = workload
    llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4)
    return tokens(llm.generate(prompts, params, use_tqdm=False))


@pytest.mark.parametrize("method", ["ngram", "suffix", "oracle"])
@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_tokens_are_the_plain_runs(tiny_llama, workload, reference, method, k):
    prompts, params = workload
    # blocks of 4 and a budget of 16 tokens: drafts span blocks and are cut by the budget
    llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4,
              max_num_batched_tokens=16, speculative_config={
                  "method": "ngram" if method == "oracle" else method,
                  "num_speculative_tokens": k, "disable_by_batch_size": 0})
    if method == "oracle":
        with_oracle(llm, reference, prompts)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == reference
    stats = llm.llm_engine.spec.stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    # prefix hits on the second run, which drafts the same way
    again = tokens(llm.generate(prompts, params, use_tqdm=False))
    assert again == reference and llm.kv_cache_stats().prefix_cache_hits > 0


@pytest.mark.parametrize("method", ["ngram", "suffix", "oracle"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_tenth_of_the_pool_preempts_and_keeps_the_tokens(tiny_llama, workload, reference,
                                                          mode, method):
    prompts, params = workload
    need = sum(math.ceil((len(p["prompt_token_ids"]) + q.max_tokens) / 4)
               for p, q in zip(prompts, params))
    # a tenth of the demand, or the longest request alone if that is more (29 blocks)
    llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=max(need // 10, 30),
              block_size=4, preemption_mode=mode, swap_space=0.01,
              speculative_config={**NGRAM, "method": "ngram" if method == "oracle" else method})
    if method == "oracle":
        with_oracle(llm, reference, prompts, every=3)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == reference
    assert llm.kv_cache_stats().num_preemptions > 0
    assert llm.llm_engine.spec.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_quantized_cache_drafts_stay_in_the_open_block(tiny_llama, workload, kv_cache_dtype):
    prompts, params = workload
    kw = dict(skip_tokenizer_init=True, num_kv_blocks=512, block_size=4,
              kv_cache_dtype=kv_cache_dtype)
    ref = tokens(LLM(tiny_llama, **kw).generate(prompts, params, use_tqdm=False))
    llm = LLM(tiny_llama, max_num_batched_tokens=16, speculative_config=NGRAM, **kw)
    with_oracle(llm, ref, prompts)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == ref
    assert llm.llm_engine.spec.stats.num_accepted_tokens > 0


def test_sliding_window_groups_slide_after_the_rollback(tiny_gemma3):
    # windows of 8 positions, blocks of 4: rejected drafts run past the window
    prompts, params = shared_prefix_workload(6, 40)
    kw = dict(skip_tokenizer_init=True, num_kv_blocks=600, block_size=4)
    ref = tokens(LLM(tiny_gemma3, **kw).generate(prompts, params, use_tqdm=False))
    llm = LLM(tiny_gemma3, speculative_config={**NGRAM, "num_speculative_tokens": 8}, **kw)
    with_oracle(llm, ref, prompts, every=7)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == ref
    assert llm.llm_engine.spec.stats.num_accepted_tokens > 0


def test_draft_model(tiny_llama, tmp_path, workload, reference):
    prompts, params = workload
    other = save_tiny_model(tmp_path / "draft", "llama", num_hidden_layers=1)
    for draft, all_accepted in ((other, False), (tiny_llama, True)):
        llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4,
                  speculative_config={"model": draft, "num_speculative_tokens": 3,
                                      "disable_by_batch_size": 0})
        assert tokens(llm.generate(prompts, params, use_tqdm=False)) == reference
        stats = llm.llm_engine.spec.stats
        assert stats.num_drafts > 0
        if all_accepted:  # the target drafting for itself: its own greedy tokens
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert not llm.llm_engine.spec.proposer.mirrors  # every mirror freed at the end
        assert llm.llm_engine.spec.proposer.blocks.num_free_blocks == \
            llm.llm_engine.spec.proposer.blocks.pool.num_blocks


def test_stops_logprobs_and_penalties_match_the_plain_run(tiny_llama):
    prompts = ["Once upon a time", "The quick brown fox", "Paging splits"]
    cases = [
        SamplingParams(temperature=0, max_tokens=40),  # EOS may come from an accepted draft
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["e "]),
        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, min_tokens=20,
                       repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
        SamplingParams(temperature=0, max_tokens=25, bad_words=["the"], min_tokens=10),
    ]
    plain = LLM(tiny_llama, num_kv_blocks=512, block_size=4)
    spec = LLM(tiny_llama, num_kv_blocks=512, block_size=4, speculative_config=NGRAM)
    for params in cases:
        ref = plain.generate(prompts, params, use_tqdm=False)
        refs = [c.token_ids for o in ref for c in o.outputs]
        oracle = with_oracle(spec, refs, [{"prompt_token_ids": o.prompt_token_ids} for o in ref],
                             every=4)
        outs = spec.generate(prompts, params, use_tqdm=False)
        assert oracle.calls > 0
        for a, b in zip(outs, ref):
            ca, cb = a.outputs[0], b.outputs[0]
            assert (ca.token_ids, ca.text, ca.finish_reason, ca.stop_reason) == \
                (cb.token_ids, cb.text, cb.finish_reason, cb.stop_reason), params
            if params.logprobs:
                for x, y in zip(ca.logprobs, cb.logprobs):
                    assert x.keys() == y.keys()
                    assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert spec.llm_engine.spec.stats.num_accepted_tokens > 0


def test_grammar_constrained_drafts(tiny_llama):
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=schema))
    prompts = ["JSON:", "Hello", "The answer is"]
    plain = LLM(tiny_llama, num_kv_blocks=512, block_size=4)
    ref = plain.generate(prompts, params, use_tqdm=False)
    spec = LLM(tiny_llama, num_kv_blocks=512, block_size=4, speculative_config=NGRAM)
    with_oracle(spec, [o.outputs[0].token_ids for o in ref],
                [{"prompt_token_ids": o.prompt_token_ids} for o in ref], every=3)
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ref]
    assert spec.llm_engine.spec.stats.num_accepted_tokens > 0


def test_rejected_drafts_blocks_return_in_the_same_step(tiny_llama):
    llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=64, block_size=4,
              speculative_config={**NGRAM, "num_speculative_tokens": 8})
    engine = llm.llm_engine
    prompt = [(7 * j + 3) % 300 + 3 for j in range(10)]
    engine.spec.proposer = Oracle([], every=1)  # nothing known: drafts are set by hand
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()  # prefill: 10 tokens + the first output in 3 blocks
    seq = engine.requests["r"].seqs[0]
    assert seq.num_tokens == 11 and len(seq.block_table) == 3
    seq.spec_token_ids = [TINY_VOCAB - 1 - i for i in range(8)]  # unlikely to be right
    free = engine.block_manager.num_free_blocks
    sched = engine.scheduler.schedule()
    assert sched.scheduled[0].num_tokens == 9  # the last token and 8 drafts: 5 blocks
    assert len(seq.block_table) == 5
    engine.scheduler.schedule = lambda: sched  # run exactly that step
    engine.step()
    del engine.scheduler.schedule
    accepted = seq.num_tokens - 12
    assert seq.num_computed_tokens == seq.num_tokens - 1
    assert len(seq.block_table) == math.ceil(seq.num_computed_tokens / 4)
    assert engine.block_manager.num_free_blocks == free + 3 - len(seq.block_table)
    # only blocks full of accepted tokens are in the prefix cache
    assert seq.num_cached_blocks <= seq.num_tokens // 4
    assert accepted < 8
    engine.abort_request("r")


def test_contiguous_allocator(tiny_llama, workload, reference):
    prompts, params = workload
    llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4,
              kv_allocator="contiguous", max_model_len=128, speculative_config=NGRAM)
    with_oracle(llm, reference, prompts)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == reference
    assert llm.llm_engine.spec.stats.num_accepted_tokens > 0


def test_drafts_never_preempt(tiny_llama):
    # two requests that fill the pool: drafts are dropped rather than preempting one
    llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=24, block_size=4,
              speculative_config={**NGRAM, "num_speculative_tokens": 8})
    prompts = [{"prompt_token_ids": [(5 * j + i) % 300 + 3 for j in range(20)]} for i in (0, 1)]
    params = SamplingParams(temperature=0, max_tokens=27, ignore_eos=True)
    ref = tokens(LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=24, block_size=4)
                 .generate(prompts, params, use_tqdm=False))
    with_oracle(llm, ref, prompts, every=100)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == ref
    assert llm.kv_cache_stats().num_preemptions == 0


def test_backs_off_for_large_batches_and_low_acceptance(tiny_llama, workload):
    prompts, params = workload
    llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4,
              speculative_config={**NGRAM, "disable_by_batch_size": 4})
    with_oracle(llm, [[]] * len(prompts), prompts)
    llm.generate(prompts, params, use_tqdm=False)
    # ten requests run at once, then fewer than 5 only as they finish (lengths 30 to 60)
    assert llm.llm_engine.spec.stats.num_drafts <= 4 * 31
    # never disabled: the per-step budget of draft tokens still holds, the best first
    prompts, params = shared_prefix_workload(10, 30)
    ref = tokens(llm.generate(prompts, params, use_tqdm=False))
    llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4,
              speculative_config=NGRAM)
    with_oracle(llm, ref, prompts, every=3)
    spec = llm.llm_engine.spec
    spec.draft_token_budget = 7
    propose, per_step = spec.propose, []

    def counted(running, finished=()):
        propose(running, finished)
        per_step.append(sum(len(s.spec_token_ids) for r in running for s in r.seqs))
    spec.propose = counted
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == ref
    assert max(per_step) == 7
    from pagedserve.spec_decode import MISSES_BEFORE_PAUSE, DraftState
    state = DraftState(4)
    for _ in range(MISSES_BEFORE_PAUSE):
        state.update(state.k, 0, 8)
    assert state.k == 1 and state.pause > 0
    state.update(1, 1, 8)
    assert state.k == 2 and state.misses == 0


# ---- the acceptance rule keeps the target's distribution ----------------------------------

def _chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X chi-square with ``dof`` degrees of freedom."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def _chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test; bins expecting fewer than 5 are pooled."""
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    return _chi2_sf(float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()),
                    int(keep.sum()) - 1)


def _two_sample_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """P-value of the chi-square test that two samples of equal size share a distribution:
    sum of (a - b)^2 / (a + b) over the bins, bins with fewer than 10 draws in all pooled."""
    small = a + b < 10
    a = torch.cat([a[~small], a[small].sum()[None]])
    b = torch.cat([b[~small], b[small].sum()[None]])
    keep = a + b > 0
    return _chi2_sf(float(((a[keep] - b[keep]) ** 2 / (a[keep] + b[keep])).sum()),
                    int(keep.sum()) - 1)


def _target_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    probs = (logits / temperature).softmax(-1)
    sorted_p, order = probs.sort(descending=True)
    drop = sorted_p.cumsum(-1) - sorted_p >= top_p
    sorted_p[drop] = 0
    out = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return out / out.sum(-1, keepdim=True)


ALPHA = 1e-3  # significance level: a correct rule fails one run in a thousand


def test_acceptance_rule_samples_the_target_distribution():
    """Row 0 verifies draft d of a distribution p (temperature 0.8, top_p 0.9): its token
    must follow p whether d is likely, unlikely or outside the nucleus. 40,000 draws per draft.
    A broken rule (a rejection that resamples p instead of the residual) fails the same test."""
    from pagedserve.sampler import Sampler, build_sampling_metadata

    torch.manual_seed(0)
    vocab, draws = 12, 40_000
    logits = torch.randn(vocab) * 2
    p = _target_probs(logits, 0.8, 0.9)
    seq = make_sequence([5, 6], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4))
    md = build_sampling_metadata([seq] * draws, vocab, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    for d in (int(p.argmax()), int(p.argsort()[-3]), int(p.argmin())):
        out = Sampler()(logits.expand(draws, vocab).clone(), md, gen, [d] * draws)
        counts = torch.bincount(torch.tensor(out.token_ids), minlength=vocab).float()
        assert _chi_square_p(counts, p * draws) > ALPHA, d
        assert all(a == (t == d) for a, t in zip(out.accepted, out.token_ids))
        # the broken rule: accept with p(d), else a fresh draw from p (d may come again)
        accept = torch.rand(draws, generator=gen) < p[d]
        again = torch.multinomial(p, draws, replacement=True, generator=gen)
        broken = torch.where(accept, torch.tensor(d), again)
        assert _chi_square_p(torch.bincount(broken, minlength=vocab).float(),
                             p * draws) < ALPHA or p[d] in (0.0, 1.0)


@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory) -> str:
    """A tiny Llama whose next-token distributions are peaked (logits x5): a few likely
    tokens, so drafts are often right and a chi-square test has power."""
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(tmp_path_factory.mktemp("peaked"), "llama")
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)
    model.save_pretrained(path)
    return path


def test_sampled_tokens_with_speculation_follow_the_target(peaked_model):
    """Two-sample chi-square on the 2nd to 4th output tokens of 1,500 seeded requests at
    temperature 0.8 and top_p 0.9 with speculation, against 1,500 without. The drafts are
    each position's most frequent token in the plain run, so they are often right and often
    wrong. A rule biased toward the draft (taking it whenever it is the argmax) fails."""
    prompt = {"prompt_token_ids": [11, 42, 7, 99, 5]}
    kw = dict(skip_tokenizer_init=True, num_kv_blocks=2048, block_size=4, max_num_seqs=256)
    n = 1500
    tiny_llama = peaked_model

    def params(offset):
        return [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4, ignore_eos=True,
                               seed=s + offset) for s in range(n)]
    a = tokens(LLM(tiny_llama, **kw).generate([prompt] * n, params(0), use_tqdm=False))
    modes = [max(set(col), key=col.count) for col in map(list, zip(*a))]
    spec = LLM(tiny_llama, speculative_config={**NGRAM, "num_speculative_tokens": 3}, **kw)
    oracle = Oracle([])
    oracle.propose = lambda token_ids, k: modes[len(token_ids) - 5:len(token_ids) - 5 + k]
    spec.llm_engine.spec.proposer = oracle
    spec.llm_engine.spec.draft_token_budget = 10**6  # every sequence drafts
    b = tokens(spec.generate([prompt] * n, params(n), use_tqdm=False))
    stats = spec.llm_engine.spec.stats
    assert 100 < stats.num_accepted_tokens < stats.num_draft_tokens - 100
    for pos in (1, 2, 3):
        ca = torch.bincount(torch.tensor([t[pos] for t in a]), minlength=TINY_VOCAB).float()
        cb = torch.bincount(torch.tensor([t[pos] for t in b]), minlength=TINY_VOCAB).float()
        assert _two_sample_p(ca, cb) > ALPHA, pos


@pytest.mark.parametrize("method", ["suffix", "oracle"])
def test_seeded_requests_sample_the_same_tokens_with_speculation(tiny_llama, workload, method):
    """A seeded token's randomness depends on its position only, and a row's token is the one
    it samples without drafts: speculation changes nothing a seeded request outputs."""
    prompts, _ = workload
    params = [SamplingParams(temperature=t, top_p=0.9, seed=3 + i, max_tokens=30, n=2,
                             ignore_eos=True, presence_penalty=0.3)
              for i, t in enumerate((0.5, 0.8, 1.0, 1.5) * 2)]
    kw = dict(skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4)
    ref = tokens(LLM(tiny_llama, **kw).generate(prompts[:8], params, use_tqdm=False))
    llm = LLM(tiny_llama, speculative_config={"method": "ngram" if method == "oracle"
                                              else method, "num_speculative_tokens": 4,
                                              "disable_by_batch_size": 0}, **kw)
    if method == "oracle":  # drafts: the reference's tokens, every third one wrong
        full = [list(p["prompt_token_ids"]) + r for p, r in zip(
            [p for p in prompts[:8] for _ in range(2)], ref)]
        with_oracle(llm, [f[len(p["prompt_token_ids"]):] for f, p in zip(
            full, [p for p in prompts[:8] for _ in range(2)])],
            [p for p in prompts[:8] for _ in range(2)], every=3)
    llm.llm_engine.spec.draft_token_budget = 10**6
    assert tokens(llm.generate(prompts[:8], params, use_tqdm=False)) == ref
    stats = llm.llm_engine.spec.stats
    assert stats.num_drafts > 0
    if method == "oracle":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


# ---- drafters and options -----------------------------------------------------------------

def test_ngram_and_suffix_drafters():
    from pagedserve.spec_decode.ngram import NgramProposer
    from pagedserve.spec_decode.suffix import SuffixProposer

    ngram = NgramProposer(2, 3)
    assert ngram.propose([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    assert ngram.propose([1, 2, 3, 4, 2, 3, 5, 2, 3], 2) == [5, 2]  # the latest occurrence
    assert ngram.propose([1, 2, 3, 4], 3) == []  # no bigram recurs
    assert ngram.propose([7, 7], 3) == []  # too short for n = 2
    suffix = SuffixProposer(depth=8, max_requests=2, spec_factor=4.0, min_prob=0.3)
    # "5 6" was followed by 7 twice and by 8 once: 7 (2/3), then 1 (certain after 5 6 7)
    assert suffix.propose([5, 6, 7, 1, 5, 6, 8, 5, 6, 7, 1, 0, 5, 6], 4)[:2] == [7, 1]
    assert suffix.propose([40, 41], 4) == []
    suffix.add_output([40, 41, 42, 43])  # a finished request's output helps the next one
    assert suffix.propose([9, 40, 41], 4) == [42, 43]
    suffix.add_output([1])
    suffix.add_output([2])  # at most 2 outputs kept: the first is forgotten
    assert suffix.propose([9, 40, 41], 4) == []


@pytest.mark.parametrize("bad, match", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "at most 32"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 3}, "exceeds prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key 'typo'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model .* is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "draft_model' only"),
    ({"method": "suffix", "num_speculative_tokens": 2,
      "suffix_decoding_min_token_prob": 2}, "min_token_prob must be"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_config_is_a_value_error(tiny_llama, bad, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=64, speculative_config=bad)


def test_speculative_config_defaults_and_the_flag():
    from pagedserve.cli import build_parser, engine_kwargs

    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_max": 1})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (1, 1)
    assert SpeculativeConfig.from_dict({"model": "m", "num_speculative_tokens": 2}).method \
        == "draft_model"
    args = build_parser().parse_args(
        ["generate", "x", "--speculative-config",
         '{"method": "suffix", "num_speculative_tokens": 5}'])
    assert engine_kwargs(args)["speculative_config"] == {"method": "suffix",
                                                         "num_speculative_tokens": 5}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--speculative-config", "[1]"])


def test_draft_model_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    other = save_tiny_model(tmp_path / "draft", "llama", vocab_size=TINY_VOCAB + 8)
    with pytest.raises(ValueError, match="share the tokenizer"):
        LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=64,
            speculative_config={"model": other, "num_speculative_tokens": 2})


def test_server_reports_spec_decode_metrics(tiny_llama):
    import httpx
    from _helpers import MODEL, LiveServer
    from prometheus_client.parser import text_string_to_metric_families

    from pagedserve import LLMEngine

    engine = LLMEngine(tiny_llama, num_kv_blocks=512, block_size=4,
                       speculative_config={"method": "suffix", "num_speculative_tokens": 4,
                                           "disable_by_batch_size": 0})
    server = LiveServer(engine)
    try:
        body = {"model": MODEL, "prompt": "Once upon a time, once upon a time, once upon a",
                "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        for _ in range(3):  # the suffix drafter remembers the earlier answers
            assert httpx.post(server.url + "/v1/completions", json=body,
                              timeout=60).status_code == 200
        server.idle()
        samples = {(s.name, s.labels.get("position")): s.value
                   for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
                   for s in f.samples}
        st = engine.spec.stats
        assert st.num_accepted_tokens > 0
        assert samples[("pagedserve:spec_decode_num_drafts_total", None)] == st.num_drafts
        assert samples[("pagedserve:spec_decode_num_draft_tokens_total", None)] == \
            st.num_draft_tokens
        assert samples[("pagedserve:spec_decode_num_accepted_tokens_total", None)] == \
            st.num_accepted_tokens
        assert samples[("pagedserve:spec_decode_num_accepted_tokens_per_pos_total", "0")] == \
            st.accepted_per_pos[0]
    finally:
        server.stop()
