"""Decode attention over a paged cache too large for the CPU's caches: ``paged_decode_attention``
for B sequences of one context length over 30 layers of SmolLM2's shapes (9 query / 3 KV heads,
head_dim 64, 16-token blocks scattered at random), as one decode step runs it. Prints ms per
step and the K/V bytes read per second; with ``--baseline-src`` an older checkout's kernel runs
in alternating processes, and the outputs of the two are compared bit for bit.

    python benchmarks/decode_attention.py [--baseline-src ../old-worktree]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import results_path

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def child(batch: int, context: int, dtype: str, out: str) -> None:
    """One measurement in this process; prints {"ms": ..., "gb_s": ...} and saves layer 0's
    output to ``out``."""
    import torch

    from pagedserve import kernels

    ops = kernels.load()
    torch.manual_seed(0)
    cache_dtype = getattr(torch, dtype)
    nb = -(-context // BLOCK)
    blocks = batch * nb + 64
    caches = [(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).to(cache_dtype),
               torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).to(cache_dtype))
              for _ in range(LAYERS)]  # 30 separate caches: a step's K/V does not stay cached
    tables = [torch.randperm(blocks)[:batch * nb].view(batch, nb).contiguous()
              for _ in range(LAYERS)]
    lens = torch.full((batch,), context, dtype=torch.int64)
    q = torch.randn(batch, HEADS, HEAD_DIM)

    def step():
        for (k, v), t in zip(caches, tables, strict=True):
            ops.paged_decode_attention(q, k, v, t, lens, HEAD_DIM ** -0.5, torch.float32, 0)

    for _ in range(3):
        step()
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    nbytes = LAYERS * batch * context * KV_HEADS * HEAD_DIM * 2 * caches[0][0].element_size()
    torch.save(ops.paged_decode_attention(q, *caches[0], tables[0], lens, HEAD_DIM ** -0.5,
                                          torch.float32, 0), out)
    print(json.dumps({"ms": best * 1e3, "gb_s": nbytes / best / 1e9}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=["16x330", "16x1000", "32x330", "1x1000",
                                                   "4x2000"],
                    help="BATCHxCONTEXT")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline-src", type=Path, default=None)
    ap.add_argument("--out", default=results_path("decode-attention.json"))
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        batch, context, dtype, out = args.child
        return child(int(batch), int(context), dtype, out)
    trees = {"now": Path(__file__).resolve().parents[1] / "src"}
    if args.baseline_src is not None:
        trees = {"baseline": args.baseline_src.resolve() / "src", **trees}
    tmp = Path(tempfile.mkdtemp(prefix="decode-attention-"))
    rows = []
    print(f"| B x context ({args.dtype} cache) | " + " | ".join(f"{k} ms (GB/s)" for k in trees)
          + (" | now / baseline | same bits |" if len(trees) > 1 else " |"))
    print("|---|" + "---:|" * (len(trees) + (2 if len(trees) > 1 else 0)))
    for case in args.cases:
        batch, context = map(int, case.split("x"))
        best = {}
        for _ in range(args.rounds):
            for name, src in trees.items():
                r = subprocess.run([sys.executable, __file__, "--child", str(batch), str(context),
                                    args.dtype, str(tmp / f"{name}.pt")], check=True,
                                   capture_output=True, text=True,
                                   env={**os.environ, "PYTHONPATH": str(src)})
                m = json.loads(r.stdout.strip().splitlines()[-1])
                if name not in best or m["ms"] < best[name]["ms"]:
                    best[name] = m
        row = {"batch": batch, "context": context, "dtype": args.dtype, **best}
        line = f"| {case} | " + " | ".join(f"{best[k]['ms']:.2f} ({best[k]['gb_s']:.1f})"
                                           for k in trees)
        if len(trees) > 1:
            import torch

            row["same_bits"] = torch.equal(torch.load(tmp / "now.pt"),
                                           torch.load(tmp / "baseline.pt"))
            row["speedup"] = best["baseline"]["ms"] / best["now"]["ms"]
            line += f" | {row['speedup']:.2f}x | {row['same_bits']} |"
        else:
            line += " |"
        print(line, flush=True)
        rows.append(row)
        Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
