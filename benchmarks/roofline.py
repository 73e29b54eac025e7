"""Decode against the machine's own limit: the dense matmul rate of this CPU on the model's
shapes, and the engine's decode FLOP/s at several batch sizes as a share of it, in one run.

Peak: [M, K] x [K, N] in the chosen dtype for every weight shape of the model (fused q|k|v, o,
fused gate|up, down, LM head) at M = 256 and 512 tokens, best of a few repeats of
``torch.matmul`` (MKL) and, where the engine uses it, of its own packed-weight kernel; the peak
is the best FLOP-weighted rate of one forward's matmuls (each shape counted once per layer, as
the model runs them). Engine: B requests with short prompts decode ``--decode-tokens`` tokens
together (greedy, ignore_eos); the steps after everyone's prefill are timed, best of
``--rounds`` rounds over all batches, on a KV cache whose pages have all been touched once (a
serving process's steady state; ``commit_kv_cache``). The peak is measured again before every
decode run (and once after the last): the share uses the best peak of the whole run; each
round's share is also taken against the mean of the peaks measured just before and just after
it, and the median of those is printed too (the best of many 1-second peaks catches the
machine's fastest moments, which a decode run of several seconds averages over). Decode FLOP/s
= model FLOPs per token x tokens/s, where model FLOPs per token = 2 x (the matmul weights'
elements) + attention's 4 x context x num_heads x head_dim per layer.

For each batch it also times the same matmuls alone at M = batch rows: the most a decode step
of that batch could reach if attention, norms and the engine took no time.

    python benchmarks/roofline.py                    # float32, batches 1 8 32 64 128 256
    python benchmarks/roofline.py --quantization int4 --batches 1 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from common import commit_kv_cache, decode_rate, positive

from pagedserve import LLM
from pagedserve.model.linear import pack_linear_weight


def weight_shapes(cfg) -> list[tuple[str, int, int, int]]:
    """(name, K, N, times per forward) of the model's matmuls."""
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    L = cfg.num_hidden_layers
    return [("qkv", h, qkv, L), ("o", cfg.num_attention_heads * d, h, L),
            ("gate_up", h, 2 * cfg.intermediate_size, L), ("down", cfg.intermediate_size, h, L),
            ("lm_head", h, cfg.vocab_size, 1)]


def matmul_rates(m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 5,
                 ops=None) -> dict[str, float]:
    """Best GFLOP/s of [m, k] @ [k, n], the weight stored [n, k] and transposed as nn.Linear
    does: {"mkl": torch.matmul}, plus {"packed": ops.packed_linear on the packed weight, the
    engine's own matmul} with the CPU kernels ``ops`` and float32."""
    a = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    calls = {"mkl": lambda: torch.matmul(a, w.t(), out=out)}
    if ops is not None and dtype == torch.float32:
        packed = pack_linear_weight(w)
        calls["packed"] = lambda: ops.packed_linear(a, packed, None, n, out)
    iters = max(1, int(2e9 / (2 * m * k * n)))  # about 2 GFLOP per timing
    rates = {}
    for name, call in calls.items():
        call()
        best = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            best = max(best, 2 * m * k * n * iters / (time.perf_counter() - t0))
        rates[name] = best / 1e9
    return rates


def forward_rates(cfg, m: int, dtype: torch.dtype, linear_dtype: torch.dtype | None = None,
                  ops=None, repeats: int = 5) -> tuple[float, dict]:
    """FLOP-weighted GFLOP/s of one forward's matmuls at M = ``m`` rows (each shape counted once
    per layer, at the better of MKL and the packed kernel ``ops``), and each shape's rates. The
    decoder's linear layers run in ``linear_dtype`` (bfloat16 for quantization="int4": its
    batched path), the LM head in ``dtype``."""
    flops = seconds = 0.0
    detail = {}
    for name, k, n, times in weight_shapes(cfg):
        rates = matmul_rates(m, k, n, dtype if name == "lm_head" else linear_dtype or dtype,
                             repeats, ops)
        detail[f"{name} M={m}"] = {kind: round(r, 1) for kind, r in rates.items()}
        f = 2 * m * k * n * times
        flops += f
        seconds += f / (max(rates.values()) * 1e9)
    return flops / seconds / 1e9, detail


def forward_matmul_rate(cfg, m: int, dtype: torch.dtype,
                        linear_dtype: torch.dtype | None = None, ops=None) -> float:
    """forward_rates at M = ``m`` rows: the ceiling of a decode step of ``m`` sequences if
    nothing but the matmuls took time."""
    return forward_rates(cfg, m, dtype, linear_dtype, ops, repeats=3)[0]


def machine_peak(cfg, dtype: torch.dtype, linear_dtype: torch.dtype | None = None,
                 ops=None) -> tuple[float, dict]:
    """The better forward_rates of M = 256 and 512 rows, and the shapes' rates at both."""
    results = [forward_rates(cfg, m, dtype, linear_dtype, ops) for m in (256, 512)]
    return max(rate for rate, _ in results), {k: v for _, d in results for k, v in d.items()}


