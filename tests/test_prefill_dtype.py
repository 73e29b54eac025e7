"""bfloat16 matmuls for prompt tokens (``prefill_dtype``): each row of a projection takes its
path by its token's kind (prompt rows bfloat16, generated rows the float32 kernel, bit for bit),
the whole model equals transformers running the same rule, and chunking, prefix hits and
preemption keep the tokens and, bit for bit, the prompt logprobs (tiny model and SmolLM2: the
prefill attention kernel's rows do not depend on the chunking). float32 mode is what the other
reference tests use."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _helpers import hf_greedy, load_hf, shared_prefix_workload

from pagedserve import LLM, EngineArgs, SamplingParams, kernels, worker
from pagedserve.model.layers import LinearOptions

ops = kernels.load()
needs_kernels = pytest.mark.skipif(ops is None, reason="CPU kernels unavailable")
PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [300, 2, 2, 2, 81, 64, 9, 10, 11, 12, 13],
           [(7 * j + 3) % 500 + 1 for j in range(30)]]


def _layer(n: int, k: int, gated: bool = False, bias: bool = False, seed: int = 0):
    options = LinearOptions(ops, True, None, prefill_bf16=True)
    layer = options.linear(k, n, bias, gated)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    layer.weight.data = w.clone()
    if bias:
        layer.bias.data = torch.randn(n, generator=g)
    layer.finish_loading()
    return layer, w, options.state


@needs_kernels
@pytest.mark.parametrize("gated,bias", [(False, False), (False, True), (True, False)],
                         ids=["plain", "bias", "gated"])
def test_rows_take_their_path_by_token_kind(gated, bias):
    layer, w, state = _layer(96, 64, gated, bias)
    x = torch.randn(12, 64)
    state.row_spans = []
    exact = layer(x)  # no spans: every row on the float32 kernel
    state.row_spans = [(0, 3, False), (3, 10, True), (10, 12, False)]
    mixed = layer(x)
    assert torch.equal(mixed[:3], exact[:3]) and torch.equal(mixed[10:], exact[10:])
    y = F.linear(x[3:10].bfloat16(), w.bfloat16()).float()
    if bias:
        y = y + layer.bias
    if gated:
        y = F.silu(y[:, :48]) * y[:, 48:]
    torch.testing.assert_close(mixed[3:10], y, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(mixed[3:10], exact[3:10], atol=1e-5, rtol=0)  # really bf16
    state.row_spans = [(0, 12, True)]
    torch.testing.assert_close(layer(x)[3:10], mixed[3:10], atol=1e-6, rtol=1e-6)


def test_auto_follows_the_cpu(monkeypatch):
    for unit, want in (("amx", True), ("avx512_bf16", True), ("none", False)):
        monkeypatch.setattr(worker, "matrix_unit", lambda unit=unit: unit)
        assert worker.prefill_bf16("auto") is want
        assert worker.prefill_bf16("float32") is False
        assert worker.prefill_bf16("bfloat16") is True


def test_bad_value_is_refused():
    with pytest.raises(ValueError, match="prefill_dtype"):
        EngineArgs(prefill_dtype="fp16")


def _bf16_prompt_linears(hf) -> None:
    """transformers' decoder linears in bfloat16 for a forward of more than one token (the
    prompt, as generate runs it) and float32 for one token (each generated token)."""
    for module in hf.model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            def forward(x, m=module):
                if x.shape[-2] > 1:
                    return F.linear(x.bfloat16(), m.weight.bfloat16()).float()
                return F.linear(x, m.weight)
            module.forward = forward


@needs_kernels
def test_whole_model_equals_transformers_with_the_same_rule(tiny_llama):
    hf = load_hf(tiny_llama)
    with torch.no_grad():
        plain = hf(torch.tensor([PROMPTS[2]])).logits[0].float().log_softmax(-1)
    _bf16_prompt_linears(hf)
    ref = hf_greedy(hf, PROMPTS, 16)
    with torch.no_grad():
        logp = hf(torch.tensor([PROMPTS[2]])).logits[0].float().log_softmax(-1)
    llm = LLM(tiny_llama, skip_tokenizer_init=True, prefill_dtype="bfloat16",
              num_kv_blocks=256, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    ours = [lp[t].logprob for lp, t in zip(outs[2].prompt_logprobs[1:], PROMPTS[2][1:])]
    want = [logp[i, t].item() for i, t in enumerate(PROMPTS[2][1:])]
    exact = [plain[i, t].item() for i, t in enumerate(PROMPTS[2][1:])]
    err = max(abs(a - b) for a, b in zip(ours, want))
    assert err < 1e-4
    assert max(abs(a - b) for a, b in zip(ours, exact)) > 10 * err  # bf16 is really used


@needs_kernels
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_chunks_prefix_hits_and_preemption_keep_the_tokens(tiny_llama, mode):
    prompts, params = shared_prefix_workload(16)
    plain = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4,
                enable_prefix_caching=False, prefill_dtype="bfloat16")
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    tight = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=60, block_size=4,
                preemption_mode=mode, swap_space=0.01, max_num_batched_tokens=24,
                long_prefill_token_threshold=7, prefill_dtype="bfloat16")
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    stats = tight.kv_cache_stats()
    assert stats.prefix_cache_hits > 0
    assert (stats.num_swapped_out_blocks if mode == "swap" else stats.num_preemptions) > 0
    exact = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4,
                enable_prefix_caching=False, prefill_dtype="float32")
    assert [o.outputs[0].token_ids for o in exact.generate(prompts, params, use_tqdm=False)] \
        != ref  # the modes differ on this model: the equality above can fail


def _logprobs_and_tokens(llm, prompts, prompt_logprobs=True):
    """Each request's prompt logprobs (None without) and generated tokens, and their logprobs."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0 if prompt_logprobs else None)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return ([([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]]
              if prompt_logprobs else None, o.outputs[0].token_ids) for o in outs],
            [next(iter(d.values())).logprob for o in outs for d in o.outputs[0].logprobs])


