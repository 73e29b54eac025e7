"""Quantized KV caches against the unquantized cache on SmolLM2-135M-Instruct, in one process.

For each ``kv_cache_dtype`` it prints:
- blocks: how many KV blocks the same memory holds, and the ratio to float16's and float32's
  (every mode at the same ``--block-size``, 32 by default: a quantized cache's default);
- perplexity on real English text (benchmarks/common.py), teacher-forced through the paged
  cache: windows of ``--window`` tokens, prefilled in chunks of 512 so later chunks read the
  stored (quantized) K/V of earlier ones, the logprob of every token after the first of its
  window (``SamplingParams(prompt_logprobs=0)``);
- mean |logprob difference| of those text tokens against the reference cache;
- greedy agreement: the share of 32 chat prompts whose first 64 greedy tokens equal the
  reference's, and the mean |logprob difference| of the chosen tokens over the tokens both runs
  share (up to the first divergence);
- decode throughput: output tokens/s of 64 and of 256 sequences decoding together (256-token
  prompts, 33 greedy tokens each, prefill excluded), one engine per ``--throughput-modes``
  mode with room for all of them, the modes run in turn for ``--rounds`` interleaved rounds
  after a warm-up round; the median round counts (the machine is noisy) and its ratio to
  float32's is printed.

The model computes in ``--dtype`` (float32 by default, so the reference cache loses nothing);
only the cache's storage changes between rows.

    python benchmarks/kv_quant.py                          # all modes, >= 20,000 text tokens
    python benchmarks/kv_quant.py --modes float32 int8 --text-tokens 4000   # a quick look
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import time
from pathlib import Path

from common import chats, decode_rate, text_logprobs, text_windows

from pagedserve import LLM, planner
from pagedserve.loader.fetched import default_model_path

MODES = ("float32", "bfloat16", "float16", "int8", "fp8", "int4")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="float32", help="the model's compute dtype")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                    help="KV cache dtypes; the first is the reference")
    ap.add_argument("--text-tokens", type=int, default=20_480,
                    help="text tokens scored for perplexity (at least this many)")
    ap.add_argument("--window", type=int, default=1024, help="tokens per perplexity window")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per chat")
    ap.add_argument("--memory", type=float, default=1.0, help="KV memory in GiB per mode")
    ap.add_argument("--rounds", type=int, default=3, help="throughput rounds per mode")
    ap.add_argument("--throughput-modes", nargs="*", default=["float32", "int8", "int4"],
                    choices=MODES, help="modes whose decode throughput is measured")
    ap.add_argument("--batches", nargs="+", type=int, default=[64, 256],
                    help="sequences decoding together")
    ap.add_argument("--block-size", type=int, default=32, help="KV block size of every mode")
    ap.add_argument("--output", default=None, help="write the rows as JSON here")
    args = ap.parse_args()

    model = args.model or str(default_model_path())
    memory = int(args.memory * 2**30)
    rows, ref = [], None
    for mode in args.modes:
        llm = LLM(model, dtype=args.dtype, kv_cache_dtype=mode, kv_cache_memory=memory,
                  max_model_len=2048, block_size=args.block_size)
        if ref is None:
            windows = text_windows(llm.get_tokenizer(), args.text_tokens, args.window)
        t0 = time.perf_counter()
        lps = text_logprobs(llm, windows)
        text_s = time.perf_counter() - t0
        tokens, chosen = chats(llm, args.max_tokens)
        stats = llm.kv_cache_stats()
        row = dict(mode=mode, block_size=args.block_size, num_blocks=stats.num_blocks,
                   kv_bytes_per_token=stats.kv_bytes_per_token,
                   num_text_tokens=len(lps), perplexity=math.exp(-sum(lps) / len(lps)),
                   text_seconds=text_s)
        if ref is None:
            ref = dict(lps=lps, tokens=tokens, chosen=chosen, row=row)
        else:
            row["text_logprob_mad"] = sum(abs(a - b) for a, b in zip(lps, ref["lps"])) / len(lps)
            row["greedy_identical"] = sum(a[:64] == b[:64] for a, b in
                                          zip(tokens, ref["tokens"])) / len(tokens)
            diffs = []
            for ta, tb, la, lb in zip(tokens, ref["tokens"], chosen, ref["chosen"]):
                for x, y, lx, ly in zip(ta, tb, la, lb):
                    if x != y:
                        break
                    diffs.append(abs(lx - ly))
            row["chosen_logprob_mad"] = sum(diffs) / len(diffs)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del llm
        gc.collect()

    # decode throughput: engines with room for the largest batch (memory is committed only as
    # blocks are written), modes in turn within each round
    engines = {m: LLM(model, dtype=args.dtype, kv_cache_dtype=m, max_model_len=2048,
                      block_size=args.block_size, max_num_seqs=max(args.batches),
                      num_kv_blocks=max(args.batches) * (320 // args.block_size + 2))
               for m in args.throughput_modes}
    throughput = {}
    for batch in args.batches:
        rates: dict[str, list[float]] = {m: [] for m in engines}
        for r in range(args.rounds + 1):  # round 0 warms up (and fills the prefix cache)
            for mode, llm in engines.items():
                rate = decode_rate(llm, batch, prompt_len=256, decode_tokens=32)
                if r:
                    rates[mode].append(rate["tokens_per_s"])
        throughput[batch] = {m: statistics.median(v) for m, v in rates.items()}
        print(json.dumps({"batch": batch, "rounds": rates}), flush=True)
    for r in rows:
        r["decode_tokens_per_s"] = {b: t[r["mode"]] for b, t in throughput.items()
                                    if r["mode"] in t}

    blocks = {r["mode"]: r["num_blocks"] for r in rows}
    shape = planner.load_shape(model)
    for kv in ("float32", "float16"):  # the ratio needs both even when a mode was not run
        if kv not in blocks:
            blocks[kv] = planner.make_plan(shape, memory + 1, weight_bytes=1,
                                           kv_cache_dtype=kv,
                                           block_size=args.block_size).num_blocks
    base = rows[0]
    print(f"\nSmolLM2-135M-Instruct, model in {args.dtype}, {args.memory:g} GiB of KV in blocks "
          f"of {args.block_size}; perplexity over {base['num_text_tokens']:,} tokens; reference "
          f"cache {base['mode']}")
    print(f"{'kv_cache_dtype':>14} {'bytes/token':>11} {'blocks':>7} {'vs fp16':>7} "
          f"{'vs fp32':>7} {'perplexity':>10} {'ppl diff':>8} {'|dlogp| text':>12} "
          f"{'greedy same':>11} {'|dlogp| chosen':>14}")
    for r in rows:
        extra = ("-", "-", "-", "-") if r is base else (
            f"{100 * (r['perplexity'] / base['perplexity'] - 1):+.2f}%",
            f"{r['text_logprob_mad']:.4f}", f"{100 * r['greedy_identical']:.0f}%",
            f"{r['chosen_logprob_mad']:.4f}")
        print(f"{r['mode']:>14} {r['kv_bytes_per_token']:>11,} {r['num_blocks']:>7,} "
              f"{r['num_blocks'] / blocks['float16']:>6.2f}x "
              f"{r['num_blocks'] / blocks['float32']:>6.2f}x {r['perplexity']:>10.3f} "
              f"{extra[0]:>8} {extra[1]:>12} {extra[2]:>11} {extra[3]:>14}")
    print("\ndecode tokens/s, median of interleaved rounds (ratio to float32)")
    for batch, t in throughput.items():
        ref_rate = t.get("float32")
        print(f"{batch:>4} sequences: " + ", ".join(
            f"{m} {v:.0f}" + (f" ({v / ref_rate:.2f}x)" if ref_rate else "")
            for m, v in t.items()))
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
