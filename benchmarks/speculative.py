"""Speculative decoding on SmolLM2-135M-Instruct: ngram and suffix drafts against no
speculation, in one process.

- Single stream, input-grounded: 32 prompts whose answers repeat spans of their input (code
  edits, summaries that quote, JSON reformatting, multi-turn with repeated context), each
  generated alone (greedy, ``--max-tokens``). The modes run in turn prompt by prompt, for
  ``--rounds`` rounds. A mode's decode rate is its tokens after the first over the summed
  time from first token to last (the prefill, the same in every mode, left out), its
  end-to-end rate all its tokens over the summed request times; the ratios to no speculation
  are printed with the acceptance length (tokens per verifying step: accepted drafts + 1)
  and the acceptance rate per draft position.
- Single stream, open-ended chat: the 32 questions of benchmarks/common.py, the same way.
- Aggregate: 32 chats at once (``--batch``), output tokens/s per mode, rounds interleaved.
- Crossover: 1 to 32 requests at once (input-grounded, and chat) with ngram drafts never
  disabled, against none: where speculation stops paying (the default of
  ``disable_by_batch_size``).
- Cost: the time of one sequence's decode step verifying 0 to 8 (rejected) drafts.

Greedy outputs must be the same in every mode; the benchmark says so for each set. The suffix
drafter's memory of earlier outputs is cleared before each round, so a round never drafts
from its own previous answers to the same prompts.

    python benchmarks/speculative.py                 # everything, 2 rounds (~40 minutes)
    python benchmarks/speculative.py --rounds 1 --sets grounded
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from common import QUESTIONS, english_paragraphs, results_path

from pagedserve import LLM, SamplingParams

CODE = [
    '''def parse_config(path):
    with open(path) as f:
        data = json.load(f)
    result = {}
    for key, value in data.items():
        if key.startswith("_"):
            continue
        result[key.lower()] = value
    return result''',
    '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            averages.append(total / window)
    return averages''',
    '''class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, item):
        self.counts[item] = self.counts.get(item, 0) + 1

    def most_common(self):
        return max(self.counts, key=self.counts.get)''',
    '''function fetchUser(id) {
  return fetch("/api/users/" + id)
    .then(response => response.json())
    .then(user => {
      console.log(user.name);
      return user;
    });
}''',
]
CODE_TASKS = [
    "Rename every variable called {old} to {new} in this code and return the full code.",
    "Add a short comment above each line of this code. Return the whole code.",
]
RENAMES = [("result", "settings"), ("averages", "means"), ("counts", "tally"), ("user", "person")]
JSON_OBJECTS = [
    {"id": 17, "title": "Paged attention", "tags": ["kv", "cache"],
     "author": {"name": "Kwon", "year": 2023}},
    {"name": "Alice", "age": 30, "city": "Paris", "skills": ["python", "sql", "docker"]},
    {"order": 1042, "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-7", "qty": 1}],
     "paid": True, "total": 37.5},
    {"server": {"host": "localhost", "port": 8080}, "debug": False, "workers": 4,
     "log_level": "info"},
]
JSON_TASKS = ["Reformat this JSON with two-space indentation:\n\n{obj}",
              "Convert this JSON to YAML:\n\n{obj}"]
LISTS = [
    ["eggs", "bread", "butter", "apples", "coffee"],
    ["call the bank", "book a dentist appointment", "renew the passport", "pay the rent"],
    ["Paris", "Berlin", "Madrid", "Rome", "Vienna", "Prague"],
    ["install Python", "create a virtual environment", "install the requirements",
     "run the tests"],
]


def grounded_prompts() -> list[tuple[str, list[dict]]]:
    """32 (category, conversation) pairs whose answers repeat spans of their input."""
    out = []
    for code, (old, new) in zip(CODE, RENAMES):
        for task in CODE_TASKS:
            out.append(("code edit", [{"role": "user", "content":
                                       task.format(old=old, new=new) + "\n\n" + code}]))
    paragraphs = [p for p in english_paragraphs() if 300 <= len(p) <= 700][:4]
    for text in paragraphs:
        out.append(("quoting summary", [{"role": "user", "content":
                                         "Summarize this text, quoting its most important "
                                         "sentence word for word:\n\n" + text}]))
        out.append(("quoting summary", [{"role": "user", "content":
                                         "Copy the first two sentences of this text exactly, "
                                         "then summarize the rest:\n\n" + text}]))
    for obj in JSON_OBJECTS:
        for task in JSON_TASKS:
            out.append(("JSON reformat", [{"role": "user", "content":
                                           task.format(obj=json.dumps(obj))}]))
    for items in LISTS:
        listed = "\n".join(f"- {x}" for x in items)
        first = [{"role": "user", "content": f"Here is my list:\n{listed}\nRepeat it back to "
                                             "me."},
                 {"role": "assistant", "content": f"Here is your list:\n{listed}"}]
        out.append(("multi-turn", first + [{"role": "user", "content":
                                            "Add one more item at the end and repeat the "
                                            "whole list."}]))
        out.append(("multi-turn", first + [{"role": "user", "content":
                                            "Now write the list again in reverse order."}]))
    return out


def chat_prompts() -> list[tuple[str, list[dict]]]:
    return [("chat", [{"role": "user", "content": q}]) for q in QUESTIONS]


def engine(mode: str, k: int) -> LLM:
    if mode == "off":
        return LLM(None)
    return LLM(None, speculative_config={"method": mode, "num_speculative_tokens": k})


def reset_memory(llm: LLM) -> None:
    spec = llm.llm_engine.spec
    if spec is not None and hasattr(spec.proposer, "forget"):
        spec.proposer.forget()


def spec_stats(llm: LLM) -> dict:
    spec = llm.llm_engine.spec
    if spec is None:
        return {}
    st = spec.stats
    return {"drafts": st.num_drafts, "draft_tokens": st.num_draft_tokens,
            "accepted": st.num_accepted_tokens, "per_pos": list(st.accepted_per_pos)}


def delta(after: dict, before: dict) -> dict:
    if not after:
        return {}
    d = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    d["per_pos"] = [a - b for a, b in zip(after["per_pos"], before["per_pos"])]
    d["acceptance_length"] = 1 + d["accepted"] / d["drafts"] if d["drafts"] else 1.0
    d["acceptance_rate_per_pos"] = [round(x / d["drafts"], 3) if d["drafts"] else 0.0
                                    for x in d["per_pos"]]
    return d


def single_stream(llms: dict[str, LLM], prompts, max_tokens: int, rounds: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    seconds = {m: 0.0 for m in llms}
    tokens = {m: 0 for m in llms}
    decode_seconds = {m: 0.0 for m in llms}  # first token to last: no prefill
    decode_tokens = {m: 0 for m in llms}
    outputs: dict[str, list] = {m: [] for m in llms}
    before = {m: spec_stats(llm) for m, llm in llms.items()}
    for r in range(rounds):
        for llm in llms.values():
            reset_memory(llm)
        for i, (_, conv) in enumerate(prompts):
            order = list(llms)[i % len(llms):] + list(llms)[:i % len(llms)]  # rotate
            for m in order:
                t = time.perf_counter()
                result = llms[m].chat([conv], params, use_tqdm=False)[0]
                seconds[m] += time.perf_counter() - t
                out, metrics = result.outputs[0], result.metrics
                tokens[m] += len(out.token_ids)
                decode_seconds[m] += metrics.last_token_time - metrics.first_token_time
                decode_tokens[m] += len(out.token_ids) - 1
                if r == 0:
                    outputs[m].append(out.token_ids)
    base = tokens["off"] / seconds["off"]
    base_decode = decode_tokens["off"] / decode_seconds["off"]
    result = {}
    for m in llms:
        rate = tokens[m] / seconds[m]
        decode = decode_tokens[m] / decode_seconds[m]
        same = sum(a == b for a, b in zip(outputs[m], outputs["off"]))
        result[m] = {"decode_tok_s": round(decode, 2),
                     "decode_speedup": round(decode / base_decode, 3),
                     "tok_s": round(rate, 2), "speedup": round(rate / base, 3),
                     "same_outputs": f"{same}/{len(prompts)}",
                     **delta(spec_stats(llms[m]), before[m])}
    return result


def batch_throughput(llms: dict[str, LLM], prompts, max_tokens: int, rounds: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    convs = [c for _, c in prompts]
    rates: dict[str, list[float]] = {m: [] for m in llms}
    for llm in llms.values():  # warm-up
        llm.chat(convs[:4], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for _ in range(rounds):
        for m, llm in llms.items():
            reset_memory(llm)
            t = time.perf_counter()
            outs = llm.chat(convs, params, use_tqdm=False)
            dt = time.perf_counter() - t
            rates[m].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    base = statistics.median(rates["off"])
    return {m: {"tok_s": round(statistics.median(r), 2),
                "ratio": round(statistics.median(r) / base, 3)} for m, r in rates.items()}


def crossover(k: int, batches: list[int], max_tokens: int) -> dict:
    """Output tokens/s of ``b`` requests at once (input-grounded, and open-ended chat), ngram
    drafts never disabled (``disable_by_batch_size`` 0: only the per-step draft budget
    limits them) against none, for each b: where speculation stops paying, which sets the
    default of ``disable_by_batch_size``."""
    off = LLM(None)
    on = LLM(None, speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                       "disable_by_batch_size": 0})
    sets = {"grounded": [c for _, c in grounded_prompts()],
            "chat": [c for _, c in chat_prompts()]}
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for llm in (off, on):
        llm.chat(sets["chat"][:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    result: dict = {}
    for b in batches:
        for name, convs in sets.items():
            batch = (convs * (b // len(convs) + 1))[:b]
            rates = {}
            for mode, llm in (("off", off), ("ngram", on)):
                t = time.perf_counter()
                outs = llm.chat(batch, params, use_tqdm=False)
                rates[mode] = sum(len(o.outputs[0].token_ids) for o in outs) / \
                    (time.perf_counter() - t)
            result.setdefault(name, {})[b] = {
                "off_tok_s": round(rates["off"], 1), "ngram_tok_s": round(rates["ngram"], 1),
                "ratio": round(rates["ngram"] / rates["off"], 3)}
            print(f"{name}, {b} at once: {result[name][b]}", flush=True)
    return result


def verify_cost(max_k: int, rounds: int) -> dict:
    """Median time of a single sequence's decode step (300-token context) that verifies k
    drafts, k = 0 .. ``max_k``, against k = 0: what a draft costs when it is rejected. The
    drafts are set by hand; the k values run in turn, ``rounds`` times 10 steps each."""
    llm = LLM(None, speculative_config={"method": "ngram", "num_speculative_tokens": max_k,
                                        "disable_by_batch_size": 0})
    engine = llm.llm_engine
    engine.spec.propose = lambda running, finished=(): None
    engine.add_request("cost", {"prompt_token_ids": list(range(1000, 1300))},
                       SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
    engine.step()
    seq = engine.requests["cost"].seqs[0]
    times: dict[int, list[float]] = {k: [] for k in range(max_k + 1)}
    for _ in range(rounds):
        for k in times:
            for _ in range(10):
                seq.spec_token_ids = [5] * k  # almost surely rejected
                t = time.perf_counter()
                engine.step()
                times[k].append(time.perf_counter() - t)
    engine.abort_request("cost")
    base = statistics.median(times[0])
    result = {k: {"ms": round(1000 * statistics.median(v), 2),
                  "ratio": round(statistics.median(v) / base, 3)} for k, v in times.items()}
    print("verification step cost:", result, flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32, help="sequences in the aggregate run")
    ap.add_argument("--sets", nargs="+",
                    default=["grounded", "chat", "batch", "crossover", "cost"],
                    choices=["grounded", "chat", "batch", "crossover", "cost"])
    ap.add_argument("--crossover-batches", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--out", default=results_path("speculative.json"))
    args = ap.parse_args()
    llms = {m: engine(m, args.k) for m in ("off", "ngram", "suffix")}
    results: dict = {"k": args.k, "max_tokens": args.max_tokens, "rounds": args.rounds}
    if "grounded" in args.sets:
        prompts = grounded_prompts()
        results["grounded"] = single_stream(llms, prompts, args.max_tokens, args.rounds)
        print("input-grounded, single stream:", json.dumps(results["grounded"], indent=1))
    if "chat" in args.sets:
        results["chat"] = single_stream(llms, chat_prompts(), args.max_tokens, args.rounds)
        print("open-ended chat, single stream:", json.dumps(results["chat"], indent=1))
    if "batch" in args.sets:
        prompts = (chat_prompts() * 4)[:args.batch]
        results["batch"] = batch_throughput(llms, prompts, 128, args.rounds + 1)
        print(f"{args.batch} chats at once:", json.dumps(results["batch"], indent=1))
    if "crossover" in args.sets:
        results["crossover"] = crossover(args.k, args.crossover_batches, args.max_tokens)
    if "cost" in args.sets:
        results["verify_cost"] = verify_cost(8, 3)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
