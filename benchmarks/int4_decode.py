"""The int4 mode's few-row matmuls (decode of up to ``quant.SMALL_ROWS`` sequences): the CPU
kernel ``int4_linear`` (activations as int16 per group of 32, integer dot products)
against torch's ``_weight_int4pack_mm_for_cpu`` (bfloat16 activations), on SmolLM2-135M-
Instruct in one process, against exact float32.

For each: perplexity on real English text with every token through the few-row path (prompt
chunks of ``--chunk`` tokens), the share of 32 chat prompts whose first 64 greedy tokens equal
float32's, and decode tokens/s of 1, 4 and 8 sequences (best of ``--rounds`` interleaved
rounds).

    python benchmarks/int4_decode.py
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from common import chats, commit_kv_cache, decode_rate, results_path, text_logprobs, text_windows

from pagedserve import LLM
from pagedserve.model.quant import Int4Linear


def use_torch_kernel(llm: LLM) -> int:
    """Give every Int4Linear of ``llm`` torch's int4 kernel form in place of int4_linear's
    (the same codes, scales and offsets); returns how many layers changed."""
    changed = 0
    for m in llm.llm_engine.model.modules():
        if isinstance(m, Int4Linear) and m.codes is not None:
            n, half = m.codes.shape
            b = m.codes.view(n, -1, 16)
            q = torch.stack([b & 15, b >> 4], 2).reshape(n, 2 * half).to(torch.int32)
            m.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            m.scales_and_zeros = m.scale_zero.transpose(0, 1).contiguous()
            m.codes = m.scale_zero = None
            changed += 1
    return changed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text-tokens", type=int, default=20_480)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=results_path("int4-decode.json"))
    args = ap.parse_args()
    configs = {"float32": {}, "int4, torch kernel (bf16 activations)": {"quantization": "int4"},
               "int4, int4_linear (int16 activations)": {"quantization": "int4"}}
    engines, rows = {}, {}
    for name, options in configs.items():
        llm = LLM(None, **options, kv_cache_memory=1 << 30, max_model_len=2048,
                  max_num_batched_tokens=args.chunk, enable_prefix_caching=False)
        if "torch kernel" in name:
            assert use_torch_kernel(llm) > 0
        windows = text_windows(llm.get_tokenizer(), args.text_tokens, 512)
        lps = text_logprobs(llm, windows)
        tokens, _ = chats(llm, 64)
        rows[name] = {"perplexity": math.exp(-sum(lps) / len(lps)), "tokens": tokens,
                      "num_text_tokens": len(lps)}
        commit_kv_cache(llm)
        engines[name] = llm
        print(name, f"perplexity {rows[name]['perplexity']:.3f}", flush=True)
    rates = {name: {b: [] for b in (1, 4, 8)} for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            for b in (1, 4, 8):
                rates[name][b].append(decode_rate(llm, b, 128, 64)["tokens_per_s"])
    ref = rows["float32"]
    print(f"\n{torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; perplexity over "
          f"{ref['num_text_tokens']:,} tokens in chunks of {args.chunk}")
    print("| configuration | perplexity | change | greedy 64 tokens = float32 | decode tok/s, "
          "batch 1 | batch 4 | batch 8 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    out = {"args": vars(args), "rows": {}}
    for name, r in rows.items():
        same = sum(a == b for a, b in zip(r["tokens"], ref["tokens"])) / len(ref["tokens"])
        best = {b: max(v) for b, v in rates[name].items()}
        out["rows"][name] = {"perplexity": r["perplexity"], "greedy_same": same,
                             "decode_tok_s": best, "rounds": rates[name]}
        print(f"| {name} | {r['perplexity']:.3f} | "
              f"{100 * (r['perplexity'] / ref['perplexity'] - 1):+.2f}% | {100 * same:.0f}% | "
              f"{best[1]:.1f} | {best[4]:.1f} | {best[8]:.1f} |")
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
