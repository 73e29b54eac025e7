"""Offline throughput on a ShareGPT-like workload: pagedserve against HF transformers static
batching, on the same model, weights, dtype and threads, in one process.

Workload: prompt and output lengths drawn from fixed-seed log-normal distributions (means near
160 and 340 tokens, clipped to 8..1024); prompts are windows of real English text
(benchmarks/corpus.py); outputs are forced to their length with ignore_eos. The peer runs
``generate`` in batches of 32 in arrival order, each batch left-padded and run to its longest
output; only the requested tokens count. Both decode greedily.

    python benchmarks/throughput.py                # 64 requests, both engines
    python benchmarks/throughput.py --skip-peer    # pagedserve only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from corpus import english_text  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402


def lognormal_lengths(rng, n: int, mean: float, sigma: float = 0.8) -> list[int]:
    mu = np.log(mean) - sigma**2 / 2  # so that the (unclipped) mean is ``mean``
    return np.clip(rng.lognormal(mu, sigma, n).round(), 8, 1024).astype(int).tolist()


def make_workload(tokenizer, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt token ids, output length) pairs in arrival order."""
    rng = np.random.default_rng(seed)
    prompt_lens = lognormal_lengths(rng, n, 160)
    output_lens = lognormal_lengths(rng, n, 340)
    corpus = tokenizer.encode(english_text())
    work, offset = [], 0
    for p, o in zip(prompt_lens, output_lens):
        if offset + p > len(corpus):
            offset = 0
        work.append((corpus[offset:offset + p], o))
        offset += p
    return work


def run_pagedserve(llm: LLM, work) -> tuple[float, int]:
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(o for _, o in work)
    return elapsed, tokens


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
        print(f"  HF batch {start // batch_size + 1}: {time.perf_counter() - t0:.0f}s", flush=True)
    return time.perf_counter() - t0, sum(o for _, o in work)


def single_sequence_decode(llm: LLM, hf_model, prompt: list[int], n: int = 128) -> dict:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)  # warm-up
    engine = llm.llm_engine
    engine.add_request("single", {"prompt_token_ids": prompt}, params)
    engine.step()  # prefill + first token
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    ours = (n - 1) / (time.perf_counter() - t0)
    result = {"pagedserve_tok_s": ours}
    if hf_model is not None:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            hf_model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)  # warm-up
            t0 = time.perf_counter()
            hf_model.generate(input_ids=ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            hf_model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            result["hf_tok_s"] = (n - 1) / (time.perf_counter() - t0 - prefill)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=4 << 30)
    work = make_workload(llm.get_tokenizer(), args.num_requests)
    print(f"workload: {len(work)} requests, prompt tokens mean {np.mean([len(p) for p, _ in work]):.0f}"
          f", output tokens mean {np.mean([o for _, o in work]):.0f} (total {sum(o for _, o in work)})"
          f"; torch threads {torch.get_num_threads()}, dtype {args.dtype}")

    hf_model = None
    if not args.skip_peer:
        from transformers import AutoModelForCausalLM

        path = llm.llm_engine.model_path
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=getattr(torch, args.dtype)).eval()

    results = {"num_requests": len(work), "dtype": args.dtype}
    single = single_sequence_decode(llm, hf_model, work[0][0])
    results["single_sequence"] = single

    elapsed, tokens = run_pagedserve(llm, work)
    results["pagedserve"] = {"seconds": elapsed, "output_tokens": tokens,
                             "tok_s": tokens / elapsed}
    stats = llm.kv_cache_stats()
    results["pagedserve"]["peak_used_blocks"] = stats.peak_used_blocks
    results["pagedserve"]["num_preemptions"] = stats.num_preemptions
    if hf_model is not None:
        elapsed, tokens = run_hf_static(hf_model, work)
        results["hf_static"] = {"seconds": elapsed, "output_tokens": tokens,
                                "tok_s": tokens / elapsed}

    print("\n| engine | output tokens | seconds | output tok/s |")
    print("|---|---:|---:|---:|")
    for name in ("pagedserve", "hf_static"):
        if name in results:
            r = results[name]
            label = "HF transformers static batching (32)" if name == "hf_static" else name
            print(f"| {label} | {r['output_tokens']} | {r['seconds']:.1f} | {r['tok_s']:.1f} |")
    if "hf_static" in results:
        ratio = results["pagedserve"]["tok_s"] / results["hf_static"]["tok_s"]
        results["throughput_ratio"] = ratio
        print(f"\nthroughput ratio pagedserve / HF static: {ratio:.2f}x (target >= 2.0x)")
    line = f"single-sequence decode: pagedserve {single['pagedserve_tok_s']:.1f} tok/s"
    if "hf_tok_s" in single:
        line += (f", HF generate {single['hf_tok_s']:.1f} tok/s, ratio "
                 f"{single['pagedserve_tok_s'] / single['hf_tok_s']:.2f}x (target >= 1.0x)")
    print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