def flops_per_token(cfg, context: float) -> float:
    matmul = sum(k * n * times for _, k, n, times in weight_shapes(cfg))
    attention = 4 * context * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    return 2 * matmul + attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="auto", help="default: pagedserve's default")
    ap.add_argument("--quantization", default=None, choices=["int4"],
                    help="int4 linear layers (their batched matmuls run in bfloat16)")
    ap.add_argument("--batches", type=positive, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--prompt-len", type=positive, default=32)
    ap.add_argument("--decode-tokens", type=positive, default=32)
    ap.add_argument("--rounds", type=positive, default=3,
                    help="rounds over all batches; each batch's best counts (this VM is noisy)")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    if args.json and not Path(args.json).resolve().parent.is_dir():
        ap.error(f"--json: no directory for {args.json}")

    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=2 << 30,
              max_num_seqs=max(args.batches), max_num_batched_tokens=4096,
              quantization=args.quantization)
    cache = llm.llm_engine.kv_cache
    per_seq = -(-(args.prompt_len + args.decode_tokens + 1) // cache.block_size)
    if max(args.batches) * per_seq > cache.num_blocks:  # it would preempt: not decode alone
        ap.error(f"--batches {max(args.batches)} needs {max(args.batches) * per_seq} KV blocks "
                 f"of {cache.block_size} tokens; the 2 GiB cache holds {cache.num_blocks}")
    cfg = llm.llm_engine.model_config
    dtype = llm.llm_engine.dtype
    ops = llm.llm_engine.model.ops  # the CPU kernels, when the engine runs them
    linear = torch.bfloat16 if args.quantization else None
    mode = str(dtype).removeprefix("torch.") + (" + bfloat16 linear" if args.quantization else "")
    decode_rate(llm, 2, args.prompt_len, 4)  # warm-up
    commit_kv_cache(llm)
    # Rounds over all batches, the peak measured again (about 1 s) before every decode run:
    # this VM's speed drifts by up to 30% within minutes, and a peak taken once at the start
    # would compare decode with another moment's machine.
    peaks, details, runs = [], [], {b: [] for b in args.batches}
    for i in range(args.rounds):
        for b in args.batches:
            p, d = machine_peak(cfg, dtype, linear, ops)
            peaks.append(p)
            details.append(d)
            r = decode_rate(llm, b, args.prompt_len, args.decode_tokens)
            runs[b].append((r, len(peaks) - 1))  # the index of the peak just before it
            print(f"round {i + 1}, batch {b}: {r['tokens_per_s']:.1f} tok/s; peak just before: "
                  f"{p:.1f} GFLOP/s", flush=True)
    p, d = machine_peak(cfg, dtype, linear, ops)  # the peak just after the last decode run
    peaks.append(p)
    details.append(d)
    peak = max(peaks)
    detail = details[peaks.index(peak)]
    print(f"\nmatmul peak ({mode}, {torch.get_num_threads()} threads, the model's shapes at "
          f"256-512 tokens, {'MKL or the packed kernel' if ops else 'MKL'}; the best of "
          f"{len(peaks)} measurements, which ranged {min(peaks):.1f}-{peak:.1f}): "
          f"{peak:.1f} GFLOP/s")
    print("  " + ", ".join(f"{k}: " + " / ".join(f"{kind} {r}" for kind, r in v.items())
                           for k, v in detail.items()))
    rows = []
    print("\n| batch | step ms | tokens/s | GFLOP/s | share of peak | each round against the peaks "
          "around it | their median | matmuls alone at M = batch | their share of peak |")
    print("|---:|---:|---:|---:|---:|---|---:|---:|---:|")

    def gflops_of(r: dict) -> float:
        return r["tokens_per_s"] * flops_per_token(cfg, r["context"]) / 1e9

    for b in args.batches:
        r = max((r for r, _ in runs[b]), key=lambda x: x["tokens_per_s"])
        gflops = gflops_of(r)
        per_round = [gflops_of(r_i) / ((peaks[j] + peaks[j + 1]) / 2) for r_i, j in runs[b]]
        median = statistics.median(per_round)
        ceiling = forward_matmul_rate(cfg, b, dtype, linear, ops)
        row = {"batch": b, **r, "gflops": gflops, "share_of_peak": gflops / peak,
               "share_per_round": per_round, "share_median": median,
               "matmul_gflops_at_batch": ceiling}
        rows.append(row)
        print(f"| {b} | {r['step_ms']:.1f} | {r['tokens_per_s']:.1f} | {gflops:.1f} | "
              f"{100 * gflops / peak:.0f}% | {' / '.join(f'{100 * x:.0f}%' for x in per_round)} | "
              f"{100 * median:.0f}% | {ceiling:.1f} | {100 * ceiling / peak:.0f}% |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"dtype": str(dtype),
                                               "quantization": args.quantization,
                                               "peak_gflops": peak, "peaks": peaks,
                                               "peak_detail": detail, "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
