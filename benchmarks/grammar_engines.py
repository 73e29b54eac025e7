"""Grammar engines for structured output, compared on SmolLM2's tokenizer (49,152 tokens) and
the sampler's batch shapes: llguidance and outlines-core (xgrammar pulls triton, several
hundred MB, into a CPU install, so it is left out here).

    pip install llguidance outlines-core
    python benchmarks/grammar_engines.py

For five JSON schemas (nested objects, arrays, enums, required fields, bounded numbers), a
regex and a choice: the time to compile a grammar for the tokenizer (what a new schema adds
to its first request's time to first token), then the time to compute the next-token bitmask
per constrained row while walking a valid answer token by token, with 1, 8 and 32 such rows
per step (llguidance: its parallel executor over the batch; outlines-core: one guide after
the other). Results go to ``benchmarks/results/grammar-engines.json``.
"""

from __future__ import annotations

import json
import time

import torch
from common import results_path

from pagedserve.loader import open_model

SCHEMAS = {
    "person": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"]}, {"name": "Ada Lovelace", "age": 36}),
    "order": ({"type": "object", "properties": {
        "id": {"type": "integer"}, "items": {"type": "array", "items": {
            "type": "object", "properties": {"sku": {"type": "string"},
                                             "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"]}},
        "status": {"enum": ["new", "paid", "shipped"]}},
        "required": ["id", "items", "status"]},
        {"id": 7, "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-9", "qty": 1}],
         "status": "paid"}),
    "weather": ({"type": "object", "properties": {
        "city": {"type": "string"}, "celsius": {"type": "number", "minimum": -90,
                                                "maximum": 60},
        "conditions": {"type": "array", "items": {"enum": ["sun", "rain", "snow", "wind"]}}},
        "required": ["city", "celsius", "conditions"]},
        {"city": "Paris", "celsius": 21.5, "conditions": ["sun", "wind"]}),
    "event": ({"type": "object", "properties": {
        "title": {"type": "string"}, "attendees": {"type": "array", "items": {
            "type": "object", "properties": {"name": {"type": "string"},
                                             "email": {"type": "string"}},
            "required": ["name"]}},
        "public": {"type": "boolean"}}, "required": ["title", "attendees", "public"]},
        {"title": "Launch", "attendees": [{"name": "Bo", "email": "bo@x.org"}], "public": True}),
    "review": ({"type": "object", "properties": {
        "product": {"type": "string"}, "stars": {"type": "integer", "minimum": 1, "maximum": 5},
        "pros": {"type": "array", "items": {"type": "string"}},
        "verdict": {"enum": ["buy", "skip", "wait"]}},
        "required": ["product", "stars", "pros", "verdict"]},
        {"product": "Kettle", "stars": 4, "pros": ["fast", "quiet"], "verdict": "buy"}),
}
REGEX = (r"\d{3}-\d{4}", "555-1234")
CHOICE = (["positive", "negative", "neutral"], "neutral")


def answers(tokenizer):
    """(name, kind, spec, token ids of a valid answer) for every grammar."""
    out = []
    for name, (schema, value) in SCHEMAS.items():
        out.append((name, "json", schema, tokenizer.encode(json.dumps(value, separators=(",", ":")),
                                                           add_special_tokens=False)))
    out.append(("regex", "regex", REGEX[0], tokenizer.encode(REGEX[1], add_special_tokens=False)))
    out.append(("choice", "choice", CHOICE[0],
                tokenizer.encode(CHOICE[1], add_special_tokens=False)))
    return out


