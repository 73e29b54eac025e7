"""KV memory saved by block sharing for parallel sampling (n > 1) and beam search, against the
same sequences each holding private blocks, on the default model.

Every sequence of a request shares the prompt's blocks through reference counts and copies a
block only when it writes into a shared one (copy-on-write); beams also share the blocks of
their common history. The saving is ``kv_sharing_saving`` of ``LLM.kv_cache_stats()``:
1 - (physical blocks in use) / (blocks the sequences' block tables hold, counted per
sequence), summed over all engine steps, i.e. the share of KV memory that private copies would
have needed on top. The PagedAttention paper (Kwon et al., SOSP 2023, section 6.3, fig. 15)
saw 6.1-9.8% for parallel sampling and 37.6-55.2% for beam search on Alpaca, and 16.2-30.5% /
44.3-66.3% with a shared prefix.

Two workloads, prompts cut from real English text, every sequence decoding a fixed number of
tokens (ignore_eos), prefix caching off so that only forks share: Alpaca-like (prompt lengths
log-normal with mean 20 tokens, as the paper's Alpaca inputs; 64 output tokens) and
ShareGPT-like (the prompt lengths of ``throughput.py``, mean near 160; 128 output tokens). The
saving grows with the prompt's share of each sequence and with the width.

    python benchmarks/sharing.py
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import english_text, lognormal_lengths

from pagedserve import LLM, BeamSearchParams, SamplingParams

WORKLOADS = {"Alpaca-like": (20, 64), "ShareGPT-like": (160, 128)}  # mean prompt, output len


def make_prompts(tokenizer, n: int, mean_prompt_len: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    corpus = tokenizer.encode(english_text())
    prompts, offset = [], 0
    for length in lognormal_lengths(rng, n, mean_prompt_len):
        prompts.append({"prompt_token_ids": corpus[offset:offset + length]})
        offset += length
    return prompts


def run(model, prompts, mode: str, width: int, max_tokens: int) -> tuple:
    # A fresh engine per row, so that the statistics cover this row only.
    llm = LLM(model, dtype="float32", kv_cache_memory=2 << 30, enable_prefix_caching=False)
    t0 = time.perf_counter()
    if mode == "parallel sampling":
        params = SamplingParams(n=width, temperature=0.8, top_p=0.95, seed=0,
                                max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
    else:
        llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                  ignore_eos=True))
    return llm.kv_cache_stats(), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 4, 6])
    args = ap.parse_args()

    probe = LLM(args.model, num_kv_blocks=64)
    tokenizer, model = probe.get_tokenizer(), str(probe.llm_engine.model_path)
    del probe
    print("| workload | decoding | width | KV memory saved by sharing | peak KV blocks | seconds |")
    print("|---|---|---:|---:|---:|---:|")
    for workload, (mean_prompt_len, max_tokens) in WORKLOADS.items():
        prompts = make_prompts(tokenizer, args.num_requests, mean_prompt_len)
        lens = [len(p["prompt_token_ids"]) for p in prompts]
        name = f"{workload} ({sum(lens) / len(lens):.0f} + {max_tokens})"
        for mode in ("parallel sampling", "beam search"):
            for width in args.widths:
                stats, seconds = run(model, prompts, mode, width, max_tokens)
                print(f"| {name} | {mode} | {width} | {stats.kv_sharing_saving:.1%} | "
                      f"{stats.peak_used_blocks} | {seconds:.0f} |", flush=True)
    print(f"\nworkload (mean prompt tokens + output tokens per sequence), "
          f"{args.num_requests} requests per row")


if __name__ == "__main__":
    main()
