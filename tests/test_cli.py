"""The CLI on the tiny model: JSONL batches and clear errors."""

from __future__ import annotations

import argparse
import contextlib
import json

import pytest

from pagedserve.cli import build_parser, engine_kwargs, main, parse_bytes


def test_parse_bytes():
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1000") == 1000
    for bad in ("0.5b", "0", "4XB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)


def test_jsonl_batch(tiny_llama, tmp_path, capsys):
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join([
        json.dumps("Once upon a time"),
        json.dumps({"prompt": "The quick brown fox", "max_tokens": 3}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        json.dumps({"prompt_token_ids": [5, 6, 7], "max_tokens": 2}),
    ]) + "\n")
    dst = tmp_path / "out.jsonl"
    rc = main(["generate", "--input", str(src), "--output", str(dst), "--model", tiny_llama,
               "--max-tokens", "5", "--ignore-eos", "--no-chat", "--num-kv-blocks", "64"])
    assert rc == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["num_output_tokens"] for r in rows] == [5, 3, 4, 2]
    assert rows[2]["prompt"] == "<s>user: hi</s><s>assistant:"
    assert all(r["finish_reason"] == "length" for r in rows)


def test_stream_prompt(tiny_llama, capsys):
    rc = main(["generate", "Once upon a time", "--model", tiny_llama, "--max-tokens", "8",
               "--ignore-eos", "--num-kv-blocks", "64", "--temperature", "0.7", "--seed", "1"])
    assert rc == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("args, message", [
    (["generate", "hi", "--model", "/missing/model"], "does not exist"),
    (["generate", "hi", "--model", "gemma3-999b"],
     "does not exist; models fetched by name: SmolLM2-135M-Instruct, gemma3-270m"),
    (["generate", "hi", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate"], "either a PROMPT or --input"),
    (["generate", ""], "the prompt is empty"),
    (["generate", "hi", "--top-k", "0.5"], "invalid int value"),
    (["generate", "hi", "--kv-cache-memory", "1e999"], "not a size"),
    (["generate", "hi", "--num-kv-blocks", "0"], "num_kv_blocks must be a positive integer"),
    (["generate", "hi", "--device", "mps"], "not supported"),
    (["generate", "--input", "/no/such/prompts.jsonl"], "No such file"),
    (["generate", "--input", "/"], "Is a directory"),
])
def test_errors_are_one_line(args, message, capsys):
    parse_error = "invalid" in message or "not a size" in message  # argparse exits itself
    with pytest.raises(SystemExit) if parse_error else contextlib.nullcontext():
        assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("lines, message", [
    ([], "no prompts"),
    (['{"prompt": "a", "messages": []}'], ":1: give exactly one of"),
    (['"ok"', '{"prompt": ""}'], ":2: the prompt is empty"),
    (['"ok"', '{"prompt": "x", "logprobs": true}'], ":2: logprobs must be an integer"),
    (['"ok"', '{"prompt_token_ids": [1, 99999]}'], ":2: token id 99999 is outside"),
    (['{"prompt": 123}'], ":1: 'prompt' must be a string"),
    (['{"messages": "hi"}'], ":1: 'messages' must be a non-empty list"),
    (['{"prompt_token_ids": []}'], ":1: 'prompt_token_ids' must be a non-empty list"),
    (['"ok"', '{"messages": [{"role": "user", "content": "\\udce9"}]}'],
     ":2: the conversation is not valid UTF-8"),
])
def test_bad_jsonl_lines_are_named(tiny_llama, tmp_path, capsys, lines, message):
    src = tmp_path / "p.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    rc = main(["generate", "--input", str(src), "--output", str(out), "--model", tiny_llama,
               "--num-kv-blocks", "64", "--no-chat"])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_failed_run_leaves_existing_output_untouched(tmp_path, capsys):
    src = tmp_path / "p.jsonl"
    src.write_text('"hello"\n')
    out = tmp_path / "prev.jsonl"
    out.write_text("precious\n")
    assert main(["generate", "--input", str(src), "--output", str(out), "--model",
                 "/missing/model"]) == 2
    assert out.read_text() == "precious\n"
    assert main(["generate", "--input", str(src), "--output", str(src)]) == 2
    assert "is the input file" in capsys.readouterr().err
    assert src.read_text() == '"hello"\n'


def test_non_utf8_inputs(tmp_path, capsys):
    assert main(["generate", "caf\udce9"]) == 2  # how Python passes the bytes caf\xe9
    assert "not valid UTF-8" in capsys.readouterr().err
    src = tmp_path / "p.jsonl"
    src.write_bytes(b'"caf\xe9"\n')
    assert main(["generate", "--input", str(src)]) == 2
    assert "p.jsonl: not UTF-8 text" in capsys.readouterr().err


