"""Structured outputs on SmolLM2-135M-Instruct (float32): are constrained answers valid, what
does the constraint cost in throughput, and what does compiling a new schema add to the time to
first token?

    python benchmarks/structured_outputs.py            # the full run: about 7 minutes on 2
                                                       # idle cores, much longer under load
    python benchmarks/structured_outputs.py --quick    # a smoke run: a few prompts, one round
    pagedserve bench structured [--quick]              # the same, from a source checkout

1. Validity, through a live ``pagedserve serve`` (started here as a subprocess on a free port)
   and the official ``openai`` client: 50 prompts over five pydantic models (nested objects,
   arrays with length bounds, Enum and Literal fields, required fields, numbers with ge/le
   bounds and, for decimals, a multiple_of: bounds do not bound a number's digits, and a small
   model at temperature 0 can write digits until max_tokens; ten prompts each, worded
   differently) sent with
   ``client.chat.completions.parse(response_format=Model)``, non-streamed and streamed
   (``client.chat.completions.stream(...)``, then ``get_final_completion()``), 16 requests in
   flight at once. Valid: ``.parsed`` is an instance of the model. A reply cut at
   ``max_tokens`` (finish_reason "length") counts as invalid and is counted apart. The peer is
   prompting alone: the same 50 prompts without ``response_format``, the model's JSON Schema
   pasted into the prompt with "answer with JSON only"; valid when ``model_validate_json``
   accepts the reply as is, or after stripping a Markdown code fence. Then 20
   ``guided_choice`` and 20 ``guided_regex`` requests (phone numbers, ISO dates, times), valid
   when the reply is one of the choices or matches the whole regex.
2. Throughput, offline ``LLM.generate``: 32 chat prompts, each with its model's JSON Schema
   as ``StructuredOutputsParams(json=...)``, against the same 32 prompts unconstrained (same
   ``max_tokens``, greedy), in interleaved rounds after a warm-up (which also compiles the 32
   grammars and fills the prefix cache: later rounds find both, and time mostly decoding). The measure is output tokens per second of the
   whole batch; unconstrained replies run to ``max_tokens`` more often (a constrained reply
   ends when its object closes), which is fine since tok/s is the measure. Also milliseconds
   per output token and per engine step, with the mean number of rows per step (constrained
   batches thin out earlier). The per-step cost at equal shapes: a second engine runs the
   same prompts unconstrained with ``ignore_eos`` and each reply's ``max_tokens`` set to the
   constrained reply's length, the two engines stepped in turn (each step timed), so that
   every step has the same rows on both sides and a burst of load from elsewhere hits both.
   The same again at batch 1 (one request at a time), where a step is one token. Target:
   constrained/unconstrained >= 0.9x.
3. Compile cost on the time to first token, through the server: streamed chat requests with a
   short prompt and ``max_tokens=1``, one at a time: no constraint, a schema never seen before
   (a property renamed each time, so the compiled-grammar cache misses) and one schema again
   (cached); interleaved, medians and the added milliseconds against no constraint.

Results go to ``benchmarks/results/structured-outputs.json``; every figure is a ratio against
a peer run in the same process (the machine is noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from pathlib import Path
from typing import Annotated, Literal

from common import Server, commit_kv_cache, positive, results_path
from pydantic import BaseModel, Field, ValidationError

from pagedserve.cli import parse_bytes

# ------------------------------------------------------------------ the five response models


class Address(BaseModel):
    street: str = Field(max_length=60)
    city: str = Field(max_length=40)
    country: str = Field(max_length=40)


class Person(BaseModel):
    name: str = Field(max_length=60)
    age: int = Field(ge=0, le=120)
    occupation: str = Field(max_length=60)
    address: Address
    hobbies: list[Annotated[str, Field(max_length=30)]] = Field(min_length=1, max_length=4)


class Item(BaseModel):
    product: str = Field(max_length=40)
    quantity: int = Field(ge=1, le=20)
    unit_price: float = Field(ge=0, le=1000, multiple_of=0.01)


class Order(BaseModel):
    order_id: int = Field(ge=1, le=999_999)
    customer: str = Field(max_length=60)
    items: list[Item] = Field(min_length=1, max_length=3)
    status: Literal["pending", "paid", "shipped", "delivered"]
    express_delivery: bool


class Condition(str, Enum):
    sunny = "sunny"
    cloudy = "cloudy"
    rainy = "rainy"
    snowy = "snowy"
    windy = "windy"


class DayForecast(BaseModel):
    day: Literal["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    high_c: float = Field(ge=-50, le=60, multiple_of=0.1)
    low_c: float = Field(ge=-60, le=50, multiple_of=0.1)
    condition: Condition


class Forecast(BaseModel):
    city: str = Field(max_length=40)
    humidity_percent: int = Field(ge=0, le=100)
    days: list[DayForecast] = Field(min_length=2, max_length=3)


class MovieReview(BaseModel):
    title: str = Field(max_length=80)
    year: int = Field(ge=1900, le=2025)
    rating: float = Field(ge=0, le=10, multiple_of=0.5)
    genres: list[Literal["action", "comedy", "drama", "horror", "sci-fi", "romance",
                         "animation", "documentary"]] = Field(min_length=1, max_length=3)
    recommended: bool
    summary: str = Field(max_length=200)


class Ingredient(BaseModel):
    name: str = Field(max_length=40)
    amount: str = Field(max_length=20)


class Recipe(BaseModel):
    name: str = Field(max_length=60)
    servings: int = Field(ge=1, le=12)
    difficulty: Literal["easy", "medium", "hard"]
    vegetarian: bool
    ingredients: list[Ingredient] = Field(min_length=2, max_length=5)
    steps: list[Annotated[str, Field(max_length=120)]] = Field(min_length=1, max_length=3)


PROMPTS: dict[type[BaseModel], list[str]] = {
    Person: [
        "Describe a fictional person.",
        "Invent a character for a detective novel set in Lisbon.",
        "Create a profile for a retired teacher who loves gardening.",
        "Make up a person who works as a pilot.",
        "Give me a made-up customer profile for testing a web shop.",
        "Who could live next door to a lighthouse? Describe them.",
        "Describe a young software engineer from Nairobi.",
        "Imagine a famous chef and describe him.",
        "Write the profile of an imaginary marathon runner.",
        "Describe a grandmother who collects stamps.",
    ],
    Order: [
        "Give the order for two pizzas and a bottle of water.",
        "Create a sample online order for office supplies.",
        "Record an order of three notebooks and a pen for Maria Lopez.",
        "Make up a grocery order that has already been shipped.",
        "Write down the order for a new laptop with express delivery.",
        "Invent a bookshop order from a regular customer.",
        "A customer bought five coffee mugs. Give the order.",
        "Give the order for a pair of running shoes, paid but not shipped yet.",
        "Create an order for a birthday party: balloons, candles and a cake.",
        "Describe a hardware store order for nails, a hammer and paint.",
    ],
    Forecast: [
        "Give the weather forecast for Paris for the next two days.",
        "What will the weather be like in Oslo this weekend? Make up a forecast.",
        "Forecast three days of weather in Cairo.",
        "Invent a rainy forecast for London.",
        "Give a winter forecast for Montreal, three days.",
        "Make up the weather for a beach holiday in Lisbon.",
        "Forecast the weather in Tokyo for Monday and Tuesday.",
        "Give a windy forecast for Chicago.",
        "What is the forecast for a ski trip to Zermatt?",
        "Describe next week's weather in Sydney, two days.",
    ],
    MovieReview: [
        "Review a science fiction movie you like.",
        "Write a short review of a classic comedy film.",
        "Review the movie Titanic.",
        "Give a review of an animated film for children.",
        "Review a horror movie from the 1980s.",
        "Write a review of a documentary about the ocean.",
        "Review a romantic drama you would not recommend.",
        "Give a critic's review of an action movie.",
        "Review the film The Matrix.",
        "Write a review of a movie about space travel.",
    ],
    Recipe: [
        "Give a recipe for pancakes.",
        "Write a simple recipe for tomato soup.",
        "How do I make a vegetarian curry? Give the recipe.",
        "Give a recipe for chocolate chip cookies.",
        "Write a quick recipe for a green salad.",
        "Give me a recipe for spaghetti carbonara.",
        "Write a recipe for banana bread.",
        "Give an easy recipe for guacamole.",
        "Write a recipe for a fruit smoothie for two people.",
        "Give a recipe for roast chicken with potatoes.",
    ],
}

CHOICES = [
    ("What is the sentiment of this review: 'The food was cold and the waiter was rude.'?",
     ["positive", "negative", "neutral"]),
    ("What is the sentiment of this review: 'Absolutely loved it, will come back!'?",
     ["positive", "negative", "neutral"]),
    ("What is the sentiment of this sentence: 'The meeting is at three o'clock.'?",
     ["positive", "negative", "neutral"]),
    ("What is the sentiment of this tweet: 'Best concert of my life!!!'?",
     ["positive", "negative", "neutral"]),
    ("What is the sentiment of this review: 'Broke after two days. Waste of money.'?",
     ["positive", "negative", "neutral"]),
    ("Is Paris the capital of France?", ["yes", "no"]),
    ("Is the sun a planet?", ["yes", "no"]),
    ("Can penguins fly?", ["yes", "no"]),
    ("Is water wet?", ["yes", "no"]),
    ("Is 7 a prime number?", ["yes", "no"]),
    ("Which one is a fruit?", ["apple", "carrot", "potato"]),
    ("Which animal is the largest?", ["blue whale", "elephant", "giraffe", "mouse"]),
    ("What color is the sky on a clear day?", ["red", "green", "blue", "yellow"]),
    ("Which language is spoken in Brazil?", ["Spanish", "Portuguese", "French"]),
    ("Which planet is closest to the sun?", ["Mercury", "Venus", "Earth", "Mars"]),
    ("Classify this email subject: 'You won a free cruise, click now!'",
     ["spam", "not spam"]),
    ("Classify this email subject: 'Minutes of Tuesday's project meeting'",
     ["spam", "not spam"]),
    ("What is the topic of 'The striker scored twice in the final'?",
     ["sports", "politics", "science", "business"]),
    ("What is the topic of 'Shares fell 3% after the earnings call'?",
     ["sports", "politics", "science", "business"]),
    ("What is the topic of 'Researchers found water ice on the moon'?",
     ["sports", "politics", "science", "business"]),
]

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
TIME = r"([01]\d|2[0-3]):[0-5]\d"
REGEXES = [
    ("Make up a phone number for a pizza place.", PHONE),
    ("What is a phone number I could use in a movie script?", PHONE),
    ("Give the phone number of a fictional dentist.", PHONE),
    ("Invent a phone number for customer support.", PHONE),
    ("Write a US phone number.", PHONE),
    ("Give a phone number for a taxi company in a story.", PHONE),
    ("What date was the first moon landing?", DATE),
    ("When did World War II end? Give the date.", DATE),
    ("Give the date of New Year's Day 2024.", DATE),
    ("On what date is Christmas in 2025?", DATE),
    ("Write today's date in ISO format.", DATE),
    ("When was the Declaration of Independence signed?", DATE),
    ("Give the date of the Fourth of July in 1999.", DATE),
    ("Pick a date for a meeting next year.", DATE),
    ("At what time does a typical office open?", TIME),
    ("What time is lunch usually served?", TIME),
    ("Give a time for an evening movie screening.", TIME),
    ("When should a child go to bed? Give a time.", TIME),
    ("At what time does the sun rise in summer, roughly?", TIME),
    ("Give the departure time of an early morning train.", TIME),
]


def validity_prompts(n_per_model: int) -> list[tuple[type[BaseModel], str]]:
    """Interleaved by model, so that any prefix holds every model."""
    lists = [[(m, p) for p in ps[:n_per_model]] for m, ps in PROMPTS.items()]
    return [x for group in zip(*lists) for x in group]


def schema_prompt(model: type[BaseModel], prompt: str) -> str:
    schema = json.dumps(model.model_json_schema(), separators=(",", ":"))
    return (f"{prompt}\n\nAnswer with JSON only: one object that follows this JSON Schema.\n"
            f"{schema}")


def strip_fence(text: str) -> str:
    """The text inside the first Markdown code fence, if there is one."""
    m = re.search(r"```(?:json|JSON)?\s*\n?(.*?)(?:```|$)", text, re.S)
    return m.group(1).strip() if m else text.strip()


# ------------------------------------------------------------------ the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BenchServer:
    """``pagedserve serve`` on a free port (``common.Server``) with an openai ``client``."""

    API_KEY = "structured-bench"

    def __init__(self, dtype: str, log: Path):
        import openai

        self.port = free_port()
        self.server = Server([sys.executable, "-m", "pagedserve.cli", "serve", "--port",
                              str(self.port), "--dtype", dtype, "--api-key", self.API_KEY],
                             self.port, log)
        self.client = openai.OpenAI(base_url=self.server.url + "/v1", api_key=self.API_KEY,
                                    max_retries=0, timeout=600)
        self.model = self.client.models.list().data[0].id

    def stop(self) -> None:
        self.server.stop()


# ------------------------------------------------------------------ 1. validity


def parsed_request(server: BenchServer, model: type[BaseModel], prompt: str, max_tokens: int,
                   temperature: float) -> dict:
    """``chat.completions.parse``; the raw reply is kept, so that a failure shows it."""
    from openai import LengthFinishReasonError

    raw = server.client.chat.completions.with_raw_response.parse(
        model=server.model, messages=[{"role": "user", "content": prompt}],
        response_format=model, max_tokens=max_tokens, temperature=temperature)
    body = raw.http_response.json()
    choice = body["choices"][0]
    row = {"content": choice["message"].get("content"), "finish_reason": choice["finish_reason"],
           "tokens": body.get("usage", {}).get("completion_tokens")}
    try:
        parsed = raw.parse().choices[0].message.parsed
        row["valid"], row["error"] = isinstance(parsed, model), None
    except LengthFinishReasonError:
        row["valid"], row["error"] = False, "length"
    except Exception as e:  # noqa: BLE001  (pydantic or JSON errors: the reply is reported)
        row["valid"], row["error"] = False, f"{type(e).__name__}: {e}"
    return row


def streamed_request(server: BenchServer, model: type[BaseModel], prompt: str, max_tokens: int,
                     temperature: float) -> dict:
    """``chat.completions.stream`` and ``get_final_completion()``; the streamed text is
    collected from the raw chunks too, so that a failure shows it."""
    from openai import LengthFinishReasonError

    text, finish, tokens = [], None, None
    row = {}
    try:
        with server.client.chat.completions.stream(
                model=server.model, messages=[{"role": "user", "content": prompt}],
                response_format=model, max_tokens=max_tokens, temperature=temperature,
                stream_options={"include_usage": True}) as stream:
            for event in stream:
                if event.type != "chunk":
                    continue
                if event.chunk.usage is not None:
                    tokens = event.chunk.usage.completion_tokens
                for c in event.chunk.choices:
                    text.append(c.delta.content or "")
                    finish = c.finish_reason or finish
            parsed = stream.get_final_completion().choices[0].message.parsed
        row["valid"], row["error"] = isinstance(parsed, model), None
    except LengthFinishReasonError:
        # raised on the chunk that ends the reply, before the usage chunk: it used them all
        row["valid"], row["error"] = False, "length"
        finish, tokens = "length", max_tokens
    except Exception as e:  # noqa: BLE001
        row["valid"], row["error"] = False, f"{type(e).__name__}: {e}"
    row.update(content="".join(text), finish_reason=finish, tokens=tokens)
    return row


def prompted_request(server: BenchServer, model: type[BaseModel], prompt: str, max_tokens: int,
                     temperature: float) -> dict:
    """No ``response_format``: the schema is in the prompt."""
    r = server.client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": schema_prompt(model, prompt)}],
        max_tokens=max_tokens, temperature=temperature)
    content = r.choices[0].message.content or ""

    def ok(text: str) -> bool:
        try:
            model.model_validate_json(text)
            return True
        except ValidationError:
            return False

    as_is = ok(content)
    return {"content": content, "finish_reason": r.choices[0].finish_reason,
            "tokens": r.usage.completion_tokens, "valid": as_is,
            "valid_unfenced": as_is or ok(strip_fence(content)), "error": None}


def guided_request(server: BenchServer, kind: str, prompt: str, spec, max_tokens: int,
                   temperature: float) -> dict:
    r = server.client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens, temperature=temperature, extra_body={f"guided_{kind}": spec})
    content = r.choices[0].message.content or ""
    valid = content in spec if kind == "choice" else re.fullmatch(spec, content) is not None
    return {"content": content, "finish_reason": r.choices[0].finish_reason,
            "tokens": r.usage.completion_tokens, "valid": valid, "error": None}


def run_pool(fn, jobs: list[tuple], concurrency: int) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(fn, *job) for job in jobs]
        rows = []
        for f in futures:
            try:
                rows.append(f.result())
            except Exception as e:  # noqa: BLE001  (a refused request counts as invalid)
                rows.append({"valid": False, "error": f"request failed: {type(e).__name__}: {e}",
                             "content": None, "finish_reason": None, "tokens": None})
    return rows, time.perf_counter() - t0


def summarize_validity(name: str, jobs: list[tuple], rows: list[dict], seconds: float) -> dict:
    tokens = [r["tokens"] for r in rows if r.get("tokens") is not None]
    out = {"name": name, "requests": len(rows), "valid": sum(r["valid"] for r in rows),
           "length_truncated": sum(r.get("finish_reason") == "length" for r in rows),
           "mean_output_tokens": round(statistics.mean(tokens), 1) if tokens else None,
           "seconds": round(seconds, 1)}
    if "valid_unfenced" in rows[0]:
        out["valid_unfenced"] = sum(r["valid_unfenced"] for r in rows)
    best = "valid_unfenced" if "valid_unfenced" in rows[0] else "valid"
    out["valid_of_not_cut"] = sum(r[best] for r in rows if r.get("finish_reason") != "length")
    per_model: dict[str, list[int]] = {}
    for job, r in zip(jobs, rows):
        key = job[1].__name__ if isinstance(job[1], type) else job[1]
        per_model.setdefault(key, [0, 0])
        per_model[key][0] += r["valid"]
        per_model[key][1] += 1
    out["per_kind"] = {k: f"{v}/{n}" for k, (v, n) in per_model.items()}
    out["failures"] = [{"request": describe(job), **r} for job, r in zip(jobs, rows)
                       if not r["valid"]]
    return out


def describe(job: tuple) -> dict:
    _, what, prompt, *rest = job
    if isinstance(what, type):
        return {"response_format": what.__name__, "prompt": prompt}
    return {f"guided_{what}": rest[0], "prompt": prompt}


def validity(server: BenchServer, args) -> list[dict]:
    items = validity_prompts(args.prompts_per_model)
    mt, temp = args.max_tokens, args.temperature
    suites = [
        ("response_format (parse)", parsed_request,
         [(server, m, p, mt, temp) for m, p in items]),
        ("response_format (stream)", streamed_request,
         [(server, m, p, mt, temp) for m, p in items]),
        ("schema in prompt only", prompted_request,
         [(server, m, p, mt, temp) for m, p in items]),
        ("guided_choice", guided_request,
         [(server, "choice", p, c, 16, temp) for p, c in CHOICES[:args.guided]]),
        ("guided_regex", guided_request,
         [(server, "regex", p, r, 32, temp) for p, r in REGEXES[:args.guided]]),
    ]
    results = []
    for name, fn, jobs in suites:
        rows, seconds = run_pool(fn, jobs, args.concurrency)
        results.append(summarize_validity(name, jobs, rows, seconds))
        print(f"  {name}: {results[-1]['valid']}/{len(rows)} valid, {seconds:.0f} s", flush=True)
    return results


# ------------------------------------------------------------------ 3. compile cost on TTFT


def ttft_ms(server: BenchServer, response_format: dict | None) -> float:
    extra = {"response_format": response_format} if response_format else {}
    t0 = time.perf_counter()
    stream = server.client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=1, temperature=0, stream=True, **extra)
    first = None
    for chunk in stream:
        if first is None and any(c.delta.content or c.finish_reason for c in chunk.choices):
            first = time.perf_counter()
    return 1e3 * ((first or time.perf_counter()) - t0)


def json_schema_format(schema: dict, name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": True}}


def compile_ttft(server: BenchServer, n: int) -> dict:
    """``n`` of each kind, interleaved; the new schemas are Order's with a property renamed."""
    from openai.lib._pydantic import to_strict_json_schema

    base = to_strict_json_schema(Order)
    cached = json_schema_format(base, "Order")
    tag = uuid.uuid4().hex[:8]

    def fresh(i: int) -> dict:
        text = json.dumps(base).replace('"customer"', f'"customer_{tag}_{i}"')
        return json_schema_format(json.loads(text), f"Order{i}")

    ttft_ms(server, None)
    ttft_ms(server, cached)  # warm: compiled once, cached from here on
    times: dict[str, list[float]] = {"none": [], "new schema": [], "cached schema": []}
    for i in range(n):
        times["none"].append(ttft_ms(server, None))
        times["new schema"].append(ttft_ms(server, fresh(i)))
        times["cached schema"].append(ttft_ms(server, cached))
    base_ms = statistics.median(times["none"])
    return {k: {"median_ms": round(statistics.median(v), 1),
                "min_ms": round(min(v), 1), "max_ms": round(max(v), 1),
                "added_ms": round(statistics.median(v) - base_ms, 1), "all_ms": v}
            for k, v in times.items()}


