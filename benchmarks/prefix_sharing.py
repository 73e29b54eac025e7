"""Prefix caching on a shared system prompt: 50 requests that start with the same 800-token
system prompt (real English text) and ask different short questions, with automatic prefix
caching on and off, on the same model, in one process.

    python benchmarks/prefix_sharing.py

Prints the time, the peak number of KV blocks in use and the prefix-cache hit rate of each run,
and the speed-up (target: at least 5x with caching on).
"""

from __future__ import annotations

import argparse
import time

from common import english_paragraphs

from pagedserve import LLM, SamplingParams


def make_prompts(tokenizer, num_requests: int, prefix_tokens: int) -> list[dict]:
    paragraphs = english_paragraphs()
    system = tokenizer.encode(" ".join(paragraphs[:40]))[:prefix_tokens]
    prompts = []
    for i in range(num_requests):
        question = tokenizer.encode(" Question: " + paragraphs[100 + i][:120] + "?")
        prompts.append({"prompt_token_ids": system + question})
    return prompts


def run(model, prompts, caching: bool, max_tokens: int) -> dict:
    llm = LLM(model, dtype="float32", kv_cache_memory=2 << 30, enable_prefix_caching=caching)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    stats = llm.kv_cache_stats()
    return {"seconds": seconds, "peak_blocks": stats.peak_used_blocks,
            "hit_rate": stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
            "tokens": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=50)
    ap.add_argument("--prefix-tokens", type=int, default=800)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    probe = LLM(args.model, num_kv_blocks=64)  # the tokenizer, and the model fetched once
    prompts = make_prompts(probe.get_tokenizer(), args.num_requests, args.prefix_tokens)
    model = str(probe.llm_engine.model_path)
    del probe
    lens = [len(p["prompt_token_ids"]) for p in prompts]
    print(f"{len(prompts)} requests, {args.prefix_tokens}-token shared system prompt, prompts "
          f"{min(lens)}-{max(lens)} tokens, {args.max_tokens} output tokens each")
    off = run(model, prompts, False, args.max_tokens)
    on = run(model, prompts, True, args.max_tokens)
    assert on["tokens"] == off["tokens"], "prefix caching changed the greedy tokens"
    print("\n| prefix caching | seconds | peak KV blocks | prefix-cache hit rate |")
    print("|---|---:|---:|---:|")
    for name, r in (("off", off), ("on", on)):
        print(f"| {name} | {r['seconds']:.1f} | {r['peak_blocks']} | {r['hit_rate']:.1%} |")
    bs = 16
    full = [-(-(n + args.max_tokens - 1) // bs) for n in lens]  # blocks each request fills
    once = args.prefix_tokens // bs + sum(f - args.prefix_tokens // bs for f in full)
    print(f"\nblocks for all {len(lens)} requests at once: {sum(full)} with {len(lens)} copies "
          f"of the prefix, {once} with the prefix stored once ({args.prefix_tokens // bs} "
          f"prefix blocks + the tails)")
    print(f"speed-up with caching on: {off['seconds'] / on['seconds']:.1f}x (target >= 5x); "
          f"identical greedy tokens: yes")


if __name__ == "__main__":
    main()
