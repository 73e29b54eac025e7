"""The CLI on the tiny model: JSONL batches and clear errors."""

from __future__ import annotations

import json

import pytest

from pagedserve.cli import main, parse_bytes


def test_parse_bytes():
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1000") == 1000


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
    (["generate", "hi", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate"], "either a PROMPT or --input"),
])
def test_errors_are_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bad_jsonl_line_is_named(tiny_llama, tmp_path, capsys):
    src = tmp_path / "p.jsonl"
    src.write_text('"fine"\n{"prompt": "x", "top_p": 7}\n')
    rc = main(["generate", "--input", str(src), "--model", tiny_llama, "--num-kv-blocks", "64"])
    assert rc == 2
    assert "p.jsonl:2: top_p must be in (0, 1]" in capsys.readouterr().err