# ------------------------------------------------------------------ 2. throughput (offline)


def throughput(args) -> dict:
    from openai.lib._pydantic import to_strict_json_schema

    from pagedserve import LLM, SamplingParams
    from pagedserve.sampling_params import StructuredOutputsParams

    # Two engines: the second one runs the unconstrained batch step for step beside the first
    # one's constrained batch (see lockstep); the same KV size for both.
    llm = LLM(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory)
    peer = LLM(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory) if args.lockstep else None
    for e in (llm, peer):
        if e is not None:
            commit_kv_cache(e)
            e.generate(["Hello"], SamplingParams(max_tokens=8), use_tqdm=False)
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    steps = [0]
    step = engine.step

    def counted_step():
        steps[0] += 1
        return step()

    engine.step = counted_step
    items = (validity_prompts(10) * 4)[:args.batch]
    prompts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": schema_prompt(m, p)}], tokenize=False,
        add_generation_prompt=True) for m, p in items]
    free = SamplingParams(temperature=0, max_tokens=args.throughput_max_tokens)
    constrained = [SamplingParams(temperature=0, max_tokens=args.throughput_max_tokens,
                                  structured_outputs=StructuredOutputsParams(
                                      json=to_strict_json_schema(m)))
                   for m, _ in items]

    def run(batch_prompts, params) -> dict:
        steps[0] = 0
        t0 = time.perf_counter()
        outs = llm.generate(batch_prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        return {"seconds": seconds, "tokens": sum(lengths), "steps": steps[0],
                "at_max_tokens": sum(n >= args.throughput_max_tokens for n in lengths),
                "texts": [o.outputs[0].text for o in outs], "lengths": lengths}

    def single(params_of) -> dict:
        """The first ``--batch1-requests`` prompts, one request at a time."""
        total = {"seconds": 0.0, "tokens": 0, "steps": 0, "at_max_tokens": 0, "texts": [],
                 "lengths": []}
        for i in range(args.batch1_requests):
            r = run([prompts[i]], [params_of(i)])
            for k in total:
                total[k] += r[k]
        return total

    shapes = {f"batch {len(prompts)}": (lambda: run(prompts, constrained),
                                        lambda: run(prompts, [free] * len(prompts)),
                                        len(prompts))}
    if args.batch1_requests:
        shapes["batch 1"] = (lambda: single(lambda i: constrained[i]),
                             lambda: single(lambda i: free), 1)
    report = {}
    for shape, (run_constrained, run_free, width) in shapes.items():
        run_constrained()  # warm-up (and the grammars compiled, then cached)
        run_free()
        rounds = {"constrained": [], "unconstrained": []}
        for _ in range(args.rounds):
            rounds["constrained"].append(run_constrained())
            rounds["unconstrained"].append(run_free())
        report[shape] = summarize_throughput(rounds)
        last = rounds["constrained"][-1]
        bad = []
        for (m, _), text, n in zip(items, last["texts"], last["lengths"]):
            try:
                m.model_validate_json(text)
            except ValidationError as e:
                bad.append({"model": m.__name__, "text": text, "error": str(e),
                            "cut_at_max_tokens": n >= args.throughput_max_tokens})
        report[shape]["constrained_invalid"] = bad
        if peer is not None:
            n = len(prompts) if width > 1 else args.batch1_requests
            # the prompts' KV into the peer's prefix cache too, as the rounds left it in ours
            peer.generate(prompts[:n], SamplingParams(temperature=0, max_tokens=1),
                          use_tqdm=False)
            report[shape]["lockstep"] = lockstep(
                engine, peer.llm_engine, prompts[:n], constrained[:n], last["lengths"], width)
        c, u = report[shape]["constrained"], report[shape]["unconstrained"]
        print(f"  {shape}: constrained {c['tok_s']:.1f} tok/s, unconstrained {u['tok_s']:.1f} "
              f"tok/s ({report[shape]['tok_s_ratio']:.2f}x)", flush=True)
    return report


def lockstep(constrained_engine, free_engine, prompts: list[str], constrained: list,
             lengths: list[int], width: int) -> dict:
    """The per-step cost of the constraint at equal batch shapes: the constrained requests on
    one engine, and on the other the same prompts unconstrained with ``ignore_eos`` and
    ``max_tokens`` set to the length each constrained reply had, so that both batches hold the
    same rows at every step; ``width`` requests at a time. The two engines are stepped in
    turn and each step is timed: a burst of load from elsewhere on the machine then falls on
    both about equally, which whole runs one after the other cannot promise. Output tok/s =
    tokens / the engine's summed step time."""
    from dataclasses import replace

    from pagedserve import SamplingParams
    from pagedserve.sampling_params import RequestOutputKind

    final = RequestOutputKind.FINAL_ONLY
    sides = {"constrained": (constrained_engine,
                             [replace(p, output_kind=final) for p in constrained]),
             "unconstrained": (free_engine,
                               [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                               output_kind=final) for n in lengths])}
    stats = {k: {"seconds": 0.0, "tokens": 0, "steps": 0} for k in sides}
    for start in range(0, len(prompts), width):
        for name, (engine, params) in sides.items():
            for i in range(start, min(start + width, len(prompts))):
                engine.add_request(f"lockstep-{name}-{i}", prompts[i], params[i])
        while any(engine.has_unfinished_requests() for engine, _ in sides.values()):
            for name, (engine, _) in sides.items():
                if not engine.has_unfinished_requests():
                    continue
                t0 = time.perf_counter()
                outs = engine.step()
                stats[name]["seconds"] += time.perf_counter() - t0
                stats[name]["steps"] += 1
                stats[name]["tokens"] += sum(len(o.outputs[0].token_ids) for o in outs
                                             if o.finished)
    out = {k: {"tok_s": round(v["tokens"] / v["seconds"], 2),
               "ms_per_token": round(1e3 * v["seconds"] / v["tokens"], 3),
               "ms_per_step": round(1e3 * v["seconds"] / v["steps"], 2),
               "steps": v["steps"], "tokens": v["tokens"]}
           for k, v in stats.items()}
    out["ms_per_step_ratio"] = round(out["constrained"]["ms_per_step"]
                                     / out["unconstrained"]["ms_per_step"], 3)
    out["tok_s_ratio"] = round(out["constrained"]["tok_s"] / out["unconstrained"]["tok_s"], 3)
    return out


