"""KV memory utilization, paged against contiguous reservation (the ablation behind paging):
the ShareGPT-like workload of ``throughput.py`` through the same engine with
``kv_allocator="paged"`` and ``"contiguous"`` (max_model_len slots reserved per request from a
first-fit arena, as pre-paging servers did), the same KV memory, in one process.

    python benchmarks/kv_utilization.py [--num-requests 32] [--plot docs/kv-utilization.png]

Prints, per mode: slots holding K/V over slots reserved (time-averaged over steps and at the
peak), the most requests running at once, preemptions, seconds and output tokens/s; saves a
plot of used and reserved slots over the steps. Targets: paged at least 96% (PagedAttention,
Kwon et al., SOSP 2023, fig. 2: 20-40% for pre-paging systems) and at least 2.5x the peak
concurrency of contiguous.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import make_workload

from pagedserve import LLM, SamplingParams
from pagedserve.sampling_params import RequestOutputKind


def run(model: str, work, mode: str, args) -> dict:
    llm = LLM(model, dtype=args.dtype, num_kv_blocks=args.num_kv_blocks,
              max_model_len=args.max_model_len, enable_prefix_caching=False,
              kv_allocator=mode, max_num_seqs=256)
    engine = llm.llm_engine
    bs = engine.cache_config.block_size
    for i, (prompt, out_len) in enumerate(work):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(
            temperature=0, max_tokens=out_len, ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY))
    used, reserved, tokens = [], [], 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += len(out.outputs[0].token_ids)
        live = [s for r in engine.scheduler.running for s in r.live_seqs]
        used.append(sum(s.num_computed_tokens for s in live))
        bm = engine.block_manager
        reserved.append(bs * getattr(bm, "num_reserved_blocks", bm.pool.num_used_blocks))
    seconds = time.perf_counter() - t0
    stats = llm.kv_cache_stats()
    return {"mode": mode, "stats": stats, "seconds": seconds, "tok_s": tokens / seconds,
            "used": used, "reserved": reserved}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--num-kv-blocks", type=int, default=1024,
                    help="the KV memory of both modes, in blocks of 16 tokens")
    ap.add_argument("--max-model-len", type=int, default=2048,
                    help="what contiguous reserves per request (prompt and output are each "
                         "clipped to 1024)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--plot", default=str(Path(__file__).parent.parent / "docs" /
                                          "kv-utilization.png"))
    args = ap.parse_args()
    probe = LLM(args.model, num_kv_blocks=64)
    work = make_workload(probe.get_tokenizer(), args.num_requests)
    model = str(probe.llm_engine.model_path)
    del probe
    print(f"{len(work)} requests (ShareGPT-like, {sum(len(p) + o for p, o in work)} tokens), "
          f"{args.num_kv_blocks} blocks of 16 = {args.num_kv_blocks * 16} token slots of KV "
          f"cache, max_model_len {args.max_model_len}, {args.dtype}\n")
    results = [run(model, work, mode, args) for mode in ("paged", "contiguous")]
    print("| allocator | slots used / reserved (time-avg) | at the peak | max running | "
          "preemptions | seconds | output tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        s = r["stats"]
        print(f"| {r['mode']} | {s.reserved_slot_utilization:.1%} | "
              f"{s.reserved_slot_utilization_at_peak:.1%} | {s.max_num_running} | "
              f"{s.num_preemptions} | {r['seconds']:.0f} | {r['tok_s']:.1f} |")
    paged, contiguous = (r["stats"] for r in results)
    print(f"\npeak concurrency paged / contiguous: "
          f"{paged.max_num_running / contiguous.max_num_running:.1f}x (target >= 2.5x); "
          f"throughput {results[0]['tok_s'] / results[1]['tok_s']:.2f}x")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, r in zip(axes, results):
        ax.fill_between(range(len(r["reserved"])), r["reserved"], step="post", alpha=0.3,
                        label="reserved slots")
        ax.plot(r["used"], label="slots holding K/V")
        ax.axhline(args.num_kv_blocks * 16, color="k", lw=0.8, ls="--", label="KV capacity")
        ax.set(title=f"{r['mode']}: {r['stats'].reserved_slot_utilization:.0%} of reserved "
               "slots used", xlabel="engine step")
    axes[0].set_ylabel("token slots")
    axes[0].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
