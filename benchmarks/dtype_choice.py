"""The evidence behind the default dtype on CPU: exact float32 against float32 with bfloat16
matmuls for prompt tokens (``prefill_dtype``), bfloat16 weights and KV, and float32 with 4-bit
linear layers (``quantization="int4"``), on SmolLM2-135M-Instruct, in one process.

For each configuration: perplexity on real English text through the paged cache (as
``kv_quant.py``; every scored token is a prompt token), the share of 32 chat prompts whose
first 64 greedy tokens equal exact float32's, prefill tokens/s of 12 prompts of 512 tokens,
single-sequence decode tokens/s, and the decode tokens/s of 32 and 64 sequences together (the
best of ``--rounds`` interleaved rounds).

    python benchmarks/dtype_choice.py
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from common import chats, commit_kv_cache, decode_rate, prefill_rate, text_logprobs, text_windows

from pagedserve import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--text-tokens", type=int, default=20_480)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engines, rows = {}, {}
    configs = {"float32": {"dtype": "float32", "prefill_dtype": "float32"},
               "float32 + bfloat16 prompts": {"dtype": "float32", "prefill_dtype": "bfloat16"},
               "bfloat16": {"dtype": "bfloat16"},
               "float32 + int4 linear": {"dtype": "float32", "quantization": "int4"}}
    for dtype, options in configs.items():
        llm = LLM(args.model, **options, kv_cache_memory=1 << 30, max_model_len=2048,
                  max_num_batched_tokens=1024)
        windows = text_windows(llm.get_tokenizer(), args.text_tokens, 1024)
        lps = text_logprobs(llm, windows)
        tokens, _ = chats(llm, 64)
        rows[dtype] = {"perplexity": math.exp(-sum(lps) / len(lps)), "tokens": tokens,
                       "num_text_tokens": len(lps)}
        engines[dtype] = llm
        commit_kv_cache(llm)
        print(dtype, f"perplexity {rows[dtype]['perplexity']:.3f}", flush=True)
    rates = {d: {b: [] for b in ("prefill", 1, 32, 64)} for d in engines}
    for _ in range(args.rounds):
        for d, llm in engines.items():
            rates[d]["prefill"].append(prefill_rate(llm, 512, 12))
            for b in (1, 32, 64):
                rates[d][b].append(
                    decode_rate(llm, b, 64, 16 if b == 1 else 32)["tokens_per_s"])
    ref = rows["float32"]
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; perplexity over "
          f"{ref['num_text_tokens']:,} tokens")
    print("| configuration | perplexity | change | greedy 64 tokens = float32 | prefill tok/s "
          "(512) | decode tok/s, batch 1 | batch 32 | batch 64 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    out = {}
    for d, r in rows.items():
        same = sum(a == b for a, b in zip(r["tokens"], ref["tokens"])) / len(ref["tokens"])
        best = {b: max(v) for b, v in rates[d].items()}
        out[d] = {"perplexity": r["perplexity"], "greedy_same": same,
                  "decode_tok_s": best, "rounds": rates[d]}
        print(f"| {d} | {r['perplexity']:.3f} | "
              f"{100 * (r['perplexity'] / ref['perplexity'] - 1):+.2f}% | {100 * same:.0f}% | "
              f"{best['prefill']:.0f} | {best[1]:.1f} | {best[32]:.1f} | {best[64]:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
