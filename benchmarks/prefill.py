"""Offline prefill rate of SmolLM2-135M-Instruct: prompt tokens/s of distinct 512-token prompts
(one output token each, engine defaults otherwise), for each prefill mode and, with
``--baseline-src``, an older checkout's default, each in its own process and alternating round
by round; then where one step's time goes (torch profiler, self CPU time by kind of op).

    python benchmarks/prefill.py [--baseline-src ../old-worktree] [--rounds 2]
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-src", type=Path, default=None,
                    help="an older checkout (its src/ is imported instead) run at its defaults")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--prompt-len", type=positive, default=512)
    ap.add_argument("--prompts", type=positive, default=8)
    ap.add_argument("--rounds", type=positive, default=2)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=results_path("prefill.json"))
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, args.prompt_len, args.prompts, args.profile)
        return
    here = Path(__file__).resolve().parent
    runs = {name: ({**os.environ}, kwargs) for name, kwargs in MODES.items()
            if name in args.modes}
    if args.baseline_src is not None:
        env = {**os.environ, "PYTHONPATH": f"{args.baseline_src.resolve() / 'src'}:{here}"}
        runs = {"baseline (older checkout, its default)": (env, {}), **runs}
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
