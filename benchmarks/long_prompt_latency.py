"""What a long prompt arriving does to the streams already running, by chunk policy: 8 requests
decode, then a 2,048-token prompt arrives; per policy, the running streams' inter-token
latency (p50, p99, max) while the prompt is prefilled, the prompt's time to first token, and
the decode-only step time for scale. Offline engine, SmolLM2, default mode; policies
interleaved round by round, the median round kept.

A policy is ``long_prefill_token_threshold`` (the most prompt tokens one request computes per
step; 0: up to ``max_num_batched_tokens``) alone, written as the number, or ``itl:MS``: the
default threshold with ``itl_target_ms=MS`` (the step's prompt tokens sized by measured cost).

    python benchmarks/long_prompt_latency.py [--policies 0 256 128 64 itl:100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import numpy as np
from common import commit_kv_cache, results_path

from pagedserve import LLM, SamplingParams


def parse_policy(policy: str) -> dict:
    if policy.startswith("itl:"):
        return {"long_prefill_token_threshold": 256, "itl_target_ms": float(policy[4:])}
    return {"long_prefill_token_threshold": int(policy), "itl_target_ms": 0.0}


def one_round(llm: LLM, policy: str, prompt_len: int, streams: int, seed: int) -> dict:
    engine = llm.llm_engine
    # the one scheduler, re-bounded between rounds (SchedulerConfig is frozen)
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config,
                                                  **parse_policy(policy))
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"s{i}", {"prompt_token_ids": [(seed + 7 * i + j) % 20_000 + 100
                                                          for j in range(64)]}, params)
    for _ in range(20):  # every stream prefilled and decoding
        engine.step()
    last = {f"s{i}": time.perf_counter() for i in range(streams)}
    decode_steps = []
    for _ in range(5):
        t = time.perf_counter()
        engine.step()
        decode_steps.append(time.perf_counter() - t)
    long_prompt = [(seed * 3 + 11 * j) % 20_000 + 100 for j in range(prompt_len)]
    engine.add_request("long", {"prompt_token_ids": long_prompt},
                       SamplingParams(temperature=0, max_tokens=1))
    t0, gaps, ttft = time.perf_counter(), [], None
    last = {k: t0 for k in last}
    while ttft is None:
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id == "long":
                ttft = now - t0
            elif out.request_id in last:
                gaps.append(now - last[out.request_id])
                last[out.request_id] = now
    for i in range(streams):
        engine.abort_request(f"s{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return {"policy": policy, "ttft_s": ttft, "itl_p50_ms": 1e3 * np.percentile(gaps, 50),
            "itl_p99_ms": 1e3 * np.percentile(gaps, 99), "itl_max_ms": 1e3 * max(gaps),
            "decode_step_ms": 1e3 * statistics.median(decode_steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", nargs="+", default=["0", "256", "128", "64", "itl:100",
                                                      "itl:200"])
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=results_path("long-prompt-latency.json"))
    args = ap.parse_args()
    llm = LLM(None, kv_cache_memory=1 << 30, max_model_len=4096, enable_prefix_caching=False)
    commit_kv_cache(llm)
    for p in args.policies:
        parse_policy(p)  # a bad one fails before the first round
    runs: dict[str, list[dict]] = {p: [] for p in args.policies}
    for r in range(args.rounds):
        for i, p in enumerate(args.policies):
            runs[p].append(one_round(llm, p, args.prompt_len, args.streams, seed=r * 97 + i))
            print(runs[p][-1], flush=True)
    print(f"\n{args.streams} streams decoding, a {args.prompt_len}-token prompt arrives; "
          f"max_num_batched_tokens {llm.llm_engine.scheduler_config.max_num_batched_tokens}; "
          f"median of {args.rounds} rounds")
    print("| policy | streams' ITL p50 / p99 / max (ms) | x decode step | long prompt TTFT (s) |")
    print("|---|---:|---:|---:|")
    table = []
    for p, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "policy"}
        table.append({"policy": p, **med})
        name = (f"itl_target_ms {p[4:]}" if p.startswith("itl:")
                else f"long_prefill_token_threshold {p if p != '0' else 'off'}")
        print(f"| {name} | {med['itl_p50_ms']:.0f} / {med['itl_p99_ms']:.0f} / "
              f"{med['itl_max_ms']:.0f} | {med['itl_p99_ms'] / med['decode_step_ms']:.1f}x | "
              f"{med['ttft_s']:.2f} |")
    Path(args.json).write_text(json.dumps({"args": vars(args), "median": table, "runs":
                                           runs}, indent=1))


if __name__ == "__main__":
    main()
