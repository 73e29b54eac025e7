"""The ``pagedserve`` command: ``pagedserve generate PROMPT`` streams an answer to the terminal;
``pagedserve serve`` runs the OpenAI-compatible HTTP server;
``pagedserve generate --input prompts.jsonl --output out.jsonl`` runs a batch;
``pagedserve plan`` sizes a deployment; ``pagedserve bench NAME [ARGS]`` runs a benchmark
script of the source checkout (``benchmarks/``).

Bad input (a bad option value, a missing model, a malformed JSONL line) ends with one line
``error: ...`` on stderr and exit status 2, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from pagedserve import __version__
from pagedserve.planner import PLAN_KV_CACHE_DTYPES, PRESETS
from pagedserve.sampling_params import RequestOutputKind

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MB', '1e9' or a plain number of bytes -> int."""
    m = re.fullmatch(r"\s*([0-9.e+]+)\s*([kmg]i?b|b)?\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4GiB, 512MB)")
    try:
        value = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a size of at least 1 byte: {text!r}")
    return value


def parse_json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every EngineArgs option as a flag (vLLM's flag names), with its help and default."""
    from pagedserve.config import fields_by_name

    g = p.add_argument_group("engine")
    for name, f in fields_by_name().items():
        if name == "seed":  # generate and serve declare --seed themselves
            continue
        meta = f.metadata
        kwargs: dict[str, Any] = dict(default=f.default, help=meta["help"])
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        if isinstance(f.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif meta.get("parse") == "bytes":
            kwargs["type"] = parse_bytes
        elif meta.get("parse") == "json":
            kwargs["type"] = parse_json_object
        elif f.type.startswith(("int", "float")):
            kwargs["type"] = int if f.type.startswith("int") else float
        g.add_argument(f"--{name.replace('_', '-')}", *meta.get("aliases", ()), **kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineArgs options of parsed flags (the engine's seed is 0 unless --seed)."""
    from pagedserve.config import fields_by_name

    kwargs = {name: getattr(args, name) for name in fields_by_name() if name != "seed"}
    return {**kwargs, "seed": args.seed if args.seed is not None else 0}


def _sampling_fields(args: argparse.Namespace) -> dict[str, Any]:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop or None,
                ignore_eos=args.ignore_eos, repetition_penalty=args.repetition_penalty,
                presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, min_tokens=args.min_tokens)


def _use_chat(args: argparse.Namespace, tokenizer: Any) -> bool:
    if args.chat is not None:
        return args.chat
    return getattr(tokenizer, "chat_template", None) is not None


def _stream_one(llm, args: argparse.Namespace) -> None:
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.tokenizer import apply_chat_template

    engine = llm.llm_engine
    params = SamplingParams(**_sampling_fields(args), output_kind=RequestOutputKind.DELTA)
    prompt: Any = args.prompt
    if _use_chat(args, engine.tokenizer):
        text, ids = apply_chat_template(engine.tokenizer, [{"role": "user", "content": prompt}])
        prompt = {"prompt": text, "prompt_token_ids": ids}
    rid = engine.next_request_id()
    engine.add_request(rid, prompt, params)
    error = None
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                sys.stdout.write(out.outputs[0].text)
                sys.stdout.flush()
                error = out.error or error
    finally:
        engine.abort_request(rid)
    sys.stdout.write("\n")
    if error is not None:
        raise RuntimeError(f"the request failed: {error}")


_PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")


def _check_prompt_field(key: str, value: Any) -> None:
    """The shape of a JSONL line's prompt field. Raises ValueError."""
    from pagedserve.tokenizer import check_text

    if key == "prompt":
        if not isinstance(value, str):
            raise ValueError(f"'prompt' must be a string, got {type(value).__name__}")
        if not value:
            raise ValueError("the prompt is empty")
        check_text(value)
    elif key == "messages":
        if not isinstance(value, list) or not value:
            raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    elif not isinstance(value, list) or not value:
        raise ValueError("'prompt_token_ids' must be a non-empty list of integers")


def _parse_jsonl(path: str, args: argparse.Namespace) -> list[tuple[int, dict, Any]]:
    """(line number, prompt fields, SamplingParams) per line, checked before the model loads.
    Raises ValueError naming ``path:line`` for a bad line, and for a file with no prompts."""
    from pagedserve.sampling_params import SamplingParams

    rows = []
    try:
        lines = Path(path).read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if isinstance(item, str):
                item = {"prompt": item}
            if not isinstance(item, dict):
                raise ValueError("expected a JSON string or object")
            keys = [k for k in _PROMPT_KEYS if k in item]
            if len(keys) != 1:
                raise ValueError("give exactly one of 'prompt', 'messages', 'prompt_token_ids'")
            _check_prompt_field(keys[0], item[keys[0]])
            fields = {**_sampling_fields(args), **{k: v for k, v in item.items()
                                                   if k not in _PROMPT_KEYS + ("cache_salt",)}}
            prompt = {keys[0]: item[keys[0]]}
            if "cache_salt" in item:
                if not isinstance(item["cache_salt"], str):
                    raise ValueError(f"cache_salt must be a string, got {item['cache_salt']!r}")
                prompt["cache_salt"] = item["cache_salt"]
            rows.append((lineno, prompt, SamplingParams(**fields)))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: {e}") from e
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def _to_prompt(item: dict, args: argparse.Namespace, tokenizer: Any) -> Any:
    """A JSONL prompt as the engine takes it, with the chat template where it applies."""
    from pagedserve.tokenizer import apply_chat_template

    messages = item.get("messages")
    if messages is None and "prompt" in item and _use_chat(args, tokenizer):
        messages = [{"role": "user", "content": item["prompt"]}]
    salt = {"cache_salt": item["cache_salt"]} if "cache_salt" in item else {}
    if messages is not None:
        text, ids = apply_chat_template(tokenizer, messages)
        return {"prompt": text, "prompt_token_ids": ids, **salt}
    if "prompt" in item:
        return {"prompt": item["prompt"], **salt}
    return item


def _run_batch(llm, args: argparse.Namespace, rows) -> None:
    """Add every line's request, then step; results are written in input order as soon as
    all earlier ones are done, so an interrupted run keeps what finished. The output file is
    opened only once every request is accepted."""
    from tqdm.auto import tqdm

    engine = llm.llm_engine
    ids: list[str] = []
    sink = sys.stdout
    try:
        for lineno, item, params in rows:
            try:
                prompt = _to_prompt(item, args, engine.tokenizer)
                rid = engine.next_request_id()
                engine.add_request(rid, prompt, replace(params,
                                                        output_kind=RequestOutputKind.FINAL_ONLY))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{args.input}:{lineno}: {e}") from e
            ids.append(rid)
        if args.output:
            sink = open(args.output, "w", encoding="utf-8")
        done: dict[str, Any] = {}
        written = 0
        with tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True) as bar:
            while written < len(ids):
                for out in engine.step():
                    done[out.request_id] = out
                    bar.update(1)
                while written < len(ids) and ids[written] in done:
                    sink.write(json.dumps(_row(written, done.pop(ids[written])),
                                          ensure_ascii=False) + "\n")
                    sink.flush()
                    written += 1
    finally:
        engine.abort_request(ids)
        if sink is not sys.stdout:
            sink.close()


def _row(index: int, out) -> dict[str, Any]:
    """One JSONL result: the first completion's fields at top level; with n > 1 every
    completion also under "outputs", in index order."""
    row = {"index": index, "prompt": out.prompt, **_completion_fields(out.outputs[0]),
           "num_prompt_tokens": len(out.prompt_token_ids),
           "num_cached_tokens": out.num_cached_tokens}
    if out.prompt_logprobs is not None:
        row["prompt_logprobs"] = [None if entry is None else
                                  {str(t): lp.logprob for t, lp in entry.items()}
                                  for entry in out.prompt_logprobs]
    if len(out.outputs) > 1:
        row["outputs"] = [_completion_fields(c) for c in out.outputs]
    return row


def _completion_fields(c) -> dict[str, Any]:
    return {"text": c.text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            "num_output_tokens": len(c.token_ids), "token_ids": c.token_ids,
            **({"logprobs": [{str(t): lp.logprob for t, lp in entry.items()}
                             for entry in c.logprobs]} if c.logprobs is not None else {})}


def cmd_generate(args: argparse.Namespace) -> None:
    if (args.prompt is None) == (args.input is None):
        raise ValueError("give either a PROMPT or --input prompts.jsonl")
    if args.output and not args.input:
        raise ValueError("--output goes with --input")
    if args.prompt == "":
        raise ValueError("the prompt is empty")
    from pagedserve.llm import LLM
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.tokenizer import check_text

    # Refuse bad flags, lines and paths before spending seconds on loading the model.
    check_text(args.prompt or "")
    SamplingParams(**_sampling_fields(args))
    rows = _parse_jsonl(args.input, args) if args.input else None
    if args.output:
        _check_writable(Path(args.output), Path(args.input))
    llm = LLM(**engine_kwargs(args))
    try:
        if rows is not None:
            _run_batch(llm, args, rows)
        else:
            _stream_one(llm, args)
    finally:
        llm.llm_engine.shutdown()  # tensor-parallel workers stop before the process ends


def _check_writable(out: Path, src: Path) -> None:
    """Refuse an --output that cannot be written (or is the input) without touching it."""
    if out.exists() and src.exists() and out.samefile(src):
        raise ValueError(f"--output {out} is the input file")
    if out.is_dir():
        raise ValueError(f"--output {out} is a directory")
    target = out if out.exists() else out.parent
    if not target.exists() or not os.access(target, os.W_OK):
        raise ValueError(f"--output {out}: cannot write there")


class _HelpFormatter(argparse.HelpFormatter):
    """Every flag's default in ``--help``, where it has one and its help does not state it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, argparse.SUPPRESS) and "default" not in text \
                and action.option_strings:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``error: ...``, exit status 2) and every flag's default
    in ``--help``."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def served_model_name(model_path: Any) -> str:
    """The default model name clients send: the file or directory name without .gguf."""
    name = Path(str(model_path)).name
    if name.endswith(".gguf"):
        name = name[: -len(".gguf")]
    return name


def cmd_serve(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_num_waiting is not None and args.max_num_waiting < 0:
        raise ValueError(f"--max-num-waiting must be >= 0, got {args.max_num_waiting}")
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be positive, got {args.max_body_bytes}")
    from pagedserve import envs

    api_key = args.api_key if args.api_key is not None else envs.api_key()
    if api_key == "":
        raise ValueError("the API key is empty")
    if args.served_model_name == "":
        raise ValueError("--served-model-name is empty")
    from pagedserve.server.tool_parsers import get_tool_parser

    get_tool_parser(args.tool_call_parser)  # a bad name fails before the model loads
    from pagedserve.engine import LLMEngine
    from pagedserve.loader.fetched import DEFAULT_MODEL_NAME, MODELS
    from pagedserve.server import run_server

    engine = LLMEngine(**engine_kwargs(args))
    # a model fetched by name is served under that name, a file under its stem
    name = args.served_model_name or (
        DEFAULT_MODEL_NAME if args.model is None
        else args.model if args.model in MODELS else served_model_name(engine.model_path))
    try:
        run_server(engine, name,
                   host=args.host, port=args.port, api_key=api_key,
                   max_num_waiting=args.max_num_waiting, max_body_bytes=args.max_body_bytes,
                   log_level=args.log_level, tool_call_parser=args.tool_call_parser)
    finally:
        engine.shutdown()


def parse_memory(text: str) -> int:
    """A memory size with an explicit unit: '80GB' (10**9 bytes) or '80GiB' (2**30 bytes)."""
    m = re.fullmatch(r"\s*([0-9.e+]+)\s*(gb|gib|mb|mib|tb|tib)\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(
            f"not a memory size with a unit: {text!r} (examples: 80GB, 24GiB, 512MiB)")
    units = {**_UNITS, "tb": 10**12, "tib": 2**40}
    try:
        value = int(float(m.group(1)) * units[m.group(2)])
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r}") from None
    return value


def cmd_plan(args: argparse.Namespace) -> None:
    from pagedserve import planner

    shape_flags = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                   "vocab_size", "intermediate_size")
    given = {f: getattr(args, f) for f in shape_flags if getattr(args, f) is not None}
    if args.model is not None and given:
        raise ValueError("give --model or the shape flags, not both")
    if args.model is not None:
        shape = planner.load_shape(args.model)
    elif given:
        missing = [f"--{f.replace('_', '-')}" for f in shape_flags[:4] + shape_flags[5:]
                   if f not in given]
        if missing:
            raise ValueError(f"the shape flags miss {', '.join(missing)}")
        heads = given["num_heads"]
        shape = planner.ModelShape(
            "custom", given["num_layers"], given["hidden_size"], heads,
            given.get("num_kv_heads", heads),
            given.get("head_dim") or given["hidden_size"] // heads, given["vocab_size"],
            given["intermediate_size"])
    else:
        raise ValueError("give --model (a preset, an HF directory or a .gguf file) or the "
                         "shape flags")
    kwargs = dict(weights_dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                  overhead_bytes=args.overhead or 0, avg_tokens=args.avg_tokens,
                  max_model_len=args.max_model_len, block_size=args.block_size,
                  tensor_parallel_size=args.tensor_parallel_size,
                  weight_bytes=args.weight_bytes)
    rows = planner.levers(shape, args.memory, shared_prefix_tokens=args.shared_prefix_tokens,
                          num_sharing=args.num_sharing, max_model_len_cap=args.max_model_len_cap,
                          **kwargs)
    plan = rows[0][1]
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib: pip install 'pagedserve[plot]'")
        out = Path(args.plot)
        if out.suffix.lower() not in (".png", ".svg", ".pdf"):
            raise ValueError(f"--plot needs a file name ending in .png, .svg or .pdf, "
                             f"got {args.plot!r}")
        if not out.parent.is_dir():
            raise ValueError(f"--plot: no such directory {str(out.parent)!r}")
    print(planner.to_json(plan, rows) if args.json else planner.render(plan, rows))
    if args.plot:
        planner.plot(shape, args.memory, args.plot,
                     shared_prefix_tokens=args.shared_prefix_tokens,
                     num_sharing=args.num_sharing,
                     **{k: v for k, v in kwargs.items() if k != "avg_tokens"})
        if not args.json:
            print(f"\nplot: {args.plot}")


BENCHMARKS = {"throughput": "throughput.py", "serve": "serving.py", "prefix": "prefix_sharing.py",
              "sharing": "sharing.py", "kv-util": "kv_utilization.py", "kv-quant": "kv_quant.py",
              "roofline": "roofline.py", "kernels": "fused_kernels.py", "dtype": "dtype_choice.py",
              "structured": "structured_outputs.py", "speculative": "speculative.py",
              "serve-peers": "serving_peers.py", "shared-cores": "shared_cores.py",
              "long-prompt": "long_prompt_latency.py"}


def benchmarks_dir() -> Path:
    """The source checkout's ``benchmarks/`` (the package lives in ``src/pagedserve``)."""
    return Path(__file__).resolve().parents[2] / "benchmarks"


def cmd_bench(args: argparse.Namespace) -> None:
    import runpy

    script = benchmarks_dir() / BENCHMARKS[args.name]
    if not script.is_file():
        raise ValueError(f"{script} not found: the benchmarks ship with the source checkout "
                         "(git clone, then pip install -e .), not with the wheel")
    saved = sys.argv, list(sys.path)
    sys.argv = [str(script), *args.args]
    sys.path.insert(0, str(script.parent))  # the scripts import their neighbours
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise RuntimeError(f"{args.name} benchmark exited with {e.code}") from None
    finally:
        sys.argv, sys.path[:] = saved


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pagedserve", description="LLM inference on a paged KV cache")
    parser.add_argument("--version", action="version", version=f"pagedserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate text for one prompt (streamed) or a JSONL batch")
    g.add_argument("prompt", nargs="?", help="the prompt (omit with --input)")
    g.add_argument("--input", help="JSONL file: one prompt string or object per line")
    g.add_argument("--output", help="JSONL results (default: stdout)")
    chat = g.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="apply the chat template (the default when the model has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", default=None,
                      help="send the prompt as raw text")
    s = g.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    s.add_argument("--top-k", type=int, default=0, help="0 or -1: all tokens")
    s.add_argument("--min-p", type=float, default=0.0, help="in [0, 1]")
    s.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    s.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]")
    s.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]")
    s.add_argument("--min-tokens", type=int, default=0, help="EOS is masked until then")
    s.add_argument("--stop", action="append", help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="generate past EOS")
    s.add_argument("--seed", type=int, default=None,
                   help="seed of the request and the engine (default: unseeded request, "
                        "engine seed 0)")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    v = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on")
    v.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    v.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model file's name)")
    v.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and "
                        "/metrics "
                        "(default: $PAGEDSERVE_API_KEY, else no auth)")
    v.add_argument("--max-num-waiting", type=int, default=None,
                   help="answer 429 when this many requests already wait (default: no limit)")
    v.add_argument("--max-body-bytes", type=parse_bytes, default=None,
                   help="largest request body (default 16MiB)")
    v.add_argument("--seed", type=int, default=None,
                   help="the seed unseeded requests share (default: 0)")
    v.add_argument("--tool-call-parser", default="smollm2",
                   help="the model's tool-call format (smollm2, hermes), parsed for "
                        "tool_choice 'auto' and forced for 'required' or a named function "
                        "(default: smollm2)")
    v.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility: tool_choice 'auto' is always on")
    v.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (info logs every request)")
    add_engine_args(v)
    v.set_defaults(func=cmd_serve)

    pl = sub.add_parser("plan", help="KV-cache capacity planning for a model on an accelerator")
    pl.add_argument("--model", default=None,
                    help=f"a preset ({', '.join(PRESETS)}), an HF directory or a .gguf file")
    pl.add_argument("--memory", type=parse_memory, required=True,
                    help="accelerator memory per worker with its unit: 80GB or 80GiB")
    pl.add_argument("--dtype", default="bf16", help="weights dtype (fp32, fp16, bf16, int8, "
                                                    "fp8, int4)")
    pl.add_argument("--kv-cache-dtype", default="auto", choices=PLAN_KV_CACHE_DTYPES,
                    help="KV cache storage (default: the weights' dtype); fp8 and int8 add a "
                         "2-byte scale per token and KV head")
    pl.add_argument("--weight-bytes", type=parse_memory, default=None,
                    help="the weights' size, if known (default: from the parameter count)")
    pl.add_argument("--overhead", type=parse_memory, default=None,
                    help="activation and runtime overhead per worker (default 0)")
    pl.add_argument("--avg-tokens", type=int, default=2000,
                    help="average tokens (prompt + output) per request")
    pl.add_argument("--max-model-len", type=int, default=None,
                    help="default: the model's context length")
    pl.add_argument("--max-model-len-cap", type=int, default=None,
                    help="show the lever of capping max_model_len at this length")
    pl.add_argument("--block-size", type=int, default=None,
                    help="default 16, or 32 for a quantized KV cache (as the engine)")
    pl.add_argument("--shared-prefix-tokens", type=int, default=0)
    pl.add_argument("--num-sharing", type=int, default=1,
                    help="requests that share the prefix")
    pl.add_argument("--tensor-parallel-size", type=int, default=1)
    for flag in ("num-layers", "hidden-size", "num-heads", "num-kv-heads", "head-dim",
                 "vocab-size", "intermediate-size"):
        pl.add_argument(f"--{flag}", type=int, default=None, help="raw shape (without --model)")
    pl.add_argument("--json", action="store_true", help="the figures as JSON")
    pl.add_argument("--plot", default=None, help="save concurrency vs context length (PNG)")
    pl.set_defaults(func=cmd_plan)

    b = sub.add_parser("bench", help="run a benchmark (pagedserve bench NAME --help)",
                       description="Runs benchmarks/NAME of the source checkout with ARGS: "
                       + ", ".join(f"{k} ({v})" for k, v in BENCHMARKS.items()))
    b.add_argument("name", choices=tuple(BENCHMARKS))
    b.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    b.set_defaults(func=cmd_bench)

    w = sub.add_parser("worker", help="a tensor-parallel worker (rank > 0) for another host",
                       description="Joins the tensor-parallel group described by MASTER_ADDR, "
                       "MASTER_PORT, RANK and WORLD_SIZE, takes the engine's options from rank "
                       "0 and runs its shard until rank 0 stops (docs/tensor-parallel.md).")
    w.set_defaults(func=cmd_worker)
    return parser


def cmd_worker(args: argparse.Namespace) -> None:
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
               if k not in os.environ]
    if missing:
        raise ValueError(f"pagedserve worker needs {', '.join(missing)} in the environment")
    try:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise ValueError(f"pagedserve worker: RANK={os.environ['RANK']!r} and WORLD_SIZE="
                         f"{os.environ['WORLD_SIZE']!r} must be integers") from None
    if not 0 < rank < world_size:
        raise ValueError(f"pagedserve worker: RANK={rank} must be between 1 and WORLD_SIZE - 1 "
                         f"= {world_size - 1} (rank 0 is the engine)")
    from pagedserve.distributed.executor import worker_main

    worker_main()  # ends the process


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except BrokenPipeError:  # e.g. piped into `head` (before OSError, its base class)
        sys.stderr.close()
        return 0
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def run() -> None:
    """The ``pagedserve`` console script: ``main``, then an immediate exit. Every command has
    released what it holds by then (the engine's workers stopped, files closed), and the
    interpreter's own teardown of torch and the tokenizer takes about a second after the
    answer was printed."""
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (e.g. `| head`)
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