def byte_level_alphabet() -> dict[int, str]:
    """Byte -> the printable character byte-level BPE (GPT-2, SmolLM2) writes it as:
    printable Latin-1 bytes stand for themselves, the others are shifted past 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = (b for b in range(256) if b not in keep)
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        t0 = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tokenizer)
        self.setup_s = time.perf_counter() - t0
        self.executor = llguidance.LLExecutor()

    def compile(self, kind, spec):
        m = self.ll.LLMatcher
        grammar = (m.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
                   if kind == "json" else m.grammar_from_regex(spec) if kind == "regex"
                   else m.grammar_from_regex("|".join(spec)))
        matcher = m(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def masks(self, states, mask):
        from llguidance.torch import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(self.executor, [(s, i) for i, s in enumerate(states)], mask)

    def advance(self, state, token):
        assert state.consume_token(token)
        return state

    def copy(self, state):
        return state.deep_copy()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer):
        from outlines_core import Vocabulary

        t0 = time.perf_counter()
        byte_of = {c: b for b, c in byte_level_alphabet().items()}
        special = set(tokenizer.all_special_ids)
        vocab: dict[bytes, list[int]] = {}
        for token, i in tokenizer.get_vocab().items():
            if i in special:
                continue
            raw = bytes(byte_of[c] for c in token) if all(c in byte_of for c in token) \
                else token.encode()
            vocab.setdefault(raw, []).append(i)
        self.vocab = Vocabulary(tokenizer.eos_token_id, vocab)
        self.setup_s = time.perf_counter() - t0

    def compile(self, kind, spec):
        from outlines_core import Guide, Index
        from outlines_core.json_schema import build_regex_from_schema

        regex = (build_regex_from_schema(json.dumps(spec)) if kind == "json" else spec
                 if kind == "regex" else "|".join(spec))
        return Guide(Index(regex, self.vocab))

    def masks(self, states, mask):
        for i, s in enumerate(states):
            row = mask[i]
            s.write_mask_into(row.data_ptr(), row.numel(), row.element_size())

    def advance(self, state, token):
        state.advance(token, return_tokens=False)
        return state

    def copy(self, state):
        return state  # rebuilt per walk below


def walk(engine, compiled, tokens, rows: int) -> float:
    """Seconds per constrained row per step: ``rows`` copies of the grammar walk the same
    valid answer together."""
    states = [engine.copy(compiled()) for _ in range(rows)]
    mask = torch.full((rows, (49152 + 31) // 32), -1, dtype=torch.int32)
    engine.masks([compiled()], mask[:1])  # warm-up: a first mask builds lazy tables
    total = 0.0
    for t in tokens:
        t0 = time.perf_counter()
        engine.masks(states, mask)
        total += time.perf_counter() - t0
        word, bit = divmod(t, 32)
        assert (mask[0, word] >> bit) & 1, "a valid answer's token was masked out"
        states = [engine.advance(s, t) for s in states]
    return total / (len(tokens) * rows)


def main() -> None:
    tokenizer = open_model(None).tokenizer()
    grammars = answers(tokenizer)
    report = {}
    for cls in (LLGuidance, OutlinesCore):
        try:
            engine = cls(tokenizer)
        except ImportError as e:
            print(f"{cls.name}: not installed ({e})")
            continue
        row = {"tokenizer_setup_s": round(engine.setup_s, 3), "grammars": {}}
        for name, kind, spec, tokens in grammars:
            t0 = time.perf_counter()
            engine.compile(kind, spec)
            compile_s = time.perf_counter() - t0
            per_rows = {}
            for rows in (1, 8, 32):
                per_rows[rows] = 1e6 * walk(
                    engine, lambda e=engine, k=kind, s=spec: e.compile(k, s), tokens, rows)
            row["grammars"][name] = {"compile_ms": round(1e3 * compile_s, 1),
                                     **{f"mask_us_per_row_at_{r}": round(v, 1)
                                        for r, v in per_rows.items()}}
            print(f"{cls.name:14s} {name:8s} compile {1e3 * compile_s:8.1f} ms, mask per row "
                  + ", ".join(f"{v:7.1f} us at {r}" for r, v in per_rows.items()))
        report[cls.name] = row
    with open(results_path("grammar-engines.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
