"""Sliding-window KV paging on Gemma 3 270M: its 15 local layers (window 512) as KV groups that
return the blocks their window has passed, against keeping every layer's K/V for the whole
sequence (``disable_hybrid_kv_cache_manager=True``), with the same KV memory, in one process.

    python benchmarks/window_paging.py [--contexts 1024 4096] [--kv-cache-memory 640MiB]

For each context length: the blocks one sequence holds while decoding and the maximum
concurrency the memory allows (from the engine's KV layout), then a batch of requests of that
length (prompt of English text + generated tokens, greedy, ignore_eos) through each mode:
seconds, output and total tokens/s, the most requests running at once, peak KV bytes in use,
and whether the tokens agree. Results go to ``benchmarks/results/window-paging.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

from common import english_text, positive, results_path

from pagedserve import LLM, SamplingParams
from pagedserve.cli import parse_bytes
from pagedserve.kv.spec import cdiv
from pagedserve.sampling_params import RequestOutputKind


def workload(tokenizer, context: int, num_requests: int, output: int) -> list[list[int]]:
    """``num_requests`` prompts of ``context - output`` tokens, each from its own offset into
    the corpus (no prefix sharing)."""
    corpus = tokenizer.encode(english_text())
    size = context - output
    step = max(1, (len(corpus) - size) // num_requests)
    return [corpus[i * step:i * step + size] for i in range(num_requests)]


def run(llm: LLM, prompts: list[list[int]], output: int) -> dict:
    """All ``prompts`` queued at once, stepped to the end; the most requests running and the
    most KV blocks in use at any step of this run."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    preemptions = engine.scheduler.num_preemptions
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    outs, running, used = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[int(out.request_id)] = out.outputs[0].token_ids
        running = max(running, len(engine.scheduler.running))
        used = max(used, engine.block_manager.pool.num_used_blocks)
    seconds = time.perf_counter() - t0
    stats = llm.kv_cache_stats()
    block_bytes = stats.kv_groups[0].bytes_per_token * stats.block_size
    generated = sum(map(len, outs.values()))
    return {"seconds": round(seconds, 2),
            "output_tok_s": round(generated / seconds, 2),
            "total_tok_s": round((generated + sum(map(len, prompts))) / seconds, 2),
            "max_num_running": running,
            "num_preemptions": engine.scheduler.num_preemptions - preemptions,
            "peak_kv_mib": round(used * block_bytes / 2**20, 1),
            "tokens": [outs[i] for i in range(len(prompts))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--contexts", type=positive, nargs="+", default=[1024, 4096])
    ap.add_argument("--num-requests", type=positive, nargs="+", default=[24, 12],
                    help="requests per context (one number each)")
    ap.add_argument("--output-tokens", type=positive, default=128)
    ap.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("640MiB"))
    ap.add_argument("--block-size", type=positive, default=16)
    args = ap.parse_args()
    if len(args.num_requests) != len(args.contexts):
        ap.error("give --num-requests one number per context")

    engines = {}
    for mode in ("window", "whole"):
        engines[mode] = LLM(args.model, dtype="float32", block_size=args.block_size,
                            kv_cache_memory=args.kv_cache_memory, max_model_len=max(args.contexts),
                            enable_prefix_caching=False,
                            disable_hybrid_kv_cache_manager=mode == "whole")
    tokenizer = engines["window"].get_tokenizer()
    report = {"model": args.model, "kv_cache_memory": args.kv_cache_memory,
              "block_size": args.block_size, "contexts": []}
    for context, num in zip(args.contexts, args.num_requests):
        prompts = workload(tokenizer, context, num, args.output_tokens)
        row = {"context": context, "num_requests": num}
        for mode, llm in engines.items():
            engine = llm.llm_engine
            layout, blocks = engine.kv_cache.layout, engine.cache_config.num_blocks
            held = layout.blocks_per_seq(context, args.block_size, 1)
            row[mode] = {"blocks_per_seq": held, "block_layers": layout.slots,
                         "max_concurrency": round(blocks / held, 2),
                         **run(llm, prompts, args.output_tokens)}
            gc.collect()
        same = row["window"].pop("tokens") == row["whole"].pop("tokens")
        w, f = row["window"], row["whole"]
        row["same_tokens"] = same
        row["kv_bytes_ratio"] = round(f["blocks_per_seq"] * f["block_layers"]
                                      / (w["blocks_per_seq"] * w["block_layers"]), 2)
        row["throughput_ratio"] = round(w["output_tok_s"] / f["output_tok_s"], 2)
        report["contexts"].append(row)
        print(f"context {context}: {num} requests of {context - args.output_tokens} + "
              f"{args.output_tokens} tokens; same tokens: {same}")
        for mode in ("window", "whole"):
            r = row[mode]
            print(f"  {mode:6s} {r['blocks_per_seq']:5d} blocks of {r['block_layers']:2d} "
                  f"layers per sequence, max concurrency {r['max_concurrency']:6.2f}x; ran "
                  f"{r['max_num_running']:3d} at once, {r['num_preemptions']} preemptions, "
                  f"peak {r['peak_kv_mib']:.0f} MiB, {r['seconds']:.1f} s, "
                  f"{r['output_tok_s']:.1f} output tok/s, {r['total_tok_s']:.0f} total tok/s")
        print(f"  window/whole: {row['kv_bytes_ratio']:.2f}x less KV per sequence, "
              f"{row['throughput_ratio']:.2f}x output throughput")
    layout = engines["window"].llm_engine.kv_cache.layout
    report["held_at"] = {n: {"window": layout.blocks_per_seq(n, args.block_size, 1),
                             "whole": len(layout.groups) * cdiv(n, args.block_size)}
                         for n in (4096, 8192)}
    with open(results_path("window-paging.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
