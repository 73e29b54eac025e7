"""Offline prefill rate of SmolLM2-135M-Instruct: prompt tokens/s of distinct 512-token prompts
(one output token each, engine defaults otherwise), for each prefill mode and, with
``--baseline-src``, an older checkout's default, each in its own process and alternating round
by round; then where one step's time goes (torch profiler, self CPU time by kind of op).
``--attention`` instead times one layer's prefill attention on SmolLM2's shapes: the
``paged_prefill_attention`` kernel against torch's CPU flash attention over the same keys.

    python benchmarks/prefill.py [--baseline-src ../old-worktree [--baseline-modes int4]]
    python benchmarks/prefill.py --attention
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

from common import positive, results_path

MODES = {"float32": {"prefill_dtype": "float32"}, "bfloat16 prompts": {"prefill_dtype": "bfloat16"},
         "int4": {"quantization": "int4"}}
# self-CPU-time buckets of the profile, by op name
KINDS = (("linear layers", ("linear", "addmm", "mm", "matmul", "packed_linear", "int8_linear",
                            "silu_and_mul")),
         ("prefill attention", ("attention", "flash", "scaled_dot_product", "softmax", "bmm")),
         ("norms, rotary + K/V write", ("rms_norm", "rotary", "index_copy", "embedding")))


def child(mode: str, prompt_len: int, n: int, profile: bool) -> None:
    """One mode in this process: prints {"tok_s": ..., "profile": {kind: seconds}} as JSON."""
    from common import commit_kv_cache, prefill_rate

    from pagedserve import LLM

    kwargs = json.loads(mode)
    llm = LLM(None, kv_cache_memory=1 << 29, max_model_len=4096, **kwargs)
    commit_kv_cache(llm)
    prefill_rate(llm, prompt_len, 2)  # warm-up
    out = {"tok_s": prefill_rate(llm, prompt_len, n)}
    if profile:
        import torch

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            seconds = prompt_len * 4 / prefill_rate(llm, prompt_len, 4)
        kinds = {name: 0.0 for name, _ in KINDS}
        other = 0.0
        for event in prof.key_averages():
            t = event.self_cpu_time_total / 1e6
            name = event.key.lower()
            kind = next((k for k, keys in KINDS if any(s in name for s in keys)), None)
            if kind is None:
                other += t
            else:
                kinds[kind] += t
        out["profile"] = {**kinds, "other": other, "wall (4 prompts)": seconds}
    print(json.dumps(out))


def attention(lengths=(512, 2048), heads=9, kv_heads=3, d=64, block_size=16) -> dict:
    """ms per call of one layer's causal prefill attention of one prompt, kernel and flash."""
    import time

    import torch

    from pagedserve.kernels import load

    ops, out = load(), {}
    for n in lengths:
        blocks = n // block_size
        k = torch.randn(blocks, block_size, kv_heads, d)
        v = torch.randn_like(k)
        q = torch.randn(n, heads, d)
        table = torch.randperm(blocks)[None]
        lens = torch.tensor([n])
        kf = k[table[0]].view(1, n, kv_heads, d).transpose(1, 2).repeat_interleave(
            heads // kv_heads, 1)
        vf = v[table[0]].view(1, n, kv_heads, d).transpose(1, 2).repeat_interleave(
            heads // kv_heads, 1)
        calls = {
            "kernel": functools.partial(ops.paged_prefill_attention, q, k, v, table, lens, lens,
                                        d ** -0.5, torch.float32, 0),
            "torch flash": functools.partial(
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                q.transpose(0, 1)[None], kf, vf, 0.0, True, scale=d ** -0.5)}
        out[n] = {}
        for name, f in calls.items():
            for _ in range(3):
                f()
            t0 = time.perf_counter()
            for _ in range(20):
                f()
            ms = (time.perf_counter() - t0) * 50
            # causal work: half of the 2 * 2 * n * n * d multiply-adds per query head
            out[n][name] = {"ms": ms, "gflops": heads * n * n * d * 2 / ms / 1e6}
            print(f"{n} tokens, {name}: {ms:.1f} ms per layer, {out[n][name]['gflops']:.0f} "
                  "GFLOP/s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-src", type=Path, default=None,
                    help="an older checkout (its src/ is imported instead) run at its defaults")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--baseline-modes", nargs="+", default=[], choices=list(MODES),
                    help="run the older checkout in these modes (default: its own default)")
    ap.add_argument("--prompt-len", type=positive, default=512)
    ap.add_argument("--prompts", type=positive, default=8)
    ap.add_argument("--rounds", type=positive, default=2)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--attention", action="store_true",
                    help="time the prefill attention kernel against torch flash instead")
    ap.add_argument("--json", default=results_path("prefill.json"))
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, args.prompt_len, args.prompts, args.profile)
        return
    if args.attention:
        result = attention()
        if args.json:
            Path(results_path("prefill-attention.json")).write_text(json.dumps(result, indent=1))
        return
    here = Path(__file__).resolve().parent
    runs = {name: ({**os.environ}, kwargs) for name, kwargs in MODES.items()
            if name in args.modes}
    if args.baseline_src is not None:
        env = {**os.environ, "PYTHONPATH": f"{args.baseline_src.resolve() / 'src'}:{here}"}
        base_runs = {f"baseline {m}": (env, MODES[m]) for m in args.baseline_modes} or \
            {"baseline (older checkout, its default)": (env, {})}
        runs = {**base_runs, **runs}
    results: dict[str, list] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name, (env, kwargs) in runs.items():
            cmd = [sys.executable, str(here / "prefill.py"), "--child", json.dumps(kwargs),
                   "--prompt-len", str(args.prompt_len), "--prompts", str(args.prompts)]
            if r == args.rounds - 1:
                cmd.append("--profile")
            out = subprocess.run(cmd, env={**env, "PAGEDSERVE_LOGGING_LEVEL": "WARNING"},
                                 capture_output=True, text=True, check=True, cwd=here)
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(name, f"{results[name][-1]['tok_s']:.0f} tok/s", flush=True)
    first = next(iter(results))
    base = max(r["tok_s"] for r in results[first])
    print(f"\n{args.prompts} prompts of {args.prompt_len} tokens, best of {args.rounds} rounds; "
          f"ratios against {first!r}")
    print("| mode | prefill tok/s | ratio |")
    print("|---|---:|---:|")
    for name, rs in results.items():
        best = max(r["tok_s"] for r in rs)
        print(f"| {name} | {best:.0f} | {best / base:.2f}x |")
    print("\nprofile of 4 prompts (self CPU seconds; the last round's):")
    for name, rs in results.items():
        print(name, {k: round(v, 2) for k, v in rs[-1]["profile"].items()})
    if args.json:
        Path(args.json).write_text(json.dumps({
            "prompt_len": args.prompt_len, "prompts": args.prompts, "cpus": os.cpu_count(),
            "runs": results}, indent=1))


if __name__ == "__main__":
    main()
