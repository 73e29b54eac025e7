"""Tensor parallelism over torch.distributed (gloo): TP=2 gives TP=1's greedy tokens on a tiny
Llama with 4 KV heads, through prefix caching, both preemption modes, n > 1 and an 8-bit cache;
the shards hold what they should; a dead worker ends the engine with an error naming its rank,
and no worker outlives its engine."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from _helpers import save_tiny_model, shared_prefix_workload

from pagedserve import LLM, SamplingParams
from pagedserve.distributed.executor import WorkerDiedError
from pagedserve.distributed.parallel_state import TPGroup, local_config, shard_weight

# Sharded and whole runs are compared token for token in the exact mode: with bfloat16 prompt
# matmuls each rank rounds its own partial sums (docs/tensor-parallel.md).
LLM = functools.partial(LLM, prefill_dtype="float32")

pytestmark = pytest.mark.slow  # worker processes over gloo


@pytest.fixture(scope="module")
def tiny_4kv(tmp_path_factory) -> str:
    """8 query heads, 4 KV heads (head_dim 8), untied LM head, vocab 320."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny_4kv"), "llama", num_attention_heads=8,
                           num_key_value_heads=4)


def _tokens(outs):
    return [c.token_ids for o in outs for c in o.outputs]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie counts as gone only once reaped
        return f.read().split(")")[-1].split()[0] != "Z"


def test_shards_split_heads_mlp_and_vocabulary():
    from pagedserve.config import ModelConfig

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=8,
                      intermediate_size=6, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=2, rms_norm_eps=1e-5, rope_theta=1e4,
                      max_position_embeddings=64, tie_word_embeddings=False)
    tp = TPGroup(1, 2)
    local = local_config(cfg, tp)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) \
        == (2, 1, 3)
    w = torch.arange(10 * 8.0).view(10, 8)
    assert torch.equal(shard_weight("model.embed_tokens.weight", w, cfg, tp), w[5:])
    q = torch.arange(8 * 8.0).view(8, 8)  # 4 heads of 2 rows
    assert torch.equal(shard_weight("model.layers.0.self_attn.q_proj.weight", q, cfg, tp), q[4:])
    k = torch.arange(4 * 8.0).view(4, 8)
    assert torch.equal(shard_weight("model.layers.0.self_attn.k_proj.weight", k, cfg, tp), k[2:])
    assert torch.equal(shard_weight("model.layers.0.self_attn.o_proj.weight", q.t(), cfg, tp),
                       q.t()[:, 4:])
    down = torch.arange(8 * 6.0).view(8, 6)
    assert torch.equal(shard_weight("model.layers.0.mlp.down_proj.weight", down, cfg, tp),
                       down[:, 3:])
    # 10 words over 3 ranks: 4 + 4 + 2, the last padded with zero rows
    last = shard_weight("lm_head.weight", w, cfg, TPGroup(2, 3))
    assert last.shape == (4, 8) and torch.equal(last[:2], w[8:]) and not last[2:].any()


def test_tp_size_must_divide_heads(tiny_4kv):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the model's 8 "
                                         r"query heads; choose one of \[1, 2, 4\]"):
        LLM(tiny_4kv, skip_tokenizer_init=True, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(tiny_4kv, skip_tokenizer_init=True, tensor_parallel_size=0)


def test_tp2_equals_tp1_with_prefix_caching_preemption_and_forks(tiny_4kv):
    prompts, params = shared_prefix_workload(12, 30)
    one = LLM(tiny_4kv, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4)
    ref = _tokens(one.generate(prompts, params, use_tqdm=False))
    fork = {"prompt_token_ids": [(7 * j + 3) % 300 + 3 for j in range(23)]}
    sampled = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)
    ref_fork = _tokens(one.generate(fork, sampled, use_tqdm=False))

    for mode in ("recompute", "swap"):
        two = LLM(tiny_4kv, skip_tokenizer_init=True, num_kv_blocks=60, block_size=4,
                  tensor_parallel_size=2, preemption_mode=mode, swap_space=0.01)
        try:
            assert _tokens(two.generate(prompts, params, use_tqdm=False)) == ref
            stats = two.kv_cache_stats()
            assert stats.prefix_cache_hits >= 44 * (len(prompts) - 1) // 2
            assert stats.num_preemptions > 0
            if mode == "swap":
                assert stats.num_swapped_out_blocks > 0
            else:
                assert _tokens(two.generate(fork, sampled, use_tqdm=False)) == ref_fork
            # each rank holds 2 of the 4 KV heads of every block
            assert two.llm_engine.kv_cache.kv.shape[-2] == 2
        finally:
            two.llm_engine.shutdown()


