"""What the benchmarks share: real English text, ShareGPT-like workloads, a batch's decode
rate, argparse types, and where results go (``benchmarks/results/``).

Every benchmark prints ratios against a peer run in the same process or script: the machines
are noisy, so absolute numbers from different runs are not compared.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pagedserve import LLM, SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"


def results_path(name: str) -> str:
    """``benchmarks/results/NAME`` (the directory is created)."""
    RESULTS.mkdir(exist_ok=True)
    return str(RESULTS / name)





def english_paragraphs() -> list[str]:
    """Prose paragraphs in a fixed order (sorted topic names), each at least 200 characters."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for block in topics[name].split("\n\n"):
            lines = block.splitlines()
            if not lines or any(line.startswith((" ", "\t")) for line in lines):
                continue  # code, grammar, indented examples
            text = " ".join(line.strip() for line in lines)
            if len(text) < 200 or re.fullmatch(r"[*=\-~^ ]+", lines[-1].strip() or "x"):
                continue
            paragraphs.append(text)
    return paragraphs


def english_text() -> str:
    return "\n\n".join(english_paragraphs())


def lognormal_lengths(rng, n: int, mean: float, sigma: float = 0.8) -> list[int]:
    mu = np.log(mean) - sigma**2 / 2  # so that the (unclipped) mean is ``mean``
    return np.clip(rng.lognormal(mu, sigma, n).round(), 8, 1024).astype(int).tolist()


def make_workload(tokenizer, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt token ids, output length) pairs in arrival order."""
    rng = np.random.default_rng(seed)
    prompt_lens = lognormal_lengths(rng, n, 160)
    output_lens = lognormal_lengths(rng, n, 340)
    corpus = tokenizer.encode(english_text())
    work, offset = [], 0
    for p, o in zip(prompt_lens, output_lens):
        if offset + p > len(corpus):
            offset = 0
        work.append((corpus[offset:offset + p], o))
        offset += p
    return work


def decode_rate(llm: LLM, batch: int, prompt_len: int = 64, decode_tokens: int = 32) -> dict:
    """Tokens/s of ``batch`` sequences decoding together, prefill excluded (shared by the
    other benchmarks' batch sweeps)."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=decode_tokens + 1, ignore_eos=True)
    for i in range(batch):
        prompt = [(7 * i + 13 * j) % 1000 + 100 for j in range(prompt_len)]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    while any(s.num_output_tokens == 0 for r in engine.requests.values() for s in r.seqs):
        engine.step()  # prefills (and first tokens)
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - t0
    return {"tokens_per_s": batch * steps / elapsed, "step_ms": 1e3 * elapsed / steps,
            "context": prompt_len + 1 + steps / 2}


def prefill_rate(llm: LLM, prompt_len: int = 512, n: int = 12) -> float:
    """Prompt tokens/s of ``n`` distinct ``prompt_len``-token prompts (one output token each;
    prefix caching cannot help: no two share a first block)."""
    base = int(time.perf_counter_ns() % 10_000)  # new prompts each call: no prefix hits
    prompts = [{"prompt_token_ids": [(base + 7 * i + 13 * j) % 30_000 + 100
                                     for j in range(prompt_len)]} for i in range(n)]
    params = SamplingParams(temperature=0, max_tokens=1)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return n * prompt_len / (time.perf_counter() - t0)


@contextlib.contextmanager
def busy_loops(n: int):
    """``n`` processes of ``python -c 'while 1: pass'`` on this machine's cores for the block: a
    shared machine's load (started half a second before the block runs, killed after it)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]
    try:
        if procs:
            time.sleep(0.5)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def positive(text: str) -> int:
    """argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def commit_kv_cache(llm: LLM) -> None:
    """Touch every page of the engine's KV cache once, its contents unchanged, as a serving
    process does in its first minutes. The CPU cache is committed lazily, so a fresh process's
    first write into a never-used block faults its pages in: at batch 64 with huge pages, about
    23 ms at each step that opens new blocks (every 16 steps), paid once per page."""
    cache = llm.llm_engine.kv_cache
    for t in (cache.kv, cache.k_params, cache.v_params, cache.kv_open):
        if t is not None:
            t.view(torch.uint8).mul_(1)  # byte-wise: the same for every cache dtype


QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.", "How do I reverse a list in Python?",
    "What causes the seasons on Earth?", "Give me three tips for better sleep.",
    "What is the difference between a virus and a bacterium?",
    "Summarize the plot of Romeo and Juliet.", "How does a refrigerator keep food cold?",
    "What is 17 times 23?", "Name three famous painters and one work by each.",
    "Why is the sky blue?", "Write a short thank-you note to a teacher.",
    "What is a prime number? Give examples.", "How do vaccines work?",
    "Describe a healthy breakfast.", "What are the main causes of climate change?",
    "Translate 'good morning' into Spanish, French and German.",
    "What is the Pythagorean theorem?", "How can I improve my public speaking?",
    "Explain what an API is to a beginner.", "What is the tallest mountain in the world?",
    "Suggest a name for a coffee shop and explain it.", "How do plants drink water?",
    "What is the difference between weather and climate?",
    "Write two sentences about the history of the bicycle.",
    "What should I pack for a weekend hiking trip?", "How does the internet work, briefly?",
    "What is machine learning?", "Give a recipe for a simple tomato soup.",
    "Why do cats purr?", "What are the planets of the solar system?",
]


def text_windows(tokenizer, num_tokens: int, window: int) -> list[list[int]]:
    ids = tokenizer.encode(english_text())
    need = math.ceil(num_tokens / (window - 1)) * window
    if need > len(ids):
        raise SystemExit(f"the corpus has {len(ids)} tokens, {need} needed")
    return [ids[i:i + window] for i in range(0, need, window)]


def text_logprobs(llm: LLM, windows: list[list[int]]) -> list[float]:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    return [entry[w[pos]].logprob for w, o in zip(windows, outs)
            for pos, entry in enumerate(o.prompt_logprobs) if entry is not None]


def chats(llm: LLM, max_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0)
    outs = llm.chat(convs, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outs]
    return tokens, logprobs


class Server:
    """A server process; ``url`` once it answers /health."""

    def __init__(self, cmd: list[str], port: int, log: Path, env: dict | None = None):
        import httpx

        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited; see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"{cmd[0]} did not start; see {log}")
            time.sleep(1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
