"""Served head to head at fixed concurrency: ``pagedserve serve`` (default mode and
``--quantization int4``) against llama.cpp's ``llama-server`` (its own continuous batching, one
slot per concurrent stream) on the same GGUF file and cores, optionally against
``transformers serve --continuous-batching``; one server at a time.

    python benchmarks/serving_peers.py                      # builds llama-server once
    python benchmarks/serving_peers.py --llama-server PATH --concurrency 1 4 16 32

Workloads: prefill-heavy (1,024-token prompts, 128 output tokens) and chat-like (256 / 256).
Each concurrency C runs a closed loop: C clients, each sending its next request when the last
one finished, ``--requests-per-client`` requests each (at least 3 in all). Prompts are distinct
(shuffled words of English text, trimmed to the length in the model's tokenizer), so no server
reuses a cached prefix; outputs are greedy with ``ignore_eos`` so every request makes exactly
its output length. Measured per run: output tokens/s over the run, TTFT p50 / p99 (send to
first text), ITL p50 / p99 over every gap between streamed chunks (the strict view: one slow
step shows), the same percentiles of each request's mean ITL, ``(last - first chunk) / (chunks -
1)`` weighted by its gaps (guidellm's definition of ITL, the figure its reports give), and the
machine's 1-minute load average at the start (other work on the cores shows there).

llama-server is built from the llama.cpp source vendored in the ``llama-cpp-python`` sdist
(``build_llama_server``): portable (``GGML_NATIVE=OFF``) with the AVX-512 extensions this CPU
has named explicitly, cached under a key of version and flags. A ``-march=native`` binary built
on one of the project's machines and reused on another dies with SIGILL: the machines differ
(Sapphire Rapids with AMX, Zen 4 without), so a native build is only valid where it was made.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from common import Server, busy_loops, english_text, results_path

LLAMA_CPP_VERSION = "0.3.36"  # llama-cpp-python sdist that vendors llama.cpp
WORKLOADS = {"prefill-heavy": (1024, 128), "chat": (256, 256), "286/128": (286, 128)}


def _cpu_flags() -> set[str]:
    from pagedserve.cpu import cpu_flags

    return set(cpu_flags())


def build_llama_server(cache: Path) -> Path:
    """llama-server built once per llama.cpp version and instruction set (see the module
    docstring); returns the binary. Needs pip (the sdist), cmake, ninja and a C++ compiler."""
    flags = _cpu_flags()
    options = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
               "-DGGML_F16C=ON"]
    for flag, opt in (("avx512f", "GGML_AVX512"), ("avx512vbmi", "GGML_AVX512_VBMI"),
                      ("avx512_vnni", "GGML_AVX512_VNNI"), ("avx512_bf16", "GGML_AVX512_BF16")):
        options.append(f"-D{opt}={'ON' if flag in flags else 'OFF'}")
    key = hashlib.sha256(" ".join([LLAMA_CPP_VERSION, *options]).encode()).hexdigest()[:12]
    binary = cache / f"llama-server-{key}"
    if binary.exists():
        return binary
    work = cache / f"build-{key}"
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                    f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", str(work)], check=True)
    subprocess.run(["tar", "xzf", f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"], cwd=work,
                   check=True)
    src = work / f"llama_cpp_python-{LLAMA_CPP_VERSION}" / "vendor" / "llama.cpp"
    subprocess.run(["cmake", "-S", ".", "-B", "build", "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    *options, "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"], cwd=src, check=True)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server",
                    f"-j{os.cpu_count() or 1}"], cwd=src, check=True)
    binary.symlink_to(src / "build" / "bin" / "llama-server")
    return binary


def make_prompts(tokenizer, n: int, length: int, seed: int) -> list[str]:
    """``n`` distinct texts of ``length`` tokens: shuffled words of English text."""
    words = english_text().split()
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        rng.shuffle(words)
        ids = tokenizer.encode(" ".join(words[:2 * length]), add_special_tokens=False)[:length]
        prompts.append(tokenizer.decode(ids))
    return prompts


async def _one(http: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
               ) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    t0, times = time.perf_counter(), []
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code, "body": (await r.aread())[:200]}
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                if data.get("choices") and data["choices"][0].get("text"):
                    times.append(time.perf_counter())
    if not times:
        return {"ok": False, "status": 200, "body": "no text"}
    return {"ok": True, "ttft": times[0] - t0, "itl": list(np.diff(times)),
            "chunks": len(times), "end": times[-1]}


async def run_concurrency(url: str, model: str, prompts: list[str], out_len: int,
                          concurrency: int) -> dict:
    queue = list(prompts)
    results: list[dict] = []

    async def client(http):
        while queue:
            results.append(await _one(http, url, model, queue.pop(), out_len))

    t0, cpu0 = time.perf_counter(), time.process_time()
    # a connection per request: reusing a kept-alive one races the server closing it (after its
    # keep-alive count or timeout) and fails the request as "disconnected without a response"
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=30),
                                 limits=httpx.Limits(max_connections=None,
                                                     max_keepalive_connections=0)) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    ok = [r for r in results if r["ok"]]
    duration = max(r["end"] for r in ok) - t0 if ok else float("nan")
    itl = [g for r in ok for g in r["itl"]]
    # guidellm's ITL: one mean per request, counted once per gap it covers
    itl_req = [float(np.mean(r["itl"])) for r in ok for _ in r["itl"]]

    def pct(values, q):
        return float(np.percentile(values, q)) if values else float("nan")

    tokens = sum(r["chunks"] for r in ok)
    # the generator's own share of the cores it shares with the server
    client_cpu = (time.process_time() - cpu0) / (time.perf_counter() - t0)
    return {"concurrency": concurrency, "requests": len(results), "completed": len(ok),
            "failed": [r for r in results if not r["ok"]][:2], "output_tokens": tokens,
            "duration_s": duration, "output_tok_s": tokens / duration,
            "ttft_p50": pct([r["ttft"] for r in ok], 50),
            "ttft_p99": pct([r["ttft"] for r in ok], 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "itl_req_p50": pct(itl_req, 50), "itl_req_p99": pct(itl_req, 99),
            "client_cpu": client_cpu}


def servers(args, gguf: Path, threads: int) -> dict[str, tuple[list[str], dict]]:
    """name -> (command, extra environment) of each server to run, in order."""
    port = str(args.port)
    slots = max(args.concurrency)
    ctx = slots * (max(p + o for p, o in WORKLOADS.values()) + 64)
    paged = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", port,
             "--served-model-name", "m", "--kv-cache-memory", args.kv_cache_memory]
    out = {"pagedserve": (paged, {}),
           "pagedserve int4": (paged + ["--quantization", "int4"], {}),
           "llama-server": ([str(args.llama_server), "-m", str(gguf), "--host", "127.0.0.1",
                             "--port", port, "-np", str(slots), "-c", str(ctx), "-t",
                             str(threads), "-a", "m"], {})}
    for variant in args.variant:  # NAME=FLAGS: pagedserve with these flags, as "pagedserve NAME"
        name, _, flags = variant.partition("=")
        out[f"pagedserve {name}"] = (paged + flags.split(), {})
    if args.baseline_src is not None:
        env = {"PYTHONPATH": str(args.baseline_src.resolve() / "src")}
        out = {"pagedserve baseline": (paged, env), **out}
    if args.with_transformers:
        from serving import hf_dir_from_gguf

        out["transformers serve"] = (["transformers", "serve", "--continuous-batching",
                                      "--device", "cpu", "--dtype", "float32", "--port", port,
                                      str(hf_dir_from_gguf(gguf))], {"HF_HUB_OFFLINE": "1"})
    return {k: v for k, v in out.items() if not args.only or k in args.only}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--workloads", nargs="+", default=["prefill-heavy", "chat"],
                    choices=list(WORKLOADS))
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every server this many times in turn (tail latencies and "
                         "ratios move between runs; each round is compared within itself)")
    ap.add_argument("--llama-server", type=Path, default=None,
                    help="a llama-server binary (default: build_llama_server)")
    ap.add_argument("--with-transformers", action="store_true",
                    help="also transformers serve (slow: float32, one process)")
    ap.add_argument("--only", nargs="+", default=None, help="run only these servers")
    ap.add_argument("--baseline-src", type=Path, default=None,
                    help="also serve the pagedserve source tree in this folder (e.g. a git "
                         "worktree of an older commit), as 'pagedserve baseline'")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="also serve pagedserve with these flags as 'pagedserve NAME', e.g. "
                         "--variant 'itl150=--itl-target-ms 150' (repeatable)")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--busy", type=int, default=0,
                    help="busy-loop processes (python -c 'while 1: pass') on the same cores "
                         "for the whole run: a shared machine's load")
    ap.add_argument("--port", type=int, default=8441)
    ap.add_argument("--out", default=results_path("serving-peers.json"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from pagedserve.cpu import usable_cpus
    from pagedserve.loader.fetched import default_model_path

    gguf = default_model_path()
    if args.llama_server is None:
        args.llama_server = build_llama_server(gguf.parent / "llama-server")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    threads = usable_cpus()
    print(f"{threads} threads; {args.requests_per_client} requests per client (at least 3)\n")
    print("| workload | server | concurrency | load avg | output tok/s | TTFT p50 / p99 (s) | "
          "ITL p50 / p99 (ms) | request mean ITL p50 / p99 (ms) | client CPU |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    with busy_loops(args.busy):
        for r in range(args.rounds):
            run_servers(args, gguf, threads, tokenizer, rows, r)
    summarize(rows)


def run_servers(args, gguf: Path, threads: int, tokenizer, rows: list[dict], round_: int = 0
                ) -> None:
    """Each server in turn over every workload and concurrency; rows appended to ``rows`` and
    written to ``args.out`` after each run."""
    for name, (cmd, env) in servers(args, gguf, threads).items():
        server = Server(cmd, args.port, Path(f"/tmp/serving-peers-{name.replace(' ', '-')}.log"),
                        env=env)
        try:
            for w in args.workloads:
                prompt_len, out_len = WORKLOADS[w]
                asyncio.run(run_concurrency(server.url, "m", make_prompts(
                    tokenizer, 1, prompt_len, 99), 8, 1))  # warm-up, off the clock
                for i, c in enumerate(args.concurrency):
                    n = max(3, c * args.requests_per_client)
                    prompts = make_prompts(tokenizer, n, prompt_len, seed=1000 * i + c)
                    load = os.getloadavg()[0]
                    row = asyncio.run(run_concurrency(server.url, "m", prompts, out_len, c))
                    row.update(server=name, workload=w, load_avg=load, round=round_)
                    rows.append(row)
                    print(f"| {w} | {name} | {c} | {load:.1f} | {row['output_tok_s']:.1f} | "
                          f"{row['ttft_p50']:.2f} / {row['ttft_p99']:.2f} | "
                          f"{row['itl_p50'] * 1e3:.0f} / {row['itl_p99'] * 1e3:.0f} | "
                          f"{row['itl_req_p50'] * 1e3:.0f} / {row['itl_req_p99'] * 1e3:.0f} | "
                          f"{row['client_cpu']:.0%} |", flush=True)
                    if row["failed"]:
                        print(f"  failed: {row['failed']}", flush=True)
                    # written after every run: a server that dies keeps the others' rows
                    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows},
                                                         indent=1, default=str))
        except httpx.HTTPError as e:
            print(f"| {name}: stopped by {type(e).__name__}: {e} (log: {server.log.name}) |",
                  flush=True)
        finally:
            server.stop()


ITL_P99 = {"itl_p99": "ITL p99", "itl_req_p99": "request mean ITL p99"}


def summarize(rows: list[dict], itl: dict[str, str] = ITL_P99) -> None:
    """Each pagedserve mode's output throughput, TTFT p50 and the ``itl`` percentiles (row key
    -> heading) against llama-server's at the same workload, concurrency and round."""
    peer = {(r["workload"], r["concurrency"], r.get("round", 0)): r for r in rows
            if r["server"] == "llama-server"}
    print("\n| workload | server | concurrency | throughput vs llama-server | TTFT p50 ratio | "
          + " | ".join(f"{h} ratio" for h in itl.values()) + " |")
    print("|---|---|---:|---:|---:|" + "---:|" * len(itl))
    for r in rows:
        p = peer.get((r["workload"], r["concurrency"], r.get("round", 0)))
        if r["server"].startswith("pagedserve") and p:
            print(f"| {r['workload']} | {r['server']} | {r['concurrency']} | "
                  f"{r['output_tok_s'] / p['output_tok_s']:.2f}x | "
                  f"{r['ttft_p50'] / p['ttft_p50']:.2f} | "
                  + " | ".join(f"{r[k] / p[k]:.2f}" for k in itl) + " |")
    print("(ratios of times: below 1 is better for pagedserve)")


if __name__ == "__main__":
    main()
