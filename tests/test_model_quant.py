"""Weight-only int4 linear layers (``quantization="int4"``): the re-pack of Q4_1 weights is
exact but for bfloat16 scales, other weights stay within half a step, the CPU int4 kernel equals
the bfloat16 copy, and the whole model equals transformers running the same dequantized weights
with bfloat16 matmul inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _helpers import (
    assert_greedy_match,
    hf_greedy,
    hf_logits_fn,
    load_hf,
    save_tiny_model,
    shared_prefix_workload,
    write_llama_gguf,
)

from pagedserve import LLM, SamplingParams
from pagedserve.model.quant import GROUP_SIZE, SMALL_ROWS, Int4Linear, quantize_q8_0


def _q4_1_weight(n=48, k=128, seed=0):
    """d * q + m per group of 32 with q spanning 0..15 in every group, and d, m, m + 8d exact
    in bfloat16: the re-pack must reproduce it bit for bit."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // GROUP_SIZE, GROUP_SIZE), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = torch.randint(1, 8, (n, k // GROUP_SIZE, 1), generator=g) * 2.0 ** -7
    m = torch.randint(-64, 0, (n, k // GROUP_SIZE, 1), generator=g) * 2.0 ** -6
    return (d * q + m).view(n, k)


def test_q4_1_weights_are_repacked_exactly():
    w = _q4_1_weight()
    layer = Int4Linear.from_weight(w)
    assert torch.equal(layer.dense.float(), w)
    x = torch.randn(SMALL_ROWS, w.shape[1])
    for rows in (1, 5, SMALL_ROWS):  # the int4 kernel
        ref = F.linear(x[:rows].bfloat16().float(), w)
        torch.testing.assert_close(layer(x[:rows]), ref, rtol=2 ** -7, atol=1e-3)


def test_other_weights_stay_within_half_a_step():
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 96)  # columns of very different scales
    w[3, :32] = 0.25  # a constant group
    layer = Int4Linear.from_weight(w)
    groups = w.view(64, 3, GROUP_SIZE)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    bound = 0.5 * step + 2 ** -8 * (groups.abs().amax(-1) + 8 * step)  # + bf16 scale rounding
    err = (layer.dense.float() - w).view(64, 3, GROUP_SIZE).abs().amax(-1)
    assert (err <= bound).all()
    assert (err > 0.2 * step).float().mean() > 0.5  # the bound is not vacuous
    assert torch.equal(layer.dense[3, :32].float(), torch.full((32,), 0.25))


@pytest.mark.parametrize("kernel", ["torch", "int4_linear", "packed_bf16"])
@pytest.mark.parametrize("dense_dtype", [torch.bfloat16, torch.float32])
def test_kernel_and_dequantized_copy_agree(dense_dtype, kernel, monkeypatch):
    """The copy holds the same bfloat16 weights in either dtype (float32 where the CPU has no
    bfloat16 matmul unit); more rows than SMALL_ROWS multiply by it. Up to SMALL_ROWS rows
    take torch's int4 kernel, or with the CPU kernels ``int4_linear``. Where the bfloat16 copy
    is packed for ``packed_linear_bf16`` (forced here), it serves from PACKED_SMALL_ROWS + 1
    rows, each row's result independent of the others."""
    from pagedserve import kernels
    from pagedserve.model import quant

    ops = kernels.load() if kernel != "torch" else None
    if kernel != "torch" and ops is None:
        pytest.skip("no CPU kernels")
    monkeypatch.setattr(quant, "packed_bf16", lambda ops: ops is not None and kernel == "packed_bf16")
    w = torch.randn(208, 64)
    layer = Int4Linear.from_weight(w, dense_dtype, ops=ops)
    assert (layer.packed if ops is None else layer.codes) is not None
    ref = layer if ops is None else Int4Linear.from_weight(w, dense_dtype)  # its plain copy
    packed = kernel == "packed_bf16" and dense_dtype == torch.bfloat16
    assert (layer.dense is None) == packed and (layer.dense_packed is not None) == packed
    assert torch.equal(layer.dequantized(), ref.dense.float())
    assert ref.dense.dtype == dense_dtype
    assert torch.equal(ref.dense, ref.dense.bfloat16().to(dense_dtype))
    x = torch.randn(40, 64)
    dense = F.linear(x.bfloat16().to(dense_dtype), ref.dense).bfloat16().float()
    # the kernel rounds the output to bfloat16, the copy's product may not: <= 2^-8 sum |x w|
    bound = 2 ** -7 * (x.bfloat16().float().abs() @ ref.dense.float().abs().t())
    for rows in (1, 2, 3, 4, 7, SMALL_ROWS, 40):
        assert ((layer(x[:rows]) - dense[:rows]).abs() <= bound[:rows]).all()
    if packed:  # a row's product does not depend on the rows beside it
        assert torch.equal(layer(x)[:4], layer(x[:quant.PACKED_SMALL_ROWS + 1]))
        assert torch.equal(layer(x)[4:17], layer(x[4:17]))
    else:
        assert torch.equal(layer(x), dense)  # more rows: the copy itself
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    if ops is not None:
        return
    odd = Int4Linear.from_weight(w[:200], dense_dtype)  # no torch kernel for 200 rows: the copy
    one = F.linear(x[:1].bfloat16().to(dense_dtype), odd.dense).bfloat16().float()
    assert odd.packed is None and torch.equal(odd(x[:1]), one)


def test_the_copy_is_float32_only_without_a_bfloat16_unit(monkeypatch):
    from pagedserve.model import quant

    w = torch.randn(32, 64)
    for unit, dtype in (("none", torch.float32), ("avx512_bf16", torch.bfloat16),
                        ("amx", torch.bfloat16)):
        monkeypatch.setattr(quant, "matrix_unit", lambda unit=unit: unit)
        assert Int4Linear.from_weight(w).dense.dtype == dtype


def test_bad_shapes_and_options_are_refused(tiny_qwen2, tiny_llama):
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4Linear.from_weight(torch.randn(8, 48))
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        LLM(tiny_llama, skip_tokenizer_init=True, quantization="int3")
    with pytest.raises(ValueError, match="with a bias"):
        LLM(tiny_qwen2, skip_tokenizer_init=True, quantization="int4")


def _patch_hf_linears(model) -> None:
    """transformers' decoder layers running our int4 layers: same weights, same bf16 inputs,
    the same few-row kernel as the engine's (int4_linear with the CPU kernels)."""
    from pagedserve import kernels

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, Int4Linear.from_weight(child.weight,
                                                                 ops=kernels.load()))