def test_tp2_with_speculative_decoding(tiny_4kv):
    prompts, params = shared_prefix_workload(6, 30)
    ref = _tokens(LLM(tiny_4kv, skip_tokenizer_init=True, num_kv_blocks=512, block_size=4)
                  .generate(prompts, params, use_tqdm=False))
    two = LLM(tiny_4kv, skip_tokenizer_init=True, num_kv_blocks=512, block_size=4,
              tensor_parallel_size=2, speculative_config={
                  "method": "suffix", "num_speculative_tokens": 4, "disable_by_batch_size": 0})
    try:  # the drafts travel in each step's ModelInput
        assert _tokens(two.generate(prompts, params, use_tqdm=False)) == ref
        assert two.llm_engine.spec.stats.num_accepted_tokens > 0
    finally:
        two.llm_engine.shutdown()


def test_tp2_with_an_int8_cache_and_the_planner_bytes(tiny_4kv):
    from pagedserve import planner

    prompts, params = shared_prefix_workload(6, 30)
    one = LLM(tiny_4kv, skip_tokenizer_init=True, num_kv_blocks=512, block_size=4,
              kv_cache_dtype="int8")
    ref = _tokens(one.generate(prompts, params, use_tqdm=False))
    two = LLM(tiny_4kv, skip_tokenizer_init=True, kv_cache_memory=1 << 20, block_size=4,
              kv_cache_dtype="int8", tensor_parallel_size=2)
    try:
        assert _tokens(two.generate(prompts, params, use_tqdm=False)) == ref
        eng = two.llm_engine
        shape = planner.load_shape(tiny_4kv)
        plan = planner.make_plan(shape, 1 << 20, weights_dtype="fp32", kv_cache_dtype="int8",
                                 tensor_parallel_size=2,
                                 weight_bytes=0, block_size=4)
        assert eng.kv_bytes_per_token == plan.kv_bytes_per_token == one.llm_engine \
            .kv_bytes_per_token // 2
        assert eng.cache_config.num_blocks == plan.num_blocks
    finally:
        two.llm_engine.shutdown()


def test_killing_a_worker_mid_run_names_its_rank(tiny_4kv):
    llm = LLM(tiny_4kv, skip_tokenizer_init=True, num_kv_blocks=2048, block_size=4,
              tensor_parallel_size=2)
    worker = llm.llm_engine.driver.procs[0]
    prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    killer = threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL))
    killer.start()
    t0 = time.time()
    with pytest.raises(WorkerDiedError, match=r"rank 1 \(pid \d+\) died \(signal SIGKILL\)"):
        llm.generate(prompts, params, use_tqdm=False)
    assert time.time() - t0 < 1.0 + 5
    assert not _alive(worker.pid)
    with pytest.raises(WorkerDiedError, match="rank 1"):  # the engine stays dead, clearly
        llm.generate(prompts[0], params, use_tqdm=False)
    llm.llm_engine.abort_request(list(llm.llm_engine.requests))


def test_workers_stop_with_their_engine(tiny_4kv):
    """Shutdown stops the workers cleanly; a driver killed outright takes them along."""
    llm = LLM(tiny_4kv, skip_tokenizer_init=True, num_kv_blocks=64, block_size=4,
              tensor_parallel_size=2)
    worker = llm.llm_engine.driver.procs[0]
    llm.llm_engine.shutdown()
    assert worker.returncode == 0
    script = ("import time; from pagedserve import LLM; "
              f"llm = LLM({tiny_4kv!r}, skip_tokenizer_init=True, num_kv_blocks=64, "
              "tensor_parallel_size=3 - 1); "
              "print(llm.llm_engine.driver.procs[0].pid, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    deadline = time.time() + 10
    while _alive(pid):
        assert time.time() < deadline, "the worker outlived its killed engine"
        time.sleep(0.1)


def test_serve_cli_with_two_workers(tiny_4kv):
    """`pagedserve serve --tensor-parallel-size 2` answers the openai client and leaves no
    worker behind after SIGTERM."""
    import socket

    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", "serve", "--model", tiny_4kv,
                             "--port", str(port), "--tensor-parallel-size", "2",
                             "--num-kv-blocks", "128", "--block-size", "4"],
                            stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=30)
        deadline = time.time() + 60
        while True:
            try:
                name = client.models.list().data[0].id
                out = client.completions.create(model=name, prompt="hello", max_tokens=5,
                                                temperature=0)
                break
            except openai.APIConnectionError:
                if proc.poll() is not None:  # say why: its last lines of stderr
                    pytest.fail(f"the server exited with {proc.returncode}: "
                                f"{proc.stderr.read()[-2000:]}")
                assert time.time() < deadline, "server did not start"
                time.sleep(0.3)
        assert out.usage.completion_tokens == 5
        workers = [c.pid for c in psutil.Process(proc.pid).children()]
        assert len(workers) == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    assert not [pid for pid in workers if _alive(pid)], "a worker outlived the server"


