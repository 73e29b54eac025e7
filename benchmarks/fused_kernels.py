"""The fused CPU kernels (pagedserve/kernels) against the torch path they replace, in one
process: three engines on the same model decode with the kernels and packed weights (what
pagedserve runs), with the kernels but torch's (MKL's) matmuls (built under
``PAGEDSERVE_CPU_KERNELS=unpacked``), and without the kernels (``=0``: the torch path and the
sampler's torch argmax), in interleaved rounds, best of ``--rounds``.

For float32 and ``quantization="int4"``: decode tokens/s at 1, 8, 32, 64 and 128 sequences
(64-token prompts, prefill excluded, as roofline.py), and the ratios.

    python benchmarks/fused_kernels.py
    python benchmarks/fused_kernels.py --quantization none --batches 1 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from common import decode_rate, positive

from pagedserve import LLM, kernels

MODES = ("packed", "kernels", "torch")  # packed: what the engine runs
SWITCH = {"packed": "1", "kernels": "unpacked", "torch": "0"}  # PAGEDSERVE_CPU_KERNELS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantization", nargs="+", default=["none", "int4"],
                    choices=["none", "int4"])
    ap.add_argument("--batches", type=positive, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--rounds", type=positive, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.json and not Path(args.json).resolve().parent.is_dir():
        ap.error(f"--json: no directory for {args.json}")
    ops = kernels.load()
    if ops is None:
        print("the CPU kernels are not available here (PAGEDSERVE_CPU_KERNELS=0, or the build "
              "failed: see the warning above)", file=sys.stderr)
        return 1
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| configuration | sequences | torch path tok/s | kernels, MKL matmuls | kernels + packed "
          "| kernels / torch | packed / MKL matmuls |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    out = {}
    for quantization in args.quantization:
        llms = {}
        for mode in MODES:
            os.environ["PAGEDSERVE_CPU_KERNELS"] = SWITCH[mode]
            llms[mode] = LLM(args.model, dtype="float32", kv_cache_memory=1 << 30,
                             max_num_seqs=256,
                             quantization=None if quantization == "none" else quantization)
            decode_rate(llms[mode], 2, 64, 4)  # warm-up
        os.environ.pop("PAGEDSERVE_CPU_KERNELS")
        rates: dict[str, dict[int, list[float]]] = {m: {b: [] for b in args.batches}
                                                     for m in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                for b in args.batches:
                    rates[mode][b].append(
                        decode_rate(llms[mode], b, 64, 16 if b == 1 else 32)["tokens_per_s"])
        del llms
        name = "float32" if quantization == "none" else f"float32 + {quantization}"
        out[name] = {}
        for b in args.batches:
            t, k, p = (max(rates[m][b]) for m in ("torch", "kernels", "packed"))
            out[name][b] = {"torch": t, "kernels": k, "packed": p,
                            "rounds": {m: rates[m][b] for m in rates}}
            print(f"| {name} | {b} | {t:.1f} | {k:.1f} | {p:.1f} | {p / t:.2f}x | {p / k:.2f}x |",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