def test_logprobs_in_jsonl_output(tiny_llama, tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "hello", "logprobs": 2, "max_tokens": 3, "prompt_logprobs": 1}\n'
                   '{"prompt": "hello", "max_tokens": 1}\n')
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--input", str(src), "--output", str(out), "--model", tiny_llama,
                 "--num-kv-blocks", "64", "--no-chat", "--ignore-eos"]) == 0
    row, plain = map(json.loads, out.read_text().splitlines())
    assert len(row["logprobs"]) == 3 and all(2 <= len(e) <= 3 for e in row["logprobs"])
    assert row["prompt_logprobs"][0] is None
    assert len(row["prompt_logprobs"]) == row["num_prompt_tokens"]
    assert all(1 <= len(e) <= 2 for e in row["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in plain


def test_unwritable_output_refused_before_loading(tmp_path, capsys):
    src = tmp_path / "p.jsonl"
    src.write_text('"hello"\n')
    rc = main(["generate", "--input", str(src), "--output", str(tmp_path),
               "--model", "/never/loaded"])
    assert rc == 2 and "is a directory" in capsys.readouterr().err


def test_bad_jsonl_line_is_named(tiny_llama, tmp_path, capsys):
    src = tmp_path / "p.jsonl"
    src.write_text('"fine"\n{"prompt": "x", "top_p": 7}\n')
    rc = main(["generate", "--input", str(src), "--model", tiny_llama, "--num-kv-blocks", "64"])
    assert rc == 2
    assert "p.jsonl:2: top_p must be in (0, 1]" in capsys.readouterr().err


def test_n_and_kv_flags_in_jsonl_batch(tiny_llama, tmp_path):
    """n > 1 lines write every completion; the KV management flags reach the engine."""
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "hello there", "n": 3, "temperature": 1.0, "seed": 4}\n'
                   '{"prompt": "hello there", "max_tokens": 2}\n')
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--input", str(src), "--output", str(out), "--model", tiny_llama,
                 "--num-kv-blocks", "24", "--block-size", "4", "--no-chat", "--ignore-eos",
                 "--max-tokens", "20", "--preemption-mode", "swap", "--swap-space", "0.01",
                 "--no-enable-prefix-caching"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [len(c["token_ids"]) for c in rows[0]["outputs"]] == [20, 20, 20]
    assert rows[0]["text"] == rows[0]["outputs"][0]["text"]
    assert len({c["text"] for c in rows[0]["outputs"]}) > 1
    assert "outputs" not in rows[1] and rows[1]["num_cached_tokens"] == 0
    parser = build_parser()
    kwargs = engine_kwargs(parser.parse_args(["generate", "x", "--preemption-mode", "swap",
                                              "--swap-space", "0.5", "--no-enable-prefix-caching"]))
    assert (kwargs["preemption_mode"], kwargs["swap_space"]) == ("swap", 0.5)
    assert kwargs["enable_prefix_caching"] is False


@pytest.mark.parametrize("flag, value, message", [
    ("--preemption-mode", "drop", "invalid choice"),
    ("--swap-space", "-1", "swap_space"),
])
def test_bad_kv_flags(flag, value, message, capsys):
    parse_error = message.startswith("invalid")
    with pytest.raises(SystemExit) if parse_error else contextlib.nullcontext():
        assert main(["generate", "hi", flag, value, "--model", "/missing"]) == 2
    assert message in capsys.readouterr().err


def test_jsonl_cache_salt(tiny_llama, tmp_path, capsys):
    src = tmp_path / "p.jsonl"
    line = {"prompt_token_ids": list(range(5, 30)), "max_tokens": 2}
    src.write_text("\n".join(json.dumps(x) for x in [
        line, line, {**line, "cache_salt": "tenant-b"}]) + "\n")
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--input", str(src), "--output", str(out), "--model", tiny_llama,
                 "--num-kv-blocks", "64", "--block-size", "4", "--max-num-seqs", "1"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["num_cached_tokens"] for r in rows] == [0, 24, 0]
    src.write_text(json.dumps({**line, "cache_salt": 5}) + "\n")
    assert main(["generate", "--input", str(src), "--model", tiny_llama]) == 2
    assert "cache_salt must be a string" in capsys.readouterr().err


def test_bench_runs_a_benchmark_script(capsys):
    assert main(["bench", "roofline", "--help"]) == 0
    assert "matmul rate of this CPU" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    assert main(["bench", "throughput", "--num-requests", "x"]) == 2  # its own argparse error
    assert "throughput benchmark exited with 2" in capsys.readouterr().err
    for flags in (["--batches", "8", "0"], ["--decode-tokens", "0"], ["--prompt-len", "-3"],
                  ["--rounds", "0"]):  # argparse errors before the model loads
        assert main(["bench", "roofline", *flags]) == 2
        assert "must be at least 1" in capsys.readouterr().err
    assert main(["bench", "roofline", "--json", "/nonexistent/dir/x.json"]) == 2
    assert "--json: no directory" in capsys.readouterr().err


def test_bench_roofline_refuses_batches_beyond_its_kv_cache(tiny_llama, capsys):
    assert main(["bench", "roofline", "--model", tiny_llama, "--batches", "100000"]) == 2
    assert "the 2 GiB cache holds" in capsys.readouterr().err


def test_the_console_script_exits_once_it_has_printed(tiny_llama):
    """``pagedserve`` (cli.run) ends right after the answer, skipping the interpreter's
    second-long teardown of torch; piped into a reader that stops early, it still exits 0."""
    import shutil
    import subprocess

    exe = shutil.which("pagedserve")
    assert exe is not None
    cmd = [exe, "generate", "Once upon a time", "--model", tiny_llama, "--max-tokens", "200",
           "--ignore-eos", "--no-chat"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout.read(1)  # the first character arrived, then the reader goes away
    proc.stdout.close()
    assert proc.wait(timeout=60) == 0
    # the answer is flushed before the immediate exit
    done = subprocess.run(cmd[:5] + ["--max-tokens", "4", "--no-chat"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip()