PROMPTS = [[(7 * i + 13 * j + 3) % 250 + 3 for j in range(n)] for i, n in enumerate([1, 9, 30])]


def test_whole_model_equals_transformers_with_the_same_int4_layers(tiny_llama):
    hf = load_hf(tiny_llama)
    plain_ref = hf_greedy(hf, PROMPTS, 16)
    _patch_hf_linears(hf)
    ref = hf_greedy(hf, PROMPTS, 16)
    assert ref != plain_ref  # int4 changes this tiny model's tokens: the test can fail
    llm = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", quantization="int4",
              num_kv_blocks=256, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    # the layers round their outputs to bfloat16 (steps of 2^-8 relative), so float-level
    # differences elsewhere (attention, norms, the LM head's 8-bit copy) can flip a token whose
    # logit leads by less than that
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert_greedy_match(o.outputs[0].token_ids, r, PROMPTS[i], hf_logits_fn(hf),
                            f"int4 prompt {i}", tie=0.02)
    # prompt log-probabilities against transformers' on the 30-token prompt (one prefill)
    with torch.no_grad():
        logp = hf(torch.tensor([PROMPTS[2]])).logits[0].float().log_softmax(-1)
    ours = [lp[t].logprob for lp, t in zip(outs[2].prompt_logprobs[1:], PROMPTS[2][1:])]
    want = [logp[i, t].item() for i, t in enumerate(PROMPTS[2][1:])]
    assert max(abs(a - b) for a, b in zip(ours, want)) < 2e-2


@pytest.mark.parametrize("small_rows", [0, 10 ** 9], ids=["bf16-copy", "int4-kernel"])
def test_prefix_hits_and_preemption_keep_the_tokens(tiny_llama, monkeypatch, small_rows):
    """int4 with prefix-cache hits and swap preemption gives a roomy plain run's tokens, with
    either matmul path forced. (Mixing the paths by batch size makes tokens batch-dependent
    like any reduced precision: the kernel's fp32 weights against the copy's bf16 ones.)"""
    monkeypatch.setattr("pagedserve.model.quant.SMALL_ROWS", small_rows)
    monkeypatch.setattr("pagedserve.model.quant.PACKED_SMALL_ROWS", small_rows)
    monkeypatch.setattr("pagedserve.model.layers.HEAD_Q8_ROWS", small_rows)
    prompts, params = shared_prefix_workload(16)
    plain = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4,
                enable_prefix_caching=False, quantization="int4")
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    tight = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=60, block_size=4,
                preemption_mode="swap", swap_space=0.01, quantization="int4")
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    stats = tight.kv_cache_stats()
    assert stats.prefix_cache_hits > 0 and stats.num_swapped_out_blocks > 0


