"""The ``pagedserve`` command: ``pagedserve generate PROMPT`` streams an answer to the terminal;
``pagedserve generate --input prompts.jsonl --output out.jsonl`` runs a batch.

Bad input (a bad option value, a missing model, a malformed JSONL line) ends with one line
``error: ...`` on stderr and exit status 2, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MB', '1e9' or a plain number of bytes -> int."""
    m = re.fullmatch(r"\s*([0-9.e+]+)\s*([kmg]i?b|b)?\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4GiB, 512MB)")
    try:
        return int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The LLM/LLMEngine options as flags (vLLM's flag names)."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="GGUF file or HF directory (default: SmolLM2-135M-Instruct, fetched once)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV cache size, e.g. 2GiB (default: a share of free memory)")
    g.add_argument("--num-kv-blocks", type=int, default=None)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
                block_size=args.block_size, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
                seed=args.seed if args.seed is not None else 0)


def _sampling_fields(args: argparse.Namespace) -> dict[str, Any]:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop or None,
                ignore_eos=args.ignore_eos, repetition_penalty=args.repetition_penalty)


def _use_chat(args: argparse.Namespace, tokenizer: Any) -> bool:
    if args.chat is not None:
        return args.chat
    return getattr(tokenizer, "chat_template", None) is not None


def _stream_one(llm, args: argparse.Namespace) -> None:
    from pagedserve.sampling_params import RequestOutputKind, SamplingParams
    from pagedserve.tokenizer import apply_chat_template

    engine = llm.llm_engine
    params = SamplingParams(**_sampling_fields(args), output_kind=RequestOutputKind.DELTA)
    prompt: Any = args.prompt
    if _use_chat(args, engine.tokenizer):
        text, ids = apply_chat_template(engine.tokenizer, [{"role": "user", "content": prompt}])
        prompt = {"prompt": text, "prompt_token_ids": ids}
    rid = engine.next_request_id()
    engine.add_request(rid, prompt, params)
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                sys.stdout.write(out.outputs[0].text)
                sys.stdout.flush()
    finally:
        engine.abort_request(rid)
    sys.stdout.write("\n")


def _read_jsonl(path: str, args: argparse.Namespace, tokenizer: Any):
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.tokenizer import apply_chat_template

    prompts, params = [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                if isinstance(item, str):
                    item = {"prompt": item}
                if not isinstance(item, dict):
                    raise ValueError("expected a JSON string or object")
                fields = {**_sampling_fields(args),
                          **{k: v for k, v in item.items()
                             if k not in ("prompt", "messages", "prompt_token_ids")}}
                params.append(SamplingParams(**fields))
                if "messages" in item:
                    text, ids = apply_chat_template(tokenizer, item["messages"])
                    prompts.append({"prompt": text, "prompt_token_ids": ids})
                elif "prompt_token_ids" in item:
                    prompts.append({"prompt_token_ids": item["prompt_token_ids"]})
                elif "prompt" in item:
                    prompt = item["prompt"]
                    if _use_chat(args, tokenizer) and isinstance(prompt, str):
                        text, ids = apply_chat_template(tokenizer,
                                                        [{"role": "user", "content": prompt}])
                        prompts.append({"prompt": text, "prompt_token_ids": ids})
                    else:
                        prompts.append(prompt)
                else:
                    raise ValueError("needs 'prompt', 'messages' or 'prompt_token_ids'")
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from e
    return prompts, params


def _run_batch(llm, args: argparse.Namespace) -> None:
    prompts, params = _read_jsonl(args.input, args, llm.get_tokenizer())
    outputs = llm.generate(prompts, params, use_tqdm=True)
    sink = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    try:
        for i, out in enumerate(outputs):
            c = out.outputs[0]
            sink.write(json.dumps({
                "index": i, "prompt": out.prompt, "text": c.text,
                "finish_reason": c.finish_reason, "num_prompt_tokens": len(out.prompt_token_ids),
                "num_output_tokens": len(c.token_ids), "token_ids": c.token_ids,
            }, ensure_ascii=False) + "\n")
    finally:
        if sink is not sys.stdout:
            sink.close()


def cmd_generate(args: argparse.Namespace) -> None:
    if (args.prompt is None) == (args.input is None):
        raise ValueError("give either a PROMPT or --input prompts.jsonl")
    if args.output and not args.input:
        raise ValueError("--output goes with --input")
    from pagedserve.engine import LLM
    from pagedserve.sampling_params import SamplingParams

    SamplingParams(**_sampling_fields(args))  # refuse bad flags before loading the model
    llm = LLM(**engine_kwargs(args))
    if args.input:
        _run_batch(llm, args)
    else:
        _stream_one(llm, args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve",
                                     description="LLM inference on a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt (streamed) or a JSONL batch")
    g.add_argument("prompt", nargs="?", help="the prompt (omit with --input)")
    g.add_argument("--input", help="JSONL file: one prompt string or object per line")
    g.add_argument("--output", help="JSONL results (default: stdout)")
    chat = g.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="apply the chat template (default when the model has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false",
                      help="send the prompt as raw text")
    s = g.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=256)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--stop", action="append", help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--seed", type=int, default=None, help="seed of the request and the engine")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