def summarize_throughput(rounds: dict[str, list[dict]]) -> dict:
    out = {}
    for mode, runs in rounds.items():
        seconds = sum(r["seconds"] for r in runs)
        tokens = sum(r["tokens"] for r in runs)
        steps = sum(r["steps"] for r in runs)
        out[mode] = {"tok_s": round(tokens / seconds, 2),
                     "tok_s_rounds": [round(r["tokens"] / r["seconds"], 2) for r in runs],
                     "ms_per_token": round(1e3 * seconds / tokens, 3),
                     "ms_per_step": round(1e3 * seconds / steps, 2),
                     "rows_per_step": round(tokens / steps, 2),
                     "tokens_per_run": round(tokens / len(runs), 1),
                     "at_max_tokens_per_run": round(sum(r["at_max_tokens"] for r in runs)
                                                    / len(runs), 1)}
    c, u = out["constrained"], out["unconstrained"]
    # per round, then the median: each round's pair ran back to back
    ratios = [a["tokens"] / a["seconds"] / (b["tokens"] / b["seconds"])
              for a, b in zip(rounds["constrained"], rounds["unconstrained"])]
    out["tok_s_ratio"] = round(statistics.median(ratios), 3)
    out["tok_s_ratio_rounds"] = [round(x, 3) for x in ratios]
    out["best_round_ratio"] = round(max(c["tok_s_rounds"]) / max(u["tok_s_rounds"]), 3)
    out["ms_per_token_ratio"] = round(c["ms_per_token"] / u["ms_per_token"], 3)
    out["ms_per_step_ratio"] = round(c["ms_per_step"] / u["ms_per_step"], 3)
    return out


