"""Whole-model greedy output against transformers, token for token, on tiny random models:
Llama, Qwen2, Qwen3 and Gemma 3 (sliding-window layers) with GQA over every chunk budget and block size, plus MQA, tied embeddings,
rope scaling, Mistral, and GGUF files of each supported tensor type."""

from __future__ import annotations

import pytest
from _helpers import (
    assert_greedy_match,
    hf_greedy,
    hf_logits_fn,
    load_hf,
    save_tiny_model,
    write_llama_gguf,
)

from pagedserve import LLM, SamplingParams, kernels

# 8 prompts of different lengths (1 to 45 tokens), ids inside the 256-token vocabulary.
PROMPTS = [[(7 * i + 13 * j + 3) % 250 + 3 for j in range(n)]
           for i, n in enumerate([1, 5, 12, 16, 17, 31, 33, 45])]
NEW_TOKENS = 12


def run_engine(path, prompts, max_new_tokens=NEW_TOKENS, cpu_kernels=True, **kwargs):
    """Greedy tokens of pagedserve; ``cpu_kernels=False`` (or "unpacked": the kernels with
    torch's matmuls) is the model built without them: the torch path, what other devices,
    dtypes and quantized KV caches run."""
    with pytest.MonkeyPatch.context() as mp:
        if cpu_kernels is not True:
            mp.setenv("PAGEDSERVE_CPU_KERNELS", cpu_kernels or "0")
        llm = LLM(path, skip_tokenizer_init=True, dtype="float32", prefill_dtype="float32", **kwargs)
    model = llm.llm_engine.runner.model
    assert (model.ops is not None) == (cpu_kernels is not False and kernels.load() is not None)
    assert (llm.llm_engine.sampler.ops is None) == (model.ops is None)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def references(tiny_llama, tiny_qwen2, tiny_qwen3, tiny_gemma3):
    refs = {}
    for name, path in (("llama", tiny_llama), ("qwen2", tiny_qwen2), ("qwen3", tiny_qwen3),
                       ("gemma3", tiny_gemma3)):
        model = load_hf(path)
        refs[name] = (path, hf_greedy(model, PROMPTS, NEW_TOKENS), hf_logits_fn(model))
    return refs


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("budget", [1, 7, 16, 64, 4096])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_greedy_matches_transformers(references, arch, budget, block_size):
    check_greedy(references, arch, budget, block_size, cpu_kernels=True)


@pytest.mark.parametrize("budget", [1, 7, 16, 64, 4096])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_torch_path_matches_transformers(references, arch, budget):
    """The fallback of the fused CPU kernels, and what other devices run."""
    check_greedy(references, arch, budget, 16, cpu_kernels=False)


