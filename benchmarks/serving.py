"""Online serving under Poisson arrivals: pagedserve's OpenAI server against HF transformers'
server (``transformers serve --continuous-batching``), same model, weights dtype (``--dtype``,
bfloat16 by default), KV budget, machine and client, one server at a time.

    python benchmarks/serving.py                       # both servers, bfloat16, 64 requests/rate
    python benchmarks/serving.py --dtype float32 --rates 0.5 1 --skip-peer

Workload: ShareGPT-like prompt lengths (log-normal, mean 160 tokens; windows of real English
text, sent as text) and output lengths (log-normal, mean ``--output-mean`` tokens, clipped to
8..``--output-max``), requests arriving as a Poisson process at each rate, streamed through
``/v1/completions`` with httpx. The peer's server rejects ``ignore_eos``, so neither server
gets it: output lengths are the ones each server produced (both decode greedily with the
same weights, so they end at the same EOS). Per rate: completed requests, output tokens/s,
TTFT (arrival to first text), TPOT ((last - first token) / (tokens - 1) per request) and ITL
(gaps between streamed chunks), p50 and p99. A rate is sustained when every request completes
and p99 TPOT stays within ``--tpot-slo`` seconds; the script prints each server's highest
sustained rate and their ratio (target: at least 2x the peer).

The peer needs the model as an HF directory: it is converted once from the GGUF (transformers
dequantizes it) into the pagedserve cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from common import Server, english_text, lognormal_lengths, results_path


def hf_dir_from_gguf(gguf: Path) -> Path:
    """The GGUF model dequantized into an HF directory (config, safetensors, tokenizer),
    cached beside the GGUF."""
    out = gguf.parent / (gguf.stem + "-hf")
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):  # the GGUF marker blocks save_pretrained
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    plain.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    return out


def make_workload(tokenizer, n: int, output_mean: int, output_max: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompt_lens = lognormal_lengths(rng, n, 160)
    output_lens = [min(o, output_max) for o in lognormal_lengths(rng, n, output_mean)]
    corpus = tokenizer.encode(english_text())
    work, offset = [], 0
    for p, o in zip(prompt_lens, output_lens):
        if offset + p > len(corpus):
            offset = 0
        work.append((tokenizer.decode(corpus[offset:offset + p]), o))
        offset += p
    return work


async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: str,
                      max_tokens: int, start: float) -> dict:
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    t0 = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    chunk_times, tokens = [], 0
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code, "body": (await r.aread())[:200]}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("choices") and data["choices"][0].get("text"):
                chunk_times.append(time.perf_counter())
                tokens += 1
    if not chunk_times:
        return {"ok": False, "status": 200, "body": b"no text"}
    return {"ok": True, "ttft": chunk_times[0] - t0, "end": chunk_times[-1], "chunks": tokens,
            "tpot": (chunk_times[-1] - chunk_times[0]) / (tokens - 1) if tokens > 1 else None,
            "itl": list(np.diff(chunk_times))}


async def run_rate(url: str, model: str, work, rate: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate, len(work))
    t0 = time.perf_counter() + 0.5
    starts = t0 + np.cumsum(gaps) - gaps[0]
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=30),
                                 limits=httpx.Limits(max_connections=None)) as http:
        results = await asyncio.gather(*(one_request(http, url, model, p, o, s)
                                         for (p, o), s in zip(work, starts)))
    ok = [r for r in results if r["ok"]]
    duration = max(r["end"] for r in ok) - t0 if ok else float("nan")

    def pct(values, q):
        values = [v for v in values if v is not None]
        return float(np.percentile(values, q)) if values else float("nan")

    itl = [g for r in ok for g in r["itl"]]
    return {"rate": rate, "completed": len(ok), "requests": len(work),
            "failed": [r for r in results if not r["ok"]][:2],
            "duration_s": duration, "output_tokens": sum(r["chunks"] for r in ok),
            "tok_per_s": sum(r["chunks"] for r in ok) / duration,
            "ttft_p50": pct([r["ttft"] for r in ok], 50), "ttft_p99": pct([r["ttft"] for r in ok], 99),
            "tpot_p50": pct([r["tpot"] for r in ok], 50), "tpot_p99": pct([r["tpot"] for r in ok], 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99)}


def sweep(name: str, url: str, model: str, work, rates: list[float], slo: float) -> list[dict]:
    rows = []
    for i, rate in enumerate(rates):
        row = asyncio.run(run_rate(url, model, work, rate, seed=i))
        row["engine"] = name
        row["sustained"] = row["completed"] == row["requests"] and row["tpot_p99"] <= slo
        rows.append(row)
        print(f"| {name} | {rate:g} | {row['completed']}/{row['requests']} | "
              f"{row['tok_per_s']:.1f} | {row['ttft_p50']:.2f} / {row['ttft_p99']:.2f} | "
              f"{row['tpot_p50'] * 1e3:.0f} / {row['tpot_p99'] * 1e3:.0f} | "
              f"{row['itl_p50'] * 1e3:.0f} / {row['itl_p99'] * 1e3:.0f} | "
              f"{'yes' if row['sustained'] else 'no'} |", flush=True)
        if row["failed"]:
            print(f"  failed: {row['failed']}", flush=True)
        if not row["sustained"] and i + 1 < len(rates):
            # higher rates only queue more; stop here (the table shows where it broke)
            print(f"| {name} | > {rate:g} | not run: {rate:g} req/s was not sustained | | | | | |",
                  flush=True)
            break
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1, 2, 4, 8])
    ap.add_argument("--num-requests", type=int, default=64,
                    help="per rate; fewer make a burst rather than a steady state")
    ap.add_argument("--output-mean", type=int, default=96)
    ap.add_argument("--output-max", type=int, default=256)
    ap.add_argument("--tpot-slo", type=float, default=0.5, help="p99 TPOT bound, seconds")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"),
                    help="weights and KV dtype of both servers")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--skip-pagedserve", action="store_true")
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--out", default=results_path("serving.json"))
    ap.add_argument("--summarize", metavar="JSON", help="only print the summary of a results file")
    args = ap.parse_args()
    if args.summarize:
        summarize(json.loads(Path(args.summarize).read_text())["rows"], args.tpot_slo)
        return

    from transformers import AutoTokenizer

    from pagedserve.loader.fetched import default_model_path

    gguf = default_model_path()
    hf_dir = hf_dir_from_gguf(gguf)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    work = make_workload(tokenizer, args.num_requests, args.output_mean, args.output_max)
    threads = str(torch_threads())
    print(f"{args.dtype} weights and KV cache, "
          f"{len(work)} requests per rate, output lengths clipped to {args.output_max} "
          f"(mean {np.mean([o for _, o in work]):.0f}), {threads} threads, TPOT SLO "
          f"{args.tpot_slo:g} s\n")
    print("| server | req/s | completed | output tok/s | TTFT p50 / p99 (s) | "
          "TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | sustained |")
    print("|---|---:|---:|---:|---:|---:|---:|:-:|")
    rows = []
    if not args.skip_pagedserve:
        server = Server([sys.executable, "-m", "pagedserve.cli", "serve", "--port",
                         str(args.port), "--served-model-name", "smollm2",
                         "--kv-cache-memory", "2GiB", "--dtype", args.dtype], args.port, Path("/tmp/pagedserve-serve.log"))
        try:
            rows += sweep("pagedserve", server.url, "smollm2", work, args.rates, args.tpot_slo)
        finally:
            server.stop()
    if not args.skip_peer:
        # The same KV budget: 2 GiB / (46080 bytes per token * 16) = 2912 blocks of 16.
        server = Server(["transformers", "serve", "--continuous-batching", "--cb-block-size",
                         "16", "--cb-num-blocks", str(2912 * (2 if args.dtype == "bfloat16" else 1)),
                         "--dtype", args.dtype, "--device", "cpu",
                         "--port", str(args.port), str(hf_dir)], args.port,
                        Path("/tmp/transformers-serve.log"), env={"HF_HUB_OFFLINE": "1"})
        try:
            # the peer loads its model on the first request; warm it up outside the clock
            httpx.post(server.url + "/v1/completions", timeout=600,
                       json={"model": str(hf_dir), "prompt": "Hello", "max_tokens": 2})
            rows += sweep(PEER, server.url, str(hf_dir),
                          work, args.rates, args.tpot_slo)
        finally:
            server.stop()
    summarize(rows, args.tpot_slo)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1,
                                         default=str))


PEER = "transformers serve --continuous-batching"


def summarize(rows: list[dict], main_slo: float) -> None:
    """Each server's highest sustained rate (it and every lower rate completed all requests
    within the p99 TPOT bound) at several bounds, and the ratio to the peer."""
    slos = sorted({0.1, 0.15, 0.25, main_slo})
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    print("\n| p99 TPOT bound | " + " | ".join(f"{e} sustained req/s" for e in engines)
          + (" | ratio |" if len(engines) == 2 else " |"))
    print("|---:|" + "---:|" * (len(engines) + (len(engines) == 2)))
    for slo in slos:
        best = {}
        for e in engines:
            best[e] = 0.0
            for r in sorted((r for r in rows if r["engine"] == e), key=lambda r: r["rate"]):
                if r["completed"] < r["requests"] or not r["tpot_p99"] <= slo:
                    break
                best[e] = r["rate"]
        cells = [f"{best[e]:g}" for e in engines]
        if len(engines) == 2:
            ours, peer = best.get("pagedserve", 0), best.get(PEER, 0)
            cells.append(f"{ours / peer:.1f}x" if peer else
                         ("peer: none" if ours else "-"))
        print(f"| {slo * 1e3:.0f} ms | " + " | ".join(cells) + " |")
    print("(a rate the sweep did not reach counts as not sustained; target: at least 2x the "
          "peer's rate at the same bound)")


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