@needs_kernels
@pytest.mark.parametrize("prefill_dtype", ["bfloat16", "float32"])
def test_chunks_and_prefix_hits_give_bit_identical_prompt_logprobs(tiny_llama, prefill_dtype):
    """Not only the tokens: every prompt logprob is the same float whether the prompt runs in
    one pass or in chunks of 7 beside other requests (the prefill attention kernel computes
    each row independently of the chunking); after prefix-cache hits the tokens stay. The
    generated tokens' logprobs may move by an ulp (decode steps of other batch sizes)."""
    prompts, _ = shared_prefix_workload(6)
    one = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4,
              enable_prefix_caching=False, prefill_dtype=prefill_dtype)
    chunked = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4,
                  max_num_batched_tokens=24, long_prefill_token_threshold=7,
                  prefill_dtype=prefill_dtype)
    ref, ref_logprobs = _logprobs_and_tokens(one, prompts)
    got, logprobs = _logprobs_and_tokens(chunked, prompts)
    assert got == ref
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-5)
    hits, logprobs = _logprobs_and_tokens(chunked, prompts, prompt_logprobs=False)
    assert chunked.kv_cache_stats().prefix_cache_hits > 0
    assert hits == [(None, tokens) for _, tokens in ref]
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-5)


@pytest.mark.slow
@needs_kernels
def test_smollm2_bf16_prompts_are_chunk_invariant(smollm2_path):
    """The real model in the bfloat16-prompt mode: prompt logprobs of 700-character prompts
    equal bit for bit between one pass and chunks of 64 (the torch flash path moved them by up
    to 0.2 nats), and so do the greedy answers."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    prompts = [text[i * 700:(i + 1) * 700] for i in range(3)]
    runs = [LLM(smollm2_path, prefill_dtype="bfloat16", long_prefill_token_threshold=t,
                max_num_batched_tokens=b) for t, b in ((0, 4096), (64, 100))]
    (one, one_logprobs), (chunked, logprobs) = (_logprobs_and_tokens(llm, prompts)
                                                for llm in runs)
    assert chunked == one
    assert logprobs == pytest.approx(one_logprobs, abs=1e-4)