def test_q4_1_gguf_loads_with_int4_layers(tmp_path):
    hf_dir = save_tiny_model(tmp_path / "hf", "llama", hidden_size=64, intermediate_size=128)
    path = write_llama_gguf(hf_dir, str(tmp_path / "m.gguf"), "Q4_1")
    with pytest.MonkeyPatch.context() as mp:  # the weights as loaded, not packed
        mp.setenv("PAGEDSERVE_CPU_KERNELS", "0")
        full = LLM(path, skip_tokenizer_init=True, dtype="float32")
    q4 = LLM(path, skip_tokenizer_init=True, dtype="float32", quantization="int4")
    w = full.llm_engine.model.layers[0].mlp.down_proj.weight
    layer = q4.llm_engine.model.layers[0].mlp.down_proj
    assert isinstance(layer, Int4Linear)
    # exact but for the bfloat16 rounding of each group's scale and offset
    assert (layer.dequantized() - w).abs().max() <= 2 ** -8 * 9 * w.abs().max()


def test_generate_cli_takes_quantization(tiny_llama, capsys):
    from pagedserve.cli import build_parser, engine_kwargs, main

    assert engine_kwargs(build_parser().parse_args(
        ["serve", "--quantization", "int4"]))["quantization"] == "int4"
    assert main(["generate", "hello", "--model", tiny_llama, "--max-tokens", "4", "--no-chat",
                 "--quantization", "int4", "--num-kv-blocks", "32"]) == 0
    with pytest.raises(SystemExit):
        main(["generate", "hello", "--quantization", "awq"])
    assert "invalid choice: 'awq'" in capsys.readouterr().err


def test_q8_0_weights_are_repacked_exactly():
    """The LM head's 8-bit copy: weights that came from a Q8_0 file (an fp16 scale per 32
    columns times integers reaching +-127, as llama.cpp writes them) come back bit for bit;
    others within half a step."""
    torch.manual_seed(4)
    d = (torch.rand(64, 4) * 0.01 + 1e-4).half().float()
    q = torch.randint(-127, 128, (64, 4, 32))
    q[:, :, 0] = 127 * torch.where(torch.rand(64, 4) < 0.5, 1, -1)  # each group reaches 127
    w = (q.float() * d[..., None]).view(64, 128)
    q8, scales = quantize_q8_0(w)
    assert torch.equal(q8.view(64, 4, 32).long(), q) and torch.equal(scales, d)
    other = torch.randn(8, 64)
    q8, scales = quantize_q8_0(other)
    back = (q8.view(8, 2, 32).float() * scales[..., None]).view(8, 64)
    assert ((back - other).abs() <= scales.repeat_interleave(32, 1) / 2 + 1e-7).all()


@pytest.mark.parametrize("bf16_unit", [False, True], ids=["q8-then-float32", "q8-then-bf16"])
def test_int4_lm_head_takes_the_8_bit_copy_for_few_rows(monkeypatch, bf16_unit):
    """The int4 mode's LM head: up to SMALL_ROWS rows through the 8-bit copy (int8_linear),
    more through the float32 panels; where the packed bfloat16 kernel is used (forced here),
    the bfloat16 panels from HEAD_Q8_ROWS + 1 rows. Every form is close to the float head."""
    from pagedserve import kernels
    from pagedserve.model import layers

    ops = kernels.load()
    if ops is None:
        pytest.skip("no CPU kernels")
    monkeypatch.setattr(layers, "packed_bf16", lambda ops: bf16_unit)
    head = layers.LMHead(100, 64, tied=False,
                         options=layers.LinearOptions(ops=ops, quantization="int4"))
    torch.manual_seed(7)
    w = torch.randn(100, 64)
    head.weight.data = w.clone()
    head.finish_loading(torch.nn.Embedding(100, 64))
    assert (head.packed_bf16 is not None) == bf16_unit
    x = torch.randn(20, 64)
    bound = 2 ** -6 * (x.abs() @ w.abs().t())  # 8-bit weights or bfloat16 inputs and weights
    for rows in (1, layers.HEAD_Q8_ROWS, layers.HEAD_Q8_ROWS + 1, SMALL_ROWS, 20):
        out = head(x[:rows])
        assert out.dtype == torch.float32 and ((out - x[:rows] @ w.t()).abs() <= bound[:rows]).all()
        assert torch.equal(head(x[:rows], reuse=True), out)  # into the head's own buffer
        if rows <= layers.HEAD_Q8_ROWS or (not bf16_unit and rows <= SMALL_ROWS):
            assert torch.equal(out, ops.int8_linear(x[:rows], *head.q8))
        elif bf16_unit:
            assert torch.equal(out, ops.packed_linear_bf16(x[:rows].bfloat16(), head.packed_bf16,
                                                           100, torch.float32))
        else:
            assert torch.equal(out, ops.packed_linear(x[:rows], head.packed, None, 100))