# ------------------------------------------------------------------ main


def print_report(report: dict) -> None:
    if "validity" in report:
        print_validity(report)
    if "throughput" in report:
        print_throughput(report)
    if "compile_ttft" in report:
        print_ttft(report)


def print_validity(report: dict) -> None:
    print("\n## 1. Validity (server, openai client, "
          f"{report['args']['concurrency']} in flight, max_tokens "
          f"{report['args']['max_tokens']}, temperature {report['args']['temperature']:g})\n")
    print("| requests | valid | valid after stripping ``` | cut at max_tokens | "
          "valid of those not cut | mean output tokens | seconds |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in report["validity"]:
        n, cut = r["requests"], r["length_truncated"]
        unf = (f"{r['valid_unfenced']}/{n} ({100 * r['valid_unfenced'] / n:.0f}%)"
               if "valid_unfenced" in r else "-")
        print(f"| {r['name']} | {r['valid']}/{n} ({100 * r['valid'] / n:.0f}%) | {unf} | "
              f"{cut} | {r['valid_of_not_cut']}/{n - cut} | {r['mean_output_tokens']} | {r['seconds']} |")
    print("\nper model: " + "; ".join(
        f"{r['name']}: " + ", ".join(f"{k} {v}" for k, v in r["per_kind"].items())
        for r in report["validity"][:3]))


def print_throughput(report: dict) -> None:
    print("\n## 2. Throughput (offline LLM.generate, greedy, max_tokens "
          f"{report['args']['throughput_max_tokens']}, {report['args']['rounds']} interleaved "
          "rounds after a warm-up)\n")
    print("| batch | mode | output tok/s | per round | ms/output token | ms/step | "
          "rows/step | tokens/run | at max_tokens/run |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for shape, t in report["throughput"].items():
        for mode in ("constrained", "unconstrained"):
            m = t[mode]
            print(f"| {shape} | {mode} | {m['tok_s']:.1f} | "
                  f"{', '.join(f'{x:.1f}' for x in m['tok_s_rounds'])} | "
                  f"{m['ms_per_token']:.2f} | {m['ms_per_step']:.1f} | {m['rows_per_step']:.1f} | "
                  f"{m['tokens_per_run']:.0f} | {m['at_max_tokens_per_run']:.0f} |")
    for shape, t in report["throughput"].items():
        bad = t["constrained_invalid"]
        print(f"{shape}: constrained/unconstrained output tok/s {t['tok_s_ratio']:.2f}x "
              f"(median of the rounds' ratios {t['tok_s_ratio_rounds']}; fastest rounds "
              f"{t['best_round_ratio']:.2f}x; target >= 0.9x); ms per output token "
              f"{t['ms_per_token_ratio']:.2f}x, ms per step {t['ms_per_step_ratio']:.2f}x; "
              f"{len(bad)} constrained replies of the last round not valid "
              f"({sum(b['cut_at_max_tokens'] for b in bad)} of them cut at max_tokens)")
        if "lockstep" in t:
            c, u = t["lockstep"]["constrained"], t["lockstep"]["unconstrained"]
            print(f"  {shape}, equal lengths, two engines stepped in turn: constrained "
                  f"{c['ms_per_step']:.1f} ms/step ({c['tok_s']:.1f} tok/s), unconstrained "
                  f"{u['ms_per_step']:.1f} ms/step ({u['tok_s']:.1f} tok/s) over "
                  f"{c['steps']}/{u['steps']} steps, {c['tokens']}/{u['tokens']} tokens: "
                  f"{t['lockstep']['ms_per_step_ratio']:.2f}x per-step cost, "
                  f"{t['lockstep']['tok_s_ratio']:.2f}x tok/s")


def print_ttft(report: dict) -> None:
    c = report["compile_ttft"]
    print(f"\n## 3. Time to first token (server, streamed, max_tokens 1, "
          f"{len(c['none']['all_ms'])} sequential requests each, interleaved)\n")
    print("| constraint | median ms | min | max | added vs none (median) |")
    print("|---|---:|---:|---:|---:|")
    for k, v in c.items():
        print(f"| {k} | {v['median_ms']:.1f} | {v['min_ms']:.1f} | {v['max_ms']:.1f} | "
              f"{v['added_ms']:+.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2 prompts per model, 4 guided of each kind, batch 8, "
                         "one round, 3 TTFT requests")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts-per-model", type=positive, default=10)
    ap.add_argument("--guided", type=positive, default=20, help="guided_choice and "
                    "guided_regex requests, each")
    ap.add_argument("--concurrency", type=positive, default=16)
    ap.add_argument("--max-tokens", type=positive, default=512, help="validity requests")
    ap.add_argument("--temperature", type=float, default=0.0, help="validity requests")
    ap.add_argument("--batch", type=positive, default=32)
    ap.add_argument("--throughput-max-tokens", type=positive, default=128)
    ap.add_argument("--rounds", type=positive, default=3)
    ap.add_argument("--batch1-requests", type=int, default=1,
                    help="single requests per round at batch 1 (0: skip batch 1)")
    ap.add_argument("--no-lockstep", dest="lockstep", action="store_false",
                    help="skip the per-step cost at equal lengths (a second engine, stepped in turn)")
    ap.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("2GiB"),
                    help="KV cache of each offline engine")
    ap.add_argument("--ttft-requests", type=positive, default=10)
    ap.add_argument("--skip", nargs="*", default=[], choices=("validity", "throughput", "ttft"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.prompts_per_model, args.guided, args.batch, args.rounds = 2, 4, 8, 1
        args.batch1_requests, args.ttft_requests = min(args.batch1_requests, 1), 3
    out = args.out or (str(Path(tempfile.gettempdir()) / "structured-outputs-quick.json")
                       if args.quick else results_path("structured-outputs.json"))
    t_start = time.perf_counter()
    report = {"args": vars(args), "cpus": os.cpu_count(), "load_avg": {}}

    def load(when: str) -> None:  # the machine is shared: what else ran shows here
        report["load_avg"][when] = [round(x, 2) for x in os.getloadavg()]

    load("start")
    if {"validity", "ttft"} - set(args.skip):
        log = Path(tempfile.gettempdir()) / "pagedserve-structured-bench.log"
        print(f"starting pagedserve serve (log: {log})", flush=True)
        server = BenchServer(args.dtype, log)
        try:
            report["model"] = server.model
            if "validity" not in args.skip:
                print("1. validity", flush=True)
                report["validity"] = validity(server, args)
                load("after validity")
            if "ttft" not in args.skip:
                print("3. compile cost on TTFT", flush=True)
                report["compile_ttft"] = compile_ttft(server, args.ttft_requests)
                load("after ttft")
        finally:
            server.stop()
    if "throughput" not in args.skip:
        print("2. throughput", flush=True)
        report["throughput"] = throughput(args)
        load("after throughput")
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    print_report(report)
    print(f"\nload average (1, 5, 15 min) on {report['cpus']} CPUs: " + "; ".join(
        f"{k} {v}" for k, v in report["load_avg"].items()))
    print(f"wall time {report['wall_s']:.0f} s; results in {out}")
    with open(out, "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
