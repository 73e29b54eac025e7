"""Decode on shared cores: single-sequence and 16-sequence decode tokens/s, quiet and with busy
loops (``python -c 'while 1: pass'``) beside the engine on the same cores, under OpenMP wait
settings: libgomp's default spin (300,000 spins before sleeping: ``GOMP_SPINCOUNT=300000``),
pagedserve's default (``pagedserve.cpu.SPIN_COUNT``, set on import) and
``OMP_WAIT_POLICY=PASSIVE`` (sleep at once). libgomp reads these when torch loads, so each
setting runs in its own process; settings alternate round by round.

    python benchmarks/shared_cores.py [--busy 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import results_path

SETTINGS = {"libgomp default (300,000 spins)": {"GOMP_SPINCOUNT": "300000"},
            "pagedserve default": {},
            "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
            "GOMP_SPINCOUNT=1000": {"GOMP_SPINCOUNT": "1000"},
            "GOMP_SPINCOUNT=100": {"GOMP_SPINCOUNT": "100"},
            "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"}}
DEFAULT_SETTINGS = list(SETTINGS)[:3]


def child(busy: int) -> None:
    """One setting: decode rates quiet, then beside ``busy`` busy loops; prints JSON."""
    from common import commit_kv_cache, decode_rate

    from pagedserve import LLM

    llm = LLM(None, kv_cache_memory=1 << 28, max_model_len=512)
    commit_kv_cache(llm)
    decode_rate(llm, 1, 64, 8)  # warm-up
    out = {}
    for load in (0, busy):
        procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(load)]
        time.sleep(0.5)
        try:
            out[str(load)] = {b: decode_rate(llm, b, 64, 32)["tokens_per_s"] for b in (1, 16)}
        finally:
            for p in procs:
                p.kill()
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=int, default=2, help="busy-loop processes beside the engine")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, choices=list(SETTINGS))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=results_path("shared-cores.json"))
    args = ap.parse_args()
    if args.child:
        child(args.busy)
        return
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    runs: dict[str, list] = {name: [] for name in args.settings}
    for _ in range(args.rounds):
        for name in args.settings:
            env = SETTINGS[name]
            out = subprocess.run([sys.executable, __file__, "--child", "--busy", str(args.busy)],
                                 env={**base, **env, "PAGEDSERVE_LOGGING_LEVEL": "WARNING"},
                                 capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(name, runs[name][-1], flush=True)
    print(f"\n{os.cpu_count()} CPUs, {args.busy} busy loops; best of {args.rounds} rounds")
    print("| OpenMP wait | batch 1 quiet | batch 1 shared | kept | batch 16 quiet | "
          "batch 16 shared | kept |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    table = {}
    for name, rs in runs.items():
        best = {load: {b: max(r[load][str(b)] for r in rs) for b in (1, 16)}
                for load in ("0", str(args.busy))}
        q, s = best["0"], best[str(args.busy)]
        table[name] = best
        print(f"| {name} | {q[1]:.1f} | {s[1]:.1f} | {100 * s[1] / q[1]:.0f}% | {q[16]:.0f} | "
              f"{s[16]:.0f} | {100 * s[16] / q[16]:.0f}% |")
    if args.json:
        Path(args.json).write_text(json.dumps({"busy": args.busy, "best": table, "runs": runs},
                                              indent=1))


if __name__ == "__main__":
    main()