def check_greedy(references, arch, budget, block_size, cpu_kernels):
    path, ref, logits_fn = references[arch]
    llm, ours = run_engine(path, PROMPTS, block_size=block_size, max_num_batched_tokens=budget,
                           num_kv_blocks=2048 // block_size, cpu_kernels=cpu_kernels)
    for i, (o, r) in enumerate(zip(ours, ref)):
        assert_greedy_match(o, r, PROMPTS[i], logits_fn, f"{arch} prompt {i}")
    assert llm.kv_cache_stats().num_preemptions == 0


VARIANTS = {
    "mqa_tied": dict(num_key_value_heads=1, tie_word_embeddings=True),
    "mha": dict(num_key_value_heads=4),
    "rope_theta": dict(rope_theta=500.0),
    "llama3_rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 16}),
    "linear_rope": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "head_dim_32": dict(head_dim=32),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_llama_variants(tmp_path, variant):
    path = save_tiny_model(tmp_path, "llama", **VARIANTS[variant])
    model = load_hf(path)
    ref = hf_greedy(model, PROMPTS, NEW_TOKENS)
    _, ours = run_engine(path, PROMPTS, block_size=4, max_num_batched_tokens=20, num_kv_blocks=256)
    for i, (o, r) in enumerate(zip(ours, ref)):
        assert_greedy_match(o, r, PROMPTS[i], hf_logits_fn(model), f"{variant} prompt {i}")


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_mistral_sliding_window(tmp_path, cpu_kernels):
    """Every layer attends the last 8 positions: prompts up to 45 tokens and 12 more slide
    the window over cached blocks, in prefill chunks and decodes."""
    path = save_tiny_model(tmp_path, "mistral", sliding_window=8)
    model = load_hf(path)
    ref = hf_greedy(model, PROMPTS, NEW_TOKENS)
    llm, ours = run_engine(path, PROMPTS, cpu_kernels=cpu_kernels, num_kv_blocks=128,
                           block_size=4, max_num_batched_tokens=16)
    assert llm.llm_engine.scheduler_config.max_model_len == 512  # the full context, not 8
    # one KV group of window 8: a sequence holds at most cdiv(8 + 16 - 1, 4) + 1 blocks
    assert llm.kv_cache_stats().peak_used_blocks <= 7 * len(PROMPTS)
    for i, (o, r) in enumerate(zip(ours, ref)):
        assert_greedy_match(o, r, PROMPTS[i], hf_logits_fn(model), f"mistral prompt {i}")


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_gguf_matches_transformers_on_the_same_file(tmp_path, qtype):
    # hidden 256: K-quants need rows of 256 values
    hf_dir = save_tiny_model(tmp_path / "hf", "llama", hidden_size=256, intermediate_size=512,
                             num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=qtype != "Q8_0")
    gguf_path = write_llama_gguf(hf_dir, str(tmp_path / f"tiny-{qtype}.gguf"), qtype)
    model = load_hf(str(tmp_path), gguf_file=f"tiny-{qtype}.gguf")
    prompts = PROMPTS[::2]
    ref = hf_greedy(model, prompts, NEW_TOKENS)
    _, ours = run_engine(gguf_path, prompts, num_kv_blocks=64)
    for i, (o, r) in enumerate(zip(ours, ref)):
        assert_greedy_match(o, r, prompts[i], hf_logits_fn(model), f"gguf {qtype} prompt {i}")


@pytest.mark.parametrize("family,arch", [("mistral", "llama"), ("qwen2", "qwen2"),
                                         ("qwen3", "qwen3")])
def test_every_family_loads_from_gguf(tmp_path, family, arch):
    """A GGUF of each family as llama.cpp writes it (Mistral as architecture llama, q/k
    permuted; q/k/v biases for qwen2, q/k norms for qwen3) against transformers reading the
    same file."""
    # transformers reads no head_dim from a qwen3 GGUF: it takes Qwen3's 128
    extra = {"head_dim": 128} if family == "qwen3" else {}
    hf_dir = save_tiny_model(tmp_path / "hf", family, hidden_size=128, intermediate_size=256,
                             num_attention_heads=4, num_key_value_heads=2, **extra)
    gguf_path = write_llama_gguf(hf_dir, str(tmp_path / f"{arch}.gguf"), "Q8_0", arch)
    model = load_hf(str(tmp_path), gguf_file=f"{arch}.gguf")
    assert type(model).__name__.lower().startswith(arch)
    ref = hf_greedy(model, PROMPTS, NEW_TOKENS)
    llm, ours = run_engine(gguf_path, PROMPTS, num_kv_blocks=64)
    assert llm.llm_engine.model_config.architecture == type(model).__name__
    for i, (o, r) in enumerate(zip(ours, ref)):
        assert_greedy_match(o, r, PROMPTS[i], hf_logits_fn(model), f"{family} gguf prompt {i}")


@pytest.mark.parametrize("variant", ["llama3_rope", "linear_rope", "rope_theta"])
def test_rope_frequencies_match_transformers(tmp_path, variant):
    """Exact check of the scaled rotary frequencies (greedy tokens alone are not sensitive
    to small frequency errors at short positions)."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from pagedserve.loader.hf import read_hf_config
    from pagedserve.model.layers import rope_inv_freq

    overrides = dict(VARIANTS[variant])
    if "rope_scaling" in overrides:  # a long original context puts frequencies in every band
        overrides["rope_scaling"] = {**overrides["rope_scaling"],
                                     "original_max_position_embeddings": 256}
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=4096, architectures=["LlamaForCausalLM"],
                      **overrides)
    cfg.save_pretrained(str(tmp_path))
    ours = rope_inv_freq(read_hf_config(tmp_path))
    ref = LlamaRotaryEmbedding(cfg).inv_freq
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("budget", [7, 512])
def test_prompt_logprobs_equal_transformers(tiny_llama, budget):
    """Every prompt position's logprob (and its top-3) against transformers' log-softmax, over
    chunked prefill; a prompt already in the prefix cache is still computed in full."""
    import torch

    model = load_hf(tiny_llama)
    llm = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", prefill_dtype="float32", block_size=4,
              max_num_batched_tokens=budget, num_kv_blocks=256)
    prompts = [PROMPTS[7], PROMPTS[5], PROMPTS[7][:40]]
    llm.generate([{"prompt_token_ids": PROMPTS[7]}], SamplingParams(max_tokens=1),
                 use_tqdm=False)  # PROMPTS[7] is now cached
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        assert out.num_cached_tokens == 0
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos]
            token = prompt[pos]
            assert entry[token].logprob == pytest.approx(ref[pos - 1, token].item(), abs=1e-4)
            assert entry[token].rank == int((ref[pos - 1] > ref[pos - 1, token]).sum()) + 1
            top = ref[pos - 1].topk(3).indices.tolist()
            assert set(top) <= set(entry) and len(entry) in (3, 4)
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)


def test_delta_stream_sends_prompt_logprobs_once(tiny_llama):
    from pagedserve.sampling_params import RequestOutputKind

    llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=64)
    engine = llm.llm_engine
    engine.add_request("d", {"prompt_token_ids": PROMPTS[4]}, SamplingParams(
        max_tokens=4, ignore_eos=True, prompt_logprobs=0, output_kind=RequestOutputKind.DELTA))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) == 4 and len(outs[0].prompt_logprobs) == len(PROMPTS[4])
    assert all(o.prompt_logprobs is None for o in outs[1:])


@pytest.mark.parametrize("tied", [False, True])
def test_linear_layers_are_chosen_at_construction(tmp_path, tied):
    """With the kernels the projections and the LM head are built packed (the float copy of
    the head is dropped, the tied embedding looks its rows up in the packed one); without
    them, or with ``unpacked``, they hold the checkpoint's weights. All three give the same
    greedy tokens."""
    import torch

    from pagedserve.model.linear import Linear, PackedLinear, pack_gated_weight, pack_linear_weight

    if kernels.load() is None:
        pytest.skip("CPU kernels unavailable")
    path = save_tiny_model(tmp_path / "m", tie_word_embeddings=tied)
    hf = load_hf(path).state_dict()
    qkv = torch.cat([hf[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv"])
    gate_up = torch.cat([hf[f"model.layers.1.mlp.{x}_proj.weight"] for x in ("gate", "up")])
    head = hf["model.embed_tokens.weight" if tied else "lm_head.weight"]
    llm, packed_tokens = run_engine(path, PROMPTS[:4])
    model = llm.llm_engine.runner.model
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    assert isinstance(attn.qkv_proj, PackedLinear) and mlp.gated
    assert torch.equal(attn.qkv_proj.weight, pack_linear_weight(qkv))
    assert torch.equal(mlp.gate_up_proj.weight, pack_gated_weight(gate_up))
    assert torch.equal(model.lm_head.packed, pack_linear_weight(head))
    owner = model.embed_tokens if tied else model.lm_head
    assert owner.weight.numel() == 0  # the float copy was dropped
    for bad in (-1, model.vocab_rows):  # the packed lookup checks bounds as nn.Embedding does
        with pytest.raises(IndexError):
            model.embed(torch.tensor([3, bad]))
    for mode in (False, "unpacked"):
        llm, tokens = run_engine(path, PROMPTS[:4], cpu_kernels=mode)
        model = llm.llm_engine.runner.model
        attn = model.layers[1].self_attn
        assert type(attn.qkv_proj) is Linear and not model.layers[1].mlp.gated
        assert torch.equal(attn.qkv_proj.weight, qkv)
        assert model.lm_head.packed is None and torch.equal(model.lm_head.float_weight, head)
        assert tokens == packed_tokens


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_sliding_window_through_prefix_hits_and_preemption(tiny_gemma3, mode):
    """Gemma 3's 8-token windows over 45-token shared prefixes: a tight pool (preemption,
    prefix hits) gives a roomy run's tokens."""
    from _helpers import shared_prefix_workload

    prompts, params = shared_prefix_workload(10, 20)
    roomy = LLM(tiny_gemma3, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4,
                enable_prefix_caching=False)
    ref = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(tiny_gemma3, skip_tokenizer_init=True, num_kv_blocks=100, block_size=4,
                preemption_mode=mode, swap_space=0.01, max_num_batched_tokens=32)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    stats = tight.kv_cache_stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
