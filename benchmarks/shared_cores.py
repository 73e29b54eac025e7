"""Decode and prefill on shared cores: decode tokens/s of 1, 16 and 64 sequences and prefill
tokens/s (256-token prompts), quiet and with busy loops (``python -c 'while 1: pass'``) beside
the engine on the same cores, under OpenMP wait settings: libgomp's default spin (300,000 spins
before sleeping: ``GOMP_SPINCOUNT=300000``), pagedserve's default (``pagedserve.cpu.SPIN_COUNT``,
set on import, and the contention guard) and ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once).
libgomp reads these when torch loads, so each setting runs in its own process; settings
alternate round by round. ``--baseline-src`` adds an older checkout's default as one more
setting.

``--rows-sweep`` instead measures what the contention guard's ``ROWS`` rests on: beside the
busy loops, with the guard off, decode of 8 to 64 sequences and prefill on one thread against
all threads under the spin throttle, alternating round by round in one process.

    python benchmarks/shared_cores.py [--busy 2] [--rounds 2] [--baseline-src ../old-worktree]
    python benchmarks/shared_cores.py --rows-sweep [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import busy_loops, results_path

from pagedserve.cpu import SPIN_COUNT

# The children import torch (through common) before pagedserve, too late for the spin limit
# pagedserve sets on import, so the default's setting passes it as importing pagedserve first
# would.
SETTINGS = {"libgomp default (300,000 spins)": {"GOMP_SPINCOUNT": "300000"},
            "pagedserve default": {"GOMP_SPINCOUNT": SPIN_COUNT},
            "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
            "GOMP_SPINCOUNT=1000": {"GOMP_SPINCOUNT": "1000"},
            "GOMP_SPINCOUNT=100": {"GOMP_SPINCOUNT": "100"},
            "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"}}
DEFAULT_SETTINGS = list(SETTINGS)[:3]
BATCHES = (1, 16, 64)
MEASURES = [f"batch {b}" for b in BATCHES] + ["prefill"]


def child(busy: int) -> None:
    """One setting: the rates quiet, then beside ``busy`` busy loops; prints JSON."""
    from common import commit_kv_cache, decode_rate, prefill_rate

    from pagedserve import LLM

    llm = LLM(None, kv_cache_memory=1 << 28, max_model_len=512)
    commit_kv_cache(llm)
    decode_rate(llm, 1, 64, 8)  # warm-up
    out = {}
    for load in (0, busy):
        with busy_loops(load):
            rates = {f"batch {b}": decode_rate(llm, b, 64, 32)["tokens_per_s"] for b in BATCHES}
            out[str(load)] = {**rates, "prefill": prefill_rate(llm, 256, 8)}
    print(json.dumps(out))


def rows_sweep(busy: int, rounds: int, path: str) -> None:
    """One thread against all threads with the spin throttle held, beside ``busy`` busy loops,
    the guard off (so neither changes mid-measurement)."""
    os.environ["PAGEDSERVE_CONTENTION_GUARD"] = "0"
    import torch
    from common import commit_kv_cache, decode_rate, prefill_rate

    from pagedserve import LLM
    from pagedserve.cpu import SpinThrottle

    llm = LLM(None, kv_cache_memory=1 << 28, max_model_len=512)
    commit_kv_cache(llm)
    decode_rate(llm, 1, 64, 8)  # warm-up
    threads, throttle = torch.get_num_threads(), SpinThrottle()
    modes = {"1 thread": False, f"{threads} threads, spin throttled": True}
    runs: dict[str, list] = {m: [] for m in modes}
    try:
        with busy_loops(busy):
            for _ in range(rounds):
                for mode, throttled in modes.items():
                    torch.set_num_threads(threads if throttled else 1)
                    if throttled and not throttle.hold(threads):
                        raise SystemExit("the spin throttle cannot be held here (no libgomp?)")
                    r = {f"batch {b}": decode_rate(llm, b, 64, 32)["tokens_per_s"]
                         for b in (8, 16, 32, 64)}
                    r["prefill"] = prefill_rate(llm, 256, 8)
                    throttle.release()
                    runs[mode].append(r)
                    print(mode, {k: round(v, 1) for k, v in r.items()}, flush=True)
    finally:
        torch.set_num_threads(threads)
    print(f"\n{busy} busy loops beside the engine; tokens/s, median of {rounds} rounds")
    measures = list(runs["1 thread"][0])
    print("| mode | " + " | ".join(measures) + " |")
    print("|---|" + "---:|" * len(measures))
    medians = {m: {k: statistics.median(r[k] for r in rs) for k in measures}
               for m, rs in runs.items()}
    for mode, med in medians.items():
        print(f"| {mode} | " + " | ".join(f"{med[k]:.0f}" for k in measures) + " |")
    Path(path).write_text(json.dumps({"busy": busy, "median": medians, "runs": runs}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=int, default=2, help="busy-loop processes beside the engine")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, choices=list(SETTINGS))
    ap.add_argument("--baseline-src", type=Path, default=None,
                    help="an older checkout whose default runs as one more setting")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help="where the results go (default: "
                    "results/shared-cores.json, with --rows-sweep results/shared-cores-rows.json)")
    ap.add_argument("--rows-sweep", action="store_true",
                    help="one thread against all threads under the spin throttle, by step size")
    args = ap.parse_args()
    if args.rows_sweep:
        rows_sweep(args.busy, args.rounds, args.json or results_path("shared-cores-rows.json"))
        return
    if args.child:
        child(args.busy)
        return
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    settings = {name: SETTINGS[name] for name in args.settings}
    if args.baseline_src is not None:
        here = Path(__file__).resolve().parent
        settings["previous version (--baseline-src), its default"] = {
            "PYTHONPATH": f"{args.baseline_src.resolve() / 'src'}:{here}",
            "GOMP_SPINCOUNT": SPIN_COUNT}
    runs: dict[str, list] = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, env in settings.items():
            out = subprocess.run([sys.executable, __file__, "--child", "--busy", str(args.busy)],
                                 env={**base, **env, "PAGEDSERVE_LOGGING_LEVEL": "WARNING"},
                                 capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(name, runs[name][-1], flush=True)
    print(f"\n{os.cpu_count()} CPUs, {args.busy} busy loops; tokens/s, best (median) of "
          f"{args.rounds} rounds; kept: shared / quiet of the same statistic")
    print("| setting | measure | quiet | beside the busy loops | kept |")
    print("|---|---|---:|---:|---:|")
    table, medians = {}, {}
    loads = ("0", str(args.busy))
    for name, rs in runs.items():
        best = {load: {m: max(r[load][m] for r in rs) for m in MEASURES} for load in loads}
        med = {load: {m: statistics.median(r[load][m] for r in rs) for m in MEASURES}
               for load in loads}
        table[name], medians[name] = best, med
        for m in MEASURES:
            q, s, mq, ms = best["0"][m], best[loads[1]][m], med["0"][m], med[loads[1]][m]
            print(f"| {name} | {m} | {q:.1f} ({mq:.1f}) | {s:.1f} ({ms:.1f}) | "
                  f"{100 * s / q:.0f}% ({100 * ms / mq:.0f}%) |")
    out = {"busy": args.busy, "best": table, "median": medians, "runs": runs}
    Path(args.json or results_path("shared-cores.json")).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
