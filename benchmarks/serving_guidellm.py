"""The head to head of ``serving_peers.py``, driven by guidellm instead of its own generator:
the load generator a vLLM user already runs, so its figures read like theirs.

    python -m venv /tmp/glv && /tmp/glv/bin/pip install guidellm==0.8.1
    python benchmarks/serving_guidellm.py --guidellm /tmp/glv/bin/guidellm \\
        --llama-server PATH --concurrency 16 32

guidellm runs in its own environment (it pins its own dependencies), one server at a time on the
same cores: a ``concurrent`` profile of C streams, ``--requests-per-client`` x C requests of
synthetic text (its ``synthetic_text`` data, counted with the model's tokenizer, a new seed for
every run so that no server has seen the prompts) sent to
``/v1/completions`` with ``ignore_eos``. Its ITL is each request's mean gap after the first
token, percentiles weighted by tokens; ``serving_peers.py`` also reports the strict per-gap
percentiles, which guidellm does not. guidellm is heavier than that script's generator (a
process per worker): "client CPU" is its share of a core, taken from the same cores as the
server's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from common import Server, results_path
from serving_peers import WORKLOADS, build_llama_server, servers, summarize


def guidellm_run(guidellm: Path, url: str, tokenizer_dir: Path, prompt_len: int, out_len: int,
                 streams: int, requests: int, out: Path, workers: int, seed: int) -> dict:
    """One guidellm benchmark; its summary figures (seconds, tokens/s). ``seed`` picks its
    synthetic prompts: guidellm's default seed repeats them run after run, and a server that
    keeps earlier prompts' KV (llama-server's slots, a prefix cache) then skips their prefill."""
    cmd = [str(guidellm), "run",
           "--backend", f"kind=openai_http,target={url},model=m,request_format=/v1/completions",
           "--profile", f"kind=concurrent,streams={streams}",
           "--constraint", f"kind=max_requests,count={requests}",
           "--data", f"kind=synthetic_text,prompt_tokens={prompt_len},output_tokens={out_len}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
           "--seed", f"kind=static,value={seed}",
           "--output", f"kind=json,path={out}", "--disable-console"]
    t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": str(workers)}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # guidellm and its worker processes
    client_cpu = ((cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime)
                  / (time.perf_counter() - t0))
    bench = json.loads(out.read_text())["benchmarks"][0]
    m = bench["metrics"]
    done = bench["requests"]["successful"]

    def ok(name):
        return m[name]["successful"]

    return {"completed": ok("request_latency")["count"],
            # prompt tokens the server reported as served from its cache (should be ~0)
            "cached_tokens": sum(r.get("cached_tokens") or 0 for r in done) / max(1, len(done)),
            "errored": m["request_latency"]["errored"]["count"],
            "output_tok_s": ok("output_tokens_per_second")["mean"],
            "ttft_p50": ok("time_to_first_token_ms")["percentiles"]["p50"] / 1e3,
            "ttft_p99": ok("time_to_first_token_ms")["percentiles"]["p99"] / 1e3,
            "itl_req_p50": ok("inter_token_latency_ms")["percentiles"]["p50"] / 1e3,
            "itl_req_p99": ok("inter_token_latency_ms")["percentiles"]["p99"] / 1e3,
            "client_cpu": client_cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--guidellm", type=Path, required=True, help="the guidellm executable")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--workloads", nargs="+", default=["chat"], choices=list(WORKLOADS))
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--workers", type=int, default=10,
                    help="guidellm's worker processes (its default 10; each polls, so on a "
                         "machine this small fewer leave more of the cores to the server)")
    ap.add_argument("--llama-server", type=Path, default=None)
    ap.add_argument("--only", nargs="+", default=["llama-server", "pagedserve"])
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--port", type=int, default=8442)
    ap.add_argument("--out", default=results_path("serving-guidellm.json"))
    args = ap.parse_args()
    args.baseline_src, args.with_transformers = None, False

    from transformers import AutoTokenizer

    from pagedserve.cpu import usable_cpus
    from pagedserve.loader.fetched import default_model_path

    gguf = default_model_path()
    if args.llama_server is None:
        args.llama_server = build_llama_server(gguf.parent / "llama-server")
    tmp = Path(tempfile.mkdtemp(prefix="guidellm-"))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
    threads = usable_cpus()
    print(f"{threads} threads, {args.workers} guidellm workers; guidellm's ITL (per-request "
          "mean, token-weighted)\n")
    print("| workload | server | concurrency | load avg | output tok/s | TTFT p50 / p99 (s) | "
          "ITL p50 / p99 (ms) | client CPU |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for name, (cmd, env) in servers(args, gguf, threads).items():
        server = Server(cmd, args.port, Path(f"/tmp/serving-guidellm-{name.replace(' ', '-')}"
                                             ".log"), env=env)
        try:
            httpx.post(server.url + "/v1/completions", timeout=600, json={  # warm-up
                "model": "m", "prompt": "Hello", "max_tokens": 8})
            for w in args.workloads:
                prompt_len, out_len = WORKLOADS[w]
                for i, c in enumerate(args.concurrency):
                    load = os.getloadavg()[0]
                    row = guidellm_run(args.guidellm, server.url, tmp, prompt_len, out_len, c,
                                       c * args.requests_per_client, tmp / "run.json",
                                       args.workers, seed=1000 * i + c)
                    row.update(server=name, workload=w, concurrency=c, load_avg=load)
                    rows.append(row)
                    print(f"| {w} | {name} | {c} | {load:.1f} | {row['output_tok_s']:.1f} | "
                          f"{row['ttft_p50']:.2f} / {row['ttft_p99']:.2f} | "
                          f"{row['itl_req_p50'] * 1e3:.0f} / {row['itl_req_p99'] * 1e3:.0f} | "
                          f"{row['client_cpu']:.0%} |", flush=True)
                    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows},
                                                         indent=1, default=str))
        finally:
            server.stop()
    summarize(rows, {"itl_req_p99": "ITL p99"})


if __name__ == "__main__":
    main()
