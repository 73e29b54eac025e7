"""The capacity planner against hand-computed figures, the engine's block count against the
planner's, and `pagedserve plan`'s errors."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve import LLM, planner
from pagedserve.cli import main
from pagedserve.planner import GB, PRESETS, GiB, ModelShape, make_plan


def test_worked_example_13b():
    """13B, 40 layers, hidden 5120, fp16, 80 GB card with 26 GB of weights."""
    p = make_plan(PRESETS["llama-2-13b"], 80 * GB, weights_dtype="fp16", weight_bytes=26 * GB,
                  avg_tokens=2000, max_model_len=8000)
    assert p.kv_bytes_per_token == 2 * 40 * 5120 * 2 == 819_200
    assert p.kv_bytes_per_token * 2000 == 1_638_400_000  # about 1.64 GB per conversation
    assert p.kv_budget_bytes == 54 * GB
    assert p.num_blocks == 54 * GB // (819_200 * 16) == 4119
    assert p.tokens_max == 65_904  # about 66,000
    assert round(p.concurrency_avg) == 33 and int(p.concurrency_max_model_len) == 8
    gqa = make_plan(ModelShape("13b-gqa4", 40, 5120, 40, 10, 128, 32000, 13824), 80 * GB,
                    weights_dtype="fp16", weight_bytes=26 * GB)
    assert gqa.kv_bytes_per_token * 4 == p.kv_bytes_per_token  # 4x GQA: 4x less KV
    int8 = make_plan(PRESETS["llama-2-13b"], 80 * GB, weights_dtype="fp16",
                     kv_cache_dtype="int8", weight_bytes=26 * GB)
    # 8 bits halve fp16's bytes; per layer and KV head, a 32-token block (a quantized
    # cache's default) adds a 2-byte scale and offset per K channel and a 2-byte V scale per
    # token
    assert int8.block_size == 32
    assert int8.kv_bytes_per_token == p.kv_bytes_per_token // 2 + 40 * 40 * (
        2 * 2 * 128 // 32 + 2)


def test_quantized_kv_tokens_against_16_and_32_bit():
    """SmolLM2 (head_dim 64), per layer and KV head: an 8-bit token costs 64 + 64 bytes of K
    and V codes plus, in its 32-token block, 4 * 64 / 32 bytes of K scales and offsets and 2
    of V scale (138 in all) where float16 costs 256 and float32 512; int4 costs 74."""
    shape, memory = PRESETS["smollm2-135m"], 8 * GiB
    tokens = {kv: make_plan(shape, memory, weights_dtype="fp32", kv_cache_dtype=kv).tokens_max
              for kv in ("fp32", "fp16", "int8", "fp8", "int4")}
    assert tokens["int8"] == tokens["fp8"]
    assert tokens["int8"] / tokens["fp16"] == pytest.approx(256 / 138, rel=1e-3)
    assert tokens["int8"] / tokens["fp32"] >= 3.7 and tokens["int4"] / tokens["fp32"] >= 6.9
    assert tokens["int4"] / tokens["fp32"] == pytest.approx(512 / 74, rel=1e-3)


@pytest.mark.parametrize("shape, dtype, per_token", [
    (PRESETS["llama-3-8b"], "bf16", 2 * 32 * 8 * 128 * 2),  # 131,072
    (ModelShape("mqa", 24, 2048, 16, 1, 128, 50000, 8192), "fp16", 2 * 24 * 1 * 128 * 2),
    # head_dim 256 while hidden / heads = 3072 / 16 = 192 (Gemma-like)
    (ModelShape("wide-heads", 28, 3072, 16, 16, 256, 256000, 24576), "bf16",
     2 * 28 * 16 * 256 * 2),
    (PRESETS["smollm2-135m"], "fp32", 2 * 30 * 3 * 64 * 4),  # 46,080
])
def test_kv_bytes_per_token(shape, dtype, per_token):
    p = make_plan(shape, 80 * GB, weights_dtype=dtype)
    assert p.kv_bytes_per_token == per_token
    assert p.kv_bytes_per_block == per_token * 16
    assert p.num_blocks == (80 * GB - p.weight_bytes) // (per_token * 16)


def test_parameter_counts_match_the_published_sizes():
    assert PRESETS["llama-3-8b"].num_params / 1e9 == pytest.approx(8.03, abs=0.01)
    assert PRESETS["llama-2-7b"].num_params / 1e9 == pytest.approx(6.74, abs=0.01)
    assert PRESETS["llama-2-70b"].num_params / 1e9 == pytest.approx(68.98, abs=0.05)
    assert PRESETS["smollm2-135m"].num_params / 1e6 == pytest.approx(134.5, abs=0.5)


def test_tensor_parallel_splits_kv_heads_and_weights():
    one = make_plan(PRESETS["llama-3-70b"], 200 * GB)  # 141 GB of bf16 weights
    four = make_plan(PRESETS["llama-3-70b"], 80 * GB, tensor_parallel_size=4)
    assert four.kv_bytes_per_token * 4 == one.kv_bytes_per_token
    assert four.weight_bytes == one.weight_bytes_total // 4
    sixteen = make_plan(PRESETS["llama-3-70b"], 80 * GB, tensor_parallel_size=16)
    assert sixteen.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2  # one replicated KV head


def test_levers():
    rows = planner.levers(PRESETS["llama-3-8b"], 80 * GB, shared_prefix_tokens=1000,
                          num_sharing=8, max_model_len_cap=4096, avg_tokens=2000)
    by = {name.split(" (")[0]: conc for name, _, conc in rows}
    base = by["baseline"]
    assert by["without GQA"] == pytest.approx(base / 4, rel=0.01)
    # scales included: 256 + (4 * 128 + 2 * 32) / 32 bytes per layer, KV head and token
    assert by["fp8 KV cache"] == pytest.approx(base * 512 / 274, rel=1e-3)
    # 8 requests share 992 tokens (62 full blocks): 8 * 2000 - 7 * 992 tokens per group
    assert by["prefix sharing"] == pytest.approx(base * 2000 * 8 / (8 * 2000 - 7 * 992))
    assert by["max_model_len cap 4096"] == pytest.approx(by["every request at max_model_len"] * 2,
                                                         rel=0.01)


@pytest.mark.parametrize("dtype, kv_cache_dtype", [
    ("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8"), ("bfloat16", "fp8"),
    ("float32", "bfloat16")])
def test_engine_blocks_equal_the_planners(tiny_llama, dtype, kv_cache_dtype):
    memory = 3_000_000
    llm = LLM(tiny_llama, skip_tokenizer_init=True, kv_cache_memory=memory, dtype=dtype,
              block_size=8, kv_cache_dtype=kv_cache_dtype)
    shape = planner.load_shape(tiny_llama)
    kv_dtype = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    itemsize = 1 if kv_dtype in ("int8", "fp8") else \
        torch.tensor([], dtype=getattr(torch, kv_dtype)).element_size()
    block = planner.kv_block_bytes(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                   itemsize, 8, planner.kv_param_bytes(kv_dtype, shape.head_dim, 8))
    assert llm.kv_cache_stats().num_blocks == planner.num_blocks(memory, block)
    # the cache really takes the bytes the planner counts (scales included), plus a quantized
    # cache's open rows (one per sequence)
    cache = llm.llm_engine.kv_cache
    opened = cache.num_open * planner.open_block_bytes(
        shape.num_layers, shape.num_kv_heads, shape.head_dim, torch.finfo(
            getattr(torch, dtype)).bits // 8, 8, kv_dtype)
    assert cache.nbytes == block * llm.kv_cache_stats().num_blocks + opened
    assert (opened > 0) == (kv_dtype in ("int8", "fp8"))
    plan = make_plan(shape, memory + 1000, weights_dtype=dtype, weight_bytes=1000,
                     block_size=8, kv_cache_dtype=kv_cache_dtype)
    assert plan.num_blocks == llm.kv_cache_stats().num_blocks
    assert plan.kv_bytes_per_token == llm.kv_cache_stats().kv_bytes_per_token


def test_shapes_from_files(tiny_llama, tmp_path, smollm2_path=None):
    shape = planner.load_shape(tiny_llama)
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (2, 4, 2, 16)
    opt = tmp_path / "opt"
    opt.mkdir()
    (opt / "config.json").write_text(json.dumps({
        "num_hidden_layers": 40, "hidden_size": 5120, "num_attention_heads": 40,
        "ffn_dim": 20480, "vocab_size": 50272, "max_position_embeddings": 2048}))
    s = planner.load_shape(str(opt))
    assert s.num_kv_heads == 40 and s.head_dim == 128 and not s.gated_mlp
    assert s.num_params == PRESETS["opt-13b"].num_params


def test_cli_plan_text_json_and_plot(tmp_path, capsys):
    png = tmp_path / "c.png"
    assert main(["plan", "--model", "llama-2-13b", "--memory", "80GB", "--dtype", "fp16",
                 "--weight-bytes", "26GB", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "819,200 B" in out and "54.00 GB (50.29 GiB)" in out and "tokens_max" in out
    assert png.stat().st_size > 10_000
    shared = tmp_path / "s.png"
    assert main(["plan", "--model", "llama-3-8b", "--memory", "80GB", "--shared-prefix-tokens",
                 "1000", "--num-sharing", "8", "--plot", str(shared)]) == 0
    assert shared.stat().st_size > 10_000
    capsys.readouterr()
    assert main(["plan", "--num-layers", "30", "--hidden-size", "576", "--num-heads", "9",
                 "--num-kv-heads", "3", "--vocab-size", "49152", "--intermediate-size",
                 "1536", "--memory", "1GiB", "--dtype", "fp32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["kv_bytes_per_token"] == 46080
    assert data["levers"][0]["lever"] == "baseline"


@pytest.mark.parametrize("args, message", [
    (["--model", "llama-2-7b", "--memory=-80GB"], "not a memory size"),
    (["--model", "llama-2-7b", "--memory", "80"], "with a unit"),
    (["--model", "gpt-5", "--memory", "80GB"], "unknown model 'gpt-5'"),
    (["--model", "llama-2-70b", "--memory", "80GB"], "holds no KV cache"),
    (["--num-layers", "30", "--memory", "80GB"], "the shape flags miss"),
    (["--model", "llama-2-7b", "--memory", "80GB", "--dtype", "fp7"], "unknown dtype 'fp7'"),
    (["--model", "/nonexistent/dir", "--memory", "80GB"], "unknown model"),
    (["--model", "llama-2-7b", "--memory", "80GB", "--max-model-len", "0"], "max_model_len"),
    (["--model", "llama-2-70b", "--memory", "80GB", "--tensor-parallel-size", "3"],
     "neither divides the 8 KV heads"),
    (["--model", "llama-2-7b", "--memory", "80GB", "--shared-prefix-tokens", "100"],
     "needs num_sharing of at least 2"),
    (["--model", "llama-2-7b", "--memory", "80GB", "--plot", "/tmp"], "--plot needs a file"),
    (["--model", "llama-2-7b", "--memory", "80GB", "--num-sharing", "0"], "num_sharing >= 1"),
    (["--model", "llama-2-7b", "--memory", "80GB", "--shared-prefix-tokens", "-5"],
     "shared_prefix_tokens must be >= 0"),
])
def test_cli_plan_errors(args, message, capsys, tmp_path):
    parse_error = message in ("not a memory size", "with a unit")
    with pytest.raises(SystemExit) if parse_error else _nothing():
        assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("cfg, message", [
    ({"num_hidden_layers": 2, "hidden_size": 64}, "config.json has no num_attention_heads"),
    ([1, 2], "must hold a JSON object"),
    ({"num_hidden_layers": 2, "hidden_size": 4096, "num_attention_heads": 30,
      "vocab_size": 10, "intermediate_size": 8}, "not a multiple of num_attention_heads"),
    ({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
      "num_key_value_heads": 0, "vocab_size": 10, "intermediate_size": 8},
     "num_kv_heads must be a positive integer"),
])
def test_cli_plan_bad_config(tmp_path, capsys, cfg, message):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--model", str(d), "--memory", "1GB"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_gemma3_window_paging_saving_and_levers():
    """The gemma3-270m preset pages its 15 window layers apart: 3.65x less KV than every
    layer whole at 4,096 tokens and 4.54x at 8,192 (blocks of 16), and its concurrency is
    counted in those blocks."""
    shape = PRESETS["gemma3-270m"]
    plan = make_plan(shape, 8 * GB, avg_tokens=4096, max_model_len=8192)
    assert plan.kv_groups == ("3 full-attention + 15 sliding-window (512) layers in 6 KV "
                              "groups of 3")
    assert plan.kv_bytes_avg_full / plan.kv_bytes_avg == pytest.approx(1536 / 421)
    assert plan.kv_bytes_max_full / plan.kv_bytes_max == pytest.approx(3072 / 677)
    # a block holds 3 of the 18 layers
    assert plan.kv_bytes_per_block == plan.kv_bytes_per_token // 6 * 16
    assert plan.concurrency_avg == pytest.approx(plan.num_blocks / 421)
    by = {name: conc for name, _, conc in planner.levers(shape, 8 * GB, avg_tokens=4096,
                                                 max_model_len=8192)}
    whole = by["without window paging (every layer's K/V kept whole)"]
    assert by["baseline"] / whole == pytest.approx(1536 / 421, rel=0.01)
    text = planner.render(plan, planner.levers(shape, 8 * GB, avg_tokens=4096,
                                               max_model_len=8192))
    assert "window paging at 4,096 tokens" in text and "3.65x less" in text


def test_engine_blocks_equal_the_planners_for_a_hybrid_model(tiny_gemma3):
    """Tiny Gemma 3 (1 global + 5 window layers): the planner reads its windows from
    config.json and sizes the same blocks as the engine; a sequence's blocks agree too."""
    memory = 3_000_000
    llm = LLM(tiny_gemma3, skip_tokenizer_init=True, kv_cache_memory=memory, block_size=8)
    shape = planner.load_shape(tiny_gemma3)
    assert shape.layer_windows == (8, 8, 8, 8, 8, None)
    plan = make_plan(shape, memory + 1000, weights_dtype="float32", weight_bytes=1000,
                     block_size=8, avg_tokens=100)
    stats = llm.kv_cache_stats()
    assert plan.num_blocks == stats.num_blocks
    assert plan.kv_bytes_per_block == stats.kv_groups[0].bytes_per_token * 8
    assert llm.llm_engine.kv_cache.nbytes == plan.kv_bytes_per_block * plan.num_blocks
    # a 100-token sequence decoding: 13 blocks in the global group, 2 in each window group
    assert plan.kv_bytes_avg == (13 + 5 * 2) * plan.kv_bytes_per_block