def test_an_idle_engine_outlives_the_collective_timeout(tiny_4kv, monkeypatch):
    """Idle workers wait for the next step inside a collective; the driver's heartbeat keeps
    that wait under PAGEDSERVE_TP_TIMEOUT (here 4 s, idle for 7 s)."""
    monkeypatch.setenv("PAGEDSERVE_TP_TIMEOUT", "4")
    llm = LLM(tiny_4kv, skip_tokenizer_init=True, num_kv_blocks=64, block_size=4,
              tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        first = _tokens(llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False))
        time.sleep(7)
        assert llm.llm_engine.is_healthy()
        again = _tokens(llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False))
        assert again == first
    finally:
        llm.llm_engine.shutdown()
    assert not llm.llm_engine.is_healthy()


def test_a_worker_dying_while_idle_is_noticed_and_ctrl_c_stops_at_once(tiny_4kv):
    llm = LLM(tiny_4kv, skip_tokenizer_init=True, num_kv_blocks=64, block_size=4,
              tensor_parallel_size=2)
    os.kill(llm.llm_engine.driver.procs[0].pid, signal.SIGKILL)
    time.sleep(1.5)
    assert not llm.llm_engine.is_healthy()  # the server's /health turns 503 on this
    llm.llm_engine.shutdown()

    # Ctrl-C landing inside a step (after the broadcast, before rank 0's forward: the workers
    # wait in an all-reduce) leaves the ranks out of step: the workers are stopped at once.
    llm = LLM(tiny_4kv, skip_tokenizer_init=True, num_kv_blocks=2048, block_size=4,
              tensor_parallel_size=2)
    worker = llm.llm_engine.driver.procs[0]
    local = llm.llm_engine.runner.runner
    forward, calls = local.execute_model, []

    def interrupted(inp):
        calls.append(1)
        if len(calls) == 20:
            raise KeyboardInterrupt
        return forward(inp)

    local.execute_model = interrupted
    t0 = time.time()
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": [5 + i, 6]} for i in range(4)],
                     SamplingParams(temperature=0, max_tokens=400, ignore_eos=True),
                     use_tqdm=False)
    assert time.time() - t0 < 5 and not _alive(worker.pid)
    with pytest.raises(WorkerDiedError, match="interrupted"):
        llm.generate({"prompt_token_ids": [5]}, SamplingParams(max_tokens=2), use_tqdm=False)
    llm.llm_engine.abort_request(list(llm.llm_engine.requests))


def test_worker_cli_needs_the_rendezvous_environment(monkeypatch, capsys):
    from pagedserve.cli import main

    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert main(["worker"]) == 2
    assert "needs MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE" in capsys.readouterr().err
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    for rank, world_size, message in (("5", "2", "RANK=5 must be between 1 and WORLD_SIZE - 1"),
                                      ("0", "2", "RANK=0 must be between"),
                                      ("1", "abc", "must be integers")):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", world_size)
        assert main(["worker"]) == 2  # at once: RANK=5 of 2 waited on the rendezvous before
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_tp2_equals_tp1_for_sliding_window_and_qk_norm_models(tmp_path, arch):
    """Gemma 3 (sliding-window layers, four norms, replicated q/k norms) and Qwen 3 split over
    two ranks, through prefix caching and recompute preemption."""
    path = save_tiny_model(tmp_path / arch, arch)
    prompts, params = shared_prefix_workload(8, 20)
    one = LLM(path, skip_tokenizer_init=True, num_kv_blocks=1024, block_size=4)
    ref = _tokens(one.generate(prompts, params, use_tqdm=False))
    # Gemma's six KV groups (one layer each) need more blocks than Qwen's one group
    two = LLM(path, skip_tokenizer_init=True, num_kv_blocks=60 if arch == "qwen3" else 100,
              block_size=4, tensor_parallel_size=2, max_num_batched_tokens=32)
    try:
        assert _tokens(two.generate(prompts, params, use_tqdm=False)) == ref
        stats = two.kv_cache_stats()
        assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
    finally:
        two.llm_engine.shutdown()
