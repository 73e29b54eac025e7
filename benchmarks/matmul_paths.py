"""The matmul paths of a step, by row count, on SmolLM2-135M's shapes: which kernel is fastest
at which number of rows, the measurement behind the engine's row thresholds.

Decoder projections (q|k|v 576 -> 960, o 576 -> 576, gate|up 576 -> 3072, down 1536 -> 576),
30 distinct copies of each so that the weights stream from memory as in a real step (one
copy stays in cache and flatters the few-row cases):

- ``packed_bf16``: the kernel ``packed_linear_bf16`` over weights packed once in panels of
  bfloat16 pairs (``vdpbf16ps`` with AVX512-BF16);
- ``onednn_bf16``: torch's bfloat16 ``F.linear`` (oneDNN) over the [out, in] copy;
- ``int4``: the kernel ``int4_linear`` over the 4-bit codes;
- ``packed_f32``: the float32 kernel ``packed_linear``.

Then the LM head (49,152 x 576) in the int4 mode's forms: ``int8_linear`` over the 8-bit
copy, the float32 panels and the bfloat16 panels, the cache flushed before every call.
Times are the best of ``--rounds`` interleaved rounds, in one process.

    python benchmarks/matmul_paths.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import results_path

from pagedserve import kernels
from pagedserve.cpu import cpu_flags, matrix_unit
from pagedserve.model.linear import pack_bf16_weight, pack_linear_weight
from pagedserve.model.quant import Int4Linear, quantize_q8_0

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) of one layer
LAYERS = 30
VOCAB, HIDDEN = 49152, 576


def best_time(fns: dict, rounds: int, before=None) -> dict[str, float]:
    """name -> the best of ``rounds`` timings (seconds) of fns[name](), the names interleaved
    within each round; ``before`` runs untimed before every call."""
    best: dict[str, float] = {}
    for f in fns.values():  # warm up: first-touch page faults, lazy init
        f()
    for _ in range(rounds):
        for name, f in fns.items():
            if before:
                before()
            t = time.perf_counter()
            f()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
    return best


def projection_calls(ops, layers: list[dict], xs: dict, xf: dict) -> dict:
    """path -> a call running every layer's projection once (x by input width: xs bfloat16,
    xf float32)."""
    return {
        "packed_bf16": lambda: [ops.packed_linear_bf16(xs[lay["k"]], lay["bf16"], lay["n"],
                                                       torch.bfloat16) for lay in layers],
        "onednn_bf16": lambda: [F.linear(xs[lay["k"]], lay["dense"]) for lay in layers],
        "int4": lambda: [ops.int4_linear(xs[lay["k"]], lay["codes"], lay["scale_zero"])
                         for lay in layers],
        "packed_f32": lambda: [ops.packed_linear(xf[lay["k"]], lay["f32"], None, lay["n"])
                               for lay in layers],
    }


def head_calls(ops, x: torch.Tensor, q8, f32: torch.Tensor, bf16: torch.Tensor) -> dict:
    """form -> a call of the LM head on x [rows, HIDDEN] float32 in that form."""
    xb = x.bfloat16()
    return {"int8": lambda: ops.int8_linear(x, *q8),
            "packed_f32": lambda: ops.packed_linear(x, f32, None, VOCAB),
            "packed_bf16": lambda: ops.packed_linear_bf16(xb, bf16, VOCAB, torch.float32)}


def projections(ops, rows: list[int], rounds: int) -> list[dict]:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        for k, n in SHAPES:
            q4 = Int4Linear.from_weight(torch.randn(n, k) * 0.05)  # plain: keeps .dense
            dense = q4.dense.bfloat16()  # (float32 where the CPU has no bfloat16 unit)
            layers.append({"n": n, "k": k, "dense": dense.contiguous(),
                           "bf16": pack_bf16_weight(dense.float()),
                           "f32": pack_linear_weight(dense.float())})
    # the int4 kernel's form of the same weights (re-quantized: they are on a 4-bit grid
    # already, so the codes hold the same values up to the scales' bfloat16 rounding)
    for lay in layers:
        q = Int4Linear.from_weight(lay["dense"].float(), ops=ops)
        lay["codes"], lay["scale_zero"] = q.codes, q.scale_zero
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k).bfloat16() for k, _ in SHAPES}
        xf = {k: x.float() for k, x in xs.items()}
        fns = projection_calls(ops, layers, xs, xf)
        best = best_time(fns, rounds)
        flops = 2 * m * sum(k * n for k, n in SHAPES) * LAYERS
        row = {"rows": m, **{f"{k}_ms": v * 1e3 for k, v in best.items()},
               **{f"{k}_gflops": flops / v / 1e9 for k, v in best.items()}}
        out.append(row)
        print(f"{m:4d} rows  " + "  ".join(f"{k} {v * 1e3:6.2f} ms ({flops / v / 1e9:3.0f} GFLOP/s)"
                                           for k, v in best.items()), flush=True)
    return out


def lm_head(ops, rows: list[int], rounds: int) -> list[dict]:
    torch.manual_seed(1)
    w = torch.randn(VOCAB, HIDDEN) * 0.05
    q8, f32, bf16 = quantize_q8_0(w), pack_linear_weight(w), pack_bf16_weight(w)
    flush = torch.empty(64 << 20)  # 256 MB written between calls: the head comes from memory
    out = []
    for m in rows:
        fns = head_calls(ops, torch.randn(m, HIDDEN), q8, f32, bf16)
        best = best_time(fns, rounds, before=lambda: flush.fill_(1.0))
        out.append({"rows": m, **{f"{k}_ms": v * 1e3 for k, v in best.items()}})
        print(f"LM head {m:3d} rows  " + "  ".join(f"{k} {v * 1e3:5.2f} ms"
                                                  for k, v in best.items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 12, 16, 32, 64, 512])
    ap.add_argument("--head-rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=results_path("matmul-paths.json"))
    args = ap.parse_args()
    ops = kernels.load()
    if ops is None:
        raise SystemExit("the CPU kernels are off or failed to build")
    print(f"{torch.get_num_threads()} threads, matrix unit: {matrix_unit()}")
    result = {"threads": torch.get_num_threads(), "matrix_unit": matrix_unit(),
              "avx512": sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx"))),
              "projections": projections(ops, args.rows, args.rounds),
              "lm_head": lm_head(ops, args.head_rows, args.rounds)}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
