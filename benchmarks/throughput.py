"""Offline throughput against the peers a user would pick instead, on the same model, weights,
dtype and threads, in one process: HF transformers static batching (``generate``), HF
transformers continuous batching (``generate_batch``'s manager, the same block size and block
count), and llama.cpp through llama-cpp-python on the same GGUF (the ``[bench]`` extra;
skipped with a message when it is not installed).

1. ShareGPT-like workload: prompt and output lengths from fixed-seed log-normal distributions
   (means near 160 and 340 tokens, clipped to 8..1024), prompts cut from real English text
   (benchmarks/common.py), outputs forced to their length (ignore_eos), greedy. HF static runs
   ``generate`` in batches of 32 in arrival order, each batch left-padded and run to its
   longest output; only the requested tokens count for everyone.
2. Single-sequence decode (128 tokens after the prefill): pagedserve (as loaded, and with
   ``quantization="int4"`` linear layers), HF ``generate``, llama.cpp; the best of 3
   interleaved rounds each.
3. Decode rate against batch size (1, 8, 32, 64 sequences of 64-token prompts decoding 32
   tokens, prefill excluded; pagedserve best of 2 rounds) for pagedserve and HF static,
   llama.cpp at 1; plotted to ``--plot``.

    python benchmarks/throughput.py                       # everything (about 40 minutes)
    python benchmarks/throughput.py --peers               # pagedserve only
    python benchmarks/throughput.py --num-requests 16 --peers hf_cb
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import decode_rate, make_workload

from pagedserve import LLM, SamplingParams

PEERS = ("hf_static", "hf_cb", "llama_cpp")
BATCHES = (1, 8, 32, 64)


def synthetic_prompts(batch: int, length: int = 64) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 1000 + 100 for j in range(length)] for i in range(batch)]


# ---- pagedserve -------------------------------------------------------------------------

def run_pagedserve(llm: LLM, work) -> tuple[float, int]:
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(o for _, o in work)
    return elapsed, tokens


# ---- HF transformers ----------------------------------------------------------------------

@torch.inference_mode()
def run_hf_static(model, work, batch_size: int = 32, pad_id: int = 0) -> tuple[float, int]:
    t0 = time.perf_counter()
    for start in range(0, len(work), batch_size):
        batch = work[start:start + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        longest = max(o for _, o in batch)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                       min_new_tokens=longest, do_sample=False, pad_token_id=pad_id)
        print(f"  HF static batch {start // batch_size + 1}: {time.perf_counter() - t0:.0f}s",
              flush=True)
    return time.perf_counter() - t0, sum(o for _, o in work)


@torch.inference_mode()
def hf_static_decode_rate(model, batch: int, tokens: int = 32) -> float:
    ids = torch.tensor(synthetic_prompts(batch))
    kw = dict(input_ids=ids, do_sample=False, pad_token_id=0)
    t0 = time.perf_counter()
    model.generate(**kw, max_new_tokens=1, min_new_tokens=1)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.generate(**kw, max_new_tokens=tokens + 1, min_new_tokens=tokens + 1)
    return batch * tokens / (time.perf_counter() - t0 - prefill)


def run_hf_cb(model, work, num_blocks: int, block_size: int,
              max_batch_tokens: int) -> tuple[float, int]:
    """transformers' continuous batching manager, per-request max_new_tokens, EOS off."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(o for _, o in work))
    cb = ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks,
                                  max_batch_tokens=max_batch_tokens)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    try:
        t0 = time.perf_counter()
        for i, (p, o) in enumerate(work):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=o, eos_token_id=[])
        tokens = 0
        for done in range(len(work)):
            result = manager.get_result(timeout=3600)
            tokens += len(result.generated_tokens)
            if (done + 1) % 16 == 0:
                print(f"  HF CB {done + 1}/{len(work)}: {time.perf_counter() - t0:.0f}s",
                      flush=True)
        elapsed = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    assert tokens == sum(o for _, o in work), tokens
    return elapsed, tokens


# ---- llama.cpp ----------------------------------------------------------------------------

