"""8-bit KV storage (kv/quant.py): round trips within the documented bounds, exact fp8
decoding, and scales that travel with their blocks through copy and swap."""

from __future__ import annotations

import pytest
import torch
from _helpers import shared_prefix_workload

from pagedserve.kv.quant import (
    FP8,
    dequantize,
    fp8_to_bfloat16,
    quantize,
    resolve_kv_cache_dtype,
)


def bound(x: torch.Tensor, name: str) -> torch.Tensor:
    """The documented per-element error bound (module docstring of kv/quant.py)."""
    absmax = x.abs().amax(dim=-1, keepdim=True)
    if name == "int8":
        return absmax / 250 + 1e-30
    return x.abs() / 16 + absmax / 400_000 + 1e-30


def cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for scale in (1e-6, 1e-2, 1.0, 30.0, 1e4, 1e30):
        out.append((f"normal x {scale:g}", torch.randn(64, 3, 64, generator=g) * scale))
    outliers = torch.randn(64, 3, 64, generator=g)
    outliers[:, :, 7] *= 300  # an outlier channel, as real keys have
    outliers[5, 1, 3] = -5e4
    out.append(("outliers", outliers))
    out.append(("all zero", torch.zeros(16, 3, 64)))
    mixed = torch.randn(16, 3, 64, generator=g)
    mixed[3] = 0  # an all-zero token among others
    mixed[4, 2] = 0  # an all-zero head
    mixed[6, 0, :] = 1e-38  # tiny (fp32 near its smallest normal)
    out.append(("zero rows and tiny", mixed))
    out.append(("uniform", torch.rand(16, 3, 64, generator=g) * 2 - 1))
    out.append(("constant", torch.full((4, 3, 64), -2.5)))
    return out


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("case, x", cases(), ids=[c for c, _ in cases()])
def test_round_trip_within_the_bound(name, case, x):
    data, scales = quantize(x, name)
    assert data.dtype == (torch.int8 if name == "int8" else torch.uint8)
    assert data.shape == x.shape and scales.shape == x.shape[:-1]
    assert scales.dtype == torch.bfloat16 and bool((scales > 0).all())
    y = dequantize(data, scales, name)
    assert torch.isfinite(y).all() and torch.isfinite(scales.float()).all()
    err = (y - x).abs()
    assert bool((err <= bound(x, name)).all()), f"{case}: worst {(err / bound(x, name)).max()}"
    assert bool((y[x == 0] == 0).all())  # zeros stay zeros
    # bfloat16 out: the same values up to bfloat16's own rounding
    yb = dequantize(data, scales, name, dtype=torch.bfloat16)
    torch.testing.assert_close(yb.float(), y, rtol=2**-8, atol=0)


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_the_bound_is_tight_enough_to_matter(name):
    # the bound is not vacuous: the error of random values uses a good part of it
    x = torch.randn(256, 3, 64, generator=torch.Generator().manual_seed(1))
    data, scales = quantize(x, name)
    ratio = ((dequantize(data, scales, name) - x).abs() / bound(x, name)).max()
    assert ratio > 0.5


def test_largest_value_maps_to_the_top_code_without_clipping():
    x = torch.randn(32, 2, 64, generator=torch.Generator().manual_seed(2))
    data, _ = quantize(x, "int8")
    top = data.abs().amax(dim=-1)
    assert bool((top >= 125).all()) and bool((top <= 127).all())
    data, _ = quantize(x, "fp8")
    top = data.view(FP8).float().abs().amax(dim=-1)
    assert bool((top > 400).all()) and bool((top <= 448).all())


def test_quantizing_a_token_does_not_depend_on_its_batch():
    x = torch.randn(40, 3, 64, generator=torch.Generator().manual_seed(3))
    for name in ("int8", "fp8"):
        whole = quantize(x, name)
        one = quantize(x[17:18], name)
        assert torch.equal(whole[0][17:18], one[0]) and torch.equal(whole[1][17:18], one[1])


def test_fp8_decoding_equals_torch_for_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    ours = fp8_to_bfloat16(codes.clone())
    torchs = codes.view(FP8).to(torch.bfloat16)
    finite = ~torchs.isnan()  # 0x7f and 0xff are NaN in e4m3fn; quantize never writes them
    assert int(finite.sum()) == 254
    assert torch.equal(ours[finite], torchs[finite])
    assert bool(torch.isfinite(ours).all())


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int4'"):
        resolve_kv_cache_dtype("int4", torch.float32)
    assert resolve_kv_cache_dtype("auto", torch.bfloat16).name == "bfloat16"
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32).storage_dtype == torch.uint8


# ---- end to end on a tiny random Llama ---------------------------------------------------

def _tokens(outs):
    return [c.token_ids for o in outs for c in o.outputs]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_8bit_prefix_hits_and_swap_give_the_same_tokens(tiny_llama, kv_cache_dtype):
    """The same 8-bit mode with and without prefix-cache hits and preemption by swap: scales
    travel with their blocks (a swap that left them behind changes the tokens)."""
    from pagedserve import LLM

    prompts, params = shared_prefix_workload()
    plain = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4,
                enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    ref = _tokens(plain.generate(prompts, params, use_tqdm=False))
    assert plain.kv_cache_stats().num_preemptions == 0
    tight = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=60, block_size=4,
                preemption_mode="swap", swap_space=0.01, kv_cache_dtype=kv_cache_dtype)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert _tokens(outs) == ref
    stats = tight.kv_cache_stats()
    assert stats.prefix_cache_hits >= 44 * (len(prompts) - 1) // 2
    assert stats.num_swapped_out_blocks > 50
    assert stats.num_swapped_in_blocks == stats.num_swapped_out_blocks
    # and 8 bits are really in use: the full-precision run differs somewhere
    full = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4)
    full_ref = _tokens(full.generate(prompts, params, use_tqdm=False))
    assert full_ref != ref


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_8bit_copy_on_write_copies_the_scales(tiny_llama, kv_cache_dtype):
    """n=3 greedy forks share the prompt's partial last block and copy it on their first write;
    every fork must equal the single greedy run."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=256, block_size=4,
              kv_cache_dtype=kv_cache_dtype)
    prompt = {"prompt_token_ids": [(7 * j + 3) % 300 + 3 for j in range(23)]}  # 5 blocks + 3
    one = _tokens(llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30,
                                                      ignore_eos=True), use_tqdm=False))
    llm2 = LLM(tiny_llama, skip_tokenizer_init=True, num_kv_blocks=256, block_size=4,
               kv_cache_dtype=kv_cache_dtype)
    three = _tokens(llm2.generate(prompt, SamplingParams(n=3, temperature=0, max_tokens=30,
                                                         ignore_eos=True), use_tqdm=False))
    assert three == one * 3


def test_generate_cli_takes_kv_cache_dtype(tiny_llama, capsys):
    from pagedserve.cli import build_parser, engine_kwargs, main

    assert engine_kwargs(build_parser().parse_args(
        ["serve", "--kv-cache-dtype", "fp8"]))["kv_cache_dtype"] == "fp8"
    assert main(["generate", "hello", "--model", tiny_llama, "--max-tokens", "4", "--no-chat",
                 "--kv-cache-dtype", "int8", "--num-kv-blocks", "32"]) == 0
    with pytest.raises(SystemExit):
        main(["generate", "hello", "--kv-cache-dtype", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