_LLAMA_CPP_CHILD = """
import json, sys, time
from llama_cpp import Llama
gguf, threads, n, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
llm = Llama(model_path=gguf, n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)
def rate(count_to):
    count, t0 = 0, None
    for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        count += 1
        if count == 1:
            t0 = time.perf_counter()
        if count == count_to:
            break
    return (count_to - 1) / (time.perf_counter() - t0)
rate(8)  # warm-up
print(json.dumps(max(rate(n) for _ in range(2))))
"""


def llama_cpp_decode_rate(gguf: Path, prompt: list[int], threads: int, n: int = 128):
    """llama.cpp's greedy decode tokens/s after the prompt's prefill (first token excluded),
    best of 2, in a child process (a llama.cpp built for another CPU dies with SIGILL).
    None, with a message, when llama-cpp-python is missing or fails."""
    import subprocess

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama.cpp: skipped (pip install -e '.[bench]' builds llama-cpp-python)")
        return None
    proc = subprocess.run([sys.executable, "-c", _LLAMA_CPP_CHILD, str(gguf), str(threads),
                           str(n), json.dumps(prompt)], capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        print(f"llama.cpp: skipped (exit status {proc.returncode}: "
              f"{proc.stderr.strip()[-300:]})")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- main ---------------------------------------------------------------------------------

def engine_single_rate(llm: LLM, prompt: list[int], n: int) -> float:
    """pagedserve's decode tokens/s for one sequence after its prefill (first token excluded)."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)  # warm-up
    engine = llm.llm_engine
    engine.add_request("single", {"prompt_token_ids": prompt}, params)
    engine.step()  # prefill + first token
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (n - 1) / (time.perf_counter() - t0)


def hf_single_rate(hf_model, prompt: list[int], n: int) -> float:
    """HF ``generate``'s decode tokens/s for one sequence (its one-token prefill subtracted)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        hf_model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        hf_model.generate(input_ids=ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf_model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return (n - 1) / (time.perf_counter() - t0 - prefill)


def single_sequence(llms: dict[str, LLM], hf_model, llama_gguf, prompt: list[int],
                    n: int = 128, rounds: int = 3) -> dict:
    """Single-sequence decode tokens/s of every engine: the best of ``rounds`` interleaved
    rounds, so that a slow moment of this shared machine does not land on one engine only."""
    runs: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, llm in llms.items():
            runs.setdefault(name, []).append(engine_single_rate(llm, prompt, n))
        if hf_model is not None:
            runs.setdefault("hf_generate", []).append(hf_single_rate(hf_model, prompt, n))
        if llama_gguf is not None:
            rate = llama_cpp_decode_rate(llama_gguf, prompt, torch.get_num_threads(), n)
            if rate is not None:
                runs.setdefault("llama_cpp", []).append(rate)
    return {name: max(v) for name, v in runs.items()} | {"rounds": runs}


def plot(path: str, sweep: dict, dtype: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, rates in sweep.items():
        xs = sorted(int(b) for b in rates)
        ax.plot(xs, [rates[b] if b in rates else rates[str(b)] for b in xs], marker="o",
                label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences decoding together")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"SmolLM2-135M-Instruct decode on this CPU ({dtype})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS,
                    help="peers to run (none: pagedserve only)")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--dtype", default="auto", help="pagedserve's default unless given")
    ap.add_argument("--quantization", nargs="+", default=["none", "int4"],
                    choices=["none", "int4"], help="pagedserve variants to run (default both)")
    ap.add_argument("--kv-blocks", type=int, default=4096, help="KV blocks of 16, both engines")
    ap.add_argument("--plot", default=None, help="decode rate against batch size (PNG)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()

    llms = {}
    for quantization in args.quantization:
        name = "pagedserve" if quantization == "none" else f"pagedserve {quantization}"
        llms[name] = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         num_kv_blocks=args.kv_blocks,
                         quantization=None if quantization == "none" else quantization)
    llm = next(iter(llms.values()))
    dtype = llm.llm_engine.dtype
    threads = torch.get_num_threads()
    work = make_workload(llm.get_tokenizer(), args.num_requests)
    print(f"workload: {len(work)} requests, prompt tokens mean "
          f"{np.mean([len(p) for p, _ in work]):.0f}, output tokens mean "
          f"{np.mean([o for _, o in work]):.0f} (total {sum(o for _, o in work)}); "
          f"torch threads {threads}, dtype {dtype}", flush=True)

    hf_model = None
    path = llm.llm_engine.model_path
    if {"hf_static", "hf_cb"} & set(args.peers):
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    llama_gguf = path if "llama_cpp" in args.peers and path.suffix == ".gguf" else None

    results: dict = {"num_requests": len(work), "dtype": str(dtype), "threads": threads}
    results["single_sequence"] = single = single_sequence(llms, hf_model, llama_gguf,
                                                          work[0][0])
    print("single-sequence decode tok/s (best of 3 interleaved rounds):",
          {k: round(v, 1) for k, v in single.items() if k != "rounds"}, flush=True)

    sweep: dict[str, dict[int, float]] = {name: {} for name in llms}
    for _ in range(2):  # best of 2 interleaved rounds
        for b in BATCHES:
            for name, engine_llm in llms.items():
                sweep[name][b] = max(sweep[name].get(b, 0.0),
                                     decode_rate(engine_llm, b)["tokens_per_s"])
    if hf_model is not None and "hf_static" in args.peers:
        sweep["HF generate (static batch)"] = {b: hf_static_decode_rate(hf_model, b)
                                               for b in BATCHES}
    if "llama_cpp" in single:
        sweep["llama.cpp (one sequence)"] = {1: single["llama_cpp"]}
    results["decode_sweep"] = sweep
    print("decode tok/s by batch:", json.dumps(sweep), flush=True)

    for name, engine_llm in llms.items():
        elapsed, tokens = run_pagedserve(engine_llm, work)
        results[name] = {"seconds": elapsed, "output_tokens": tokens, "tok_s": tokens / elapsed,
                         "num_preemptions": engine_llm.kv_cache_stats().num_preemptions}
    if hf_model is not None and "hf_cb" in args.peers:
        elapsed, tokens = run_hf_cb(hf_model, work, args.kv_blocks, 16,
                                    args.max_num_batched_tokens)
        results["hf_cb"] = {"seconds": elapsed, "output_tokens": tokens,
                            "tok_s": tokens / elapsed}
    if hf_model is not None and "hf_static" in args.peers:
        elapsed, tokens = run_hf_static(hf_model, work)
        results["hf_static"] = {"seconds": elapsed, "output_tokens": tokens,
                                "tok_s": tokens / elapsed}

    labels = {name: name for name in llms}
    labels.update({"hf_static": "HF transformers static batching (32)",
                   "hf_cb": "HF transformers continuous batching"})
    for ours_name in llms:
        ours = results[ours_name]["tok_s"]
        print(f"\n| engine | output tokens | seconds | output tok/s | {ours_name} / engine |")
        print("|---|---:|---:|---:|---:|")
        for name, label in labels.items():
            if name in results:
                r = results[name]
                print(f"| {label} | {r['output_tokens']} | {r['seconds']:.1f} | "
                      f"{r['tok_s']:.1f} | {ours / r['tok_s']:.2f}x |")
    print("\nsingle-sequence decode: " + ", ".join(
        f"{k} {v:.1f} tok/s" for k, v in single.items() if k != "rounds"))
    for ours_name in llms:
        for peer, target in (("hf_generate", 2.0), ("llama_cpp", 0.5)):
            if peer in single:
                print(f"  {ours_name} / {peer}: {single[ours_name] / single[peer]:.2f}x "
                      f"(target >= {target}x)")
        if "llama_cpp" in single:
            print(f"{ours_name} at 32 sequences / llama.cpp single sequence: "
                  f"{sweep[ours_name][32] / single['llama_cpp']:.2f}x (target >= 4x)")
    if args.plot:
        plot(args.plot, sweep, str(dtype).removeprefix("torch."))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
