"""The engine end to end on a tiny random model with a real (trained) tokenizer: errors,
seeds, preemption, abort, streaming, stats."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, num_kv_blocks=128, block_size=4, max_model_len=128,
               max_num_batched_tokens=32)


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def texts(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("prompt, params, match", [
    ("", GREEDY, "empty"),
    ("word " * 120, GREEDY, r"maximum context length is 128 tokens. However, your prompt has \d+ tokens\. "),
    ("word " * 200, GREEDY, r"your prompt has 1000 characters, more than any prompt of 128 tokens"),
    ("hello", SamplingParams(max_tokens=125), r"context length is 128 tokens. However, you requested 1\d\d tokens \(\d+ in the messages, 125 in the completion\)"),
    ({"prompt_token_ids": [5, 9999]}, GREEDY, "outside the vocabulary"),
    ({"prompt_token_ids": "abc"}, GREEDY, "list of integers"),
    (12, GREEDY, "string or a dict"),
])
def test_bad_requests_raise_and_engine_keeps_working(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["a good prompt", prompt], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # the good one was not left queued
    outs = llm.generate(["The quick brown fox"], GREEDY, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 10


@pytest.mark.parametrize("kwargs", [dict(max_tokens=-1), dict(temperature=-1.0),
                                    dict(top_p=0.0), dict(top_p=1.01)])
def test_bad_sampling_params_raise(llm, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        llm.generate("hi", SamplingParams(**kwargs), use_tqdm=False)
    assert llm.generate("hi", GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_params_list_length_mismatch(llm):
    with pytest.raises(ValueError, match="2 prompts but 1 sampling_params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)


@pytest.mark.parametrize("prompts, params, match", [
    (None, GREEDY, "prompts must be"), (5, GREEDY, "prompts must be"),
    (b"hi", GREEDY, "prompts must be"), (["a"], [{"temperature": 0}], "SamplingParams objects"),
    (["caf\udce9"], GREEDY, "not valid UTF-8"),
])
def test_bad_api_arguments_are_value_errors(llm, prompts, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.generate([], GREEDY, use_tqdm=False) == []
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_with_invalid_text(llm):
    with pytest.raises(ValueError, match="not valid UTF-8"):
        llm.chat([{"role": "user", "content": "\ud800"}], GREEDY, use_tqdm=False)


def test_chat_without_a_template_needs_one_given(tmp_path):
    """A base model: chat says why it cannot; with chat_template= (vLLM's argument) it
    renders the conversation with the given template."""
    from _helpers import save_base_model

    base = LLM(save_base_model(tmp_path / "base"), num_kv_blocks=64, block_size=4)
    conv = [{"role": "user", "content": "a b c"}]
    with pytest.raises(ValueError, match="no chat template.*base model"):
        base.chat(conv, GREEDY, use_tqdm=False)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    out = base.chat(conv, GREEDY, use_tqdm=False, chat_template=template)[0]
    assert out.prompt == "[user] a b c\n"


def test_add_request_argument_types(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="request_id must be a string"):
        engine.add_request(5, "hi", GREEDY)
    with pytest.raises(ValueError, match="params must be SamplingParams"):
        engine.add_request("x", "hi", {"max_tokens": 2})
    assert not engine.has_unfinished_requests()


def test_generate_alongside_a_request_added_directly(llm):
    engine = llm.llm_engine
    engine.add_request("mine", "hello", SamplingParams(max_tokens=2, ignore_eos=True))
    outs = llm.generate("Write a poem", SamplingParams(max_tokens=20, ignore_eos=True),
                        use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 20  # not confused by "mine" finishing first
    assert not engine.has_unfinished_requests()


def test_generate_never_aborts_requests_it_does_not_own(llm):
    engine = llm.llm_engine
    nxt = engine.next_request_id()
    engine.add_request(str(int(nxt) + 1), "mine", SamplingParams(max_tokens=3, ignore_eos=True))
    llm.generate(["a", "b", "c"], GREEDY, use_tqdm=False)  # its ids skip the one in use
    with pytest.raises(ValueError, match="list of strings"):
        engine.abort_request(5)
    engine.abort_request(str(int(nxt) + 1))


def test_missing_model_path():
    with pytest.raises(FileNotFoundError, match="/no/such/model.gguf"):
        LLM("/no/such/model.gguf")


def test_bad_model_files(tmp_path, tiny_llama):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"not a model at all")
    with pytest.raises(ValueError, match="junk.gguf.*not a GGUF"):
        LLM(str(bad))
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 10)
    with pytest.raises(ValueError, match="trunc.gguf"):
        LLM(str(truncated))
    import json
    import shutil
    d = tmp_path / "gpt2"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json.*unsupported architecture.*GPT2"):
        LLM(str(d))
    d2 = tmp_path / "cut"
    shutil.copytree(tiny_llama, d2)
    st = d2 / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(d2))


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_kv_blocks=0), "num_kv_blocks must be a positive integer, got 0"),
    (dict(block_size=0), "block_size must be a positive integer"),
    (dict(block_size=100000), "block_size must be at most 1024"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(max_num_batched_tokens=-1), "max_num_batched"),
    (dict(max_model_len=0), "max_model_len"), (dict(kv_cache_memory=0.5), "kv_cache_memory"),
    (dict(device="mps"), "not supported; choose auto, cpu or cuda"),
    (dict(device="bogus"), "unknown device"), (dict(dtype="bogus"), "unknown dtype"),
    (dict(dtype=torch.float64), "not supported"), (dict(device=torch.device("meta")), "meta"),
    (dict(seed=2**64), "seed must be"), (dict(seed="x"), "seed must be"),
    (dict(tokenizer=5), "tokenizer must be a path"), (dict(kv_cache_dtype="int3"), "int3"),
    (dict(gpu_memory_utilization=0.9), "unknown engine option 'gpu_memory_utilization'"),
])
def test_bad_options_refused_before_loading(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM("/no/such/model/needed", **kwargs)  # refused before the path is even looked at


def test_a_missing_tokenizer_path_is_one_clear_error(tiny_llama, tmp_path):
    """A tokenizer path that does not exist is never looked up on a hub; a model directory
    without tokenizer files says so in one line."""
    with pytest.raises(ValueError, match="tokenizer path '/no/such/tok' does not exist"):
        LLM(tiny_llama, tokenizer="/no/such/tok")
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{tiny_llama}/{name}", bare / name)
    with pytest.raises(ValueError, match="needs tokenizer.json or tokenizer.model") as info:
        LLM(str(bare))
    assert "\n" not in str(info.value)


def test_kv_cache_larger_than_memory(tiny_llama):
    with pytest.raises(ValueError, match=r"needs \d+\.\d+ GiB but only .* available"):
        LLM(tiny_llama, kv_cache_memory=1 << 50)


def test_engine_options_validated(tiny_llama):
    with pytest.raises(ValueError, match="max_model_len=4096 exceeds the model's limit of 512"):
        LLM(tiny_llama, num_kv_blocks=8, max_model_len=4096)
    with pytest.raises(ValueError, match="needs 32 KV blocks but the cache has 8"):
        LLM(tiny_llama, num_kv_blocks=8, block_size=16, max_model_len=512)


def test_kv_cache_memory_sizes_blocks_and_logs(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        llm = LLM(tiny_llama, kv_cache_memory=1 << 20, block_size=16, dtype="float32")
    # tiny llama: 2 layers x 2 KV heads x 16 head_dim x 2 (K, V) x 4 bytes = 512 B/token
    assert llm.kv_cache_stats().num_blocks == (1 << 20) // (512 * 16) == 128
    log = caplog.text
    assert "512 bytes per token" in log and "128 blocks of 16 tokens" in log
    assert "capacity 2048 tokens" in log and "max concurrency 4.00x at max_model_len=512" in log


def test_seeded_request_alone_and_with_batch_mates(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], seeded, use_tqdm=False)
    mates = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in range(3, 10)]
    prompts = [f"prompt number {i} with text" for i in range(7)]
    batch = llm.generate(prompts[:4] + ["Once upon a time"] + prompts[4:],
                         mates[:4] + [seeded] + mates[4:], use_tqdm=False)
    assert batch[4].outputs[0].token_ids == alone[0].outputs[0].token_ids
    again = llm.generate(["Once upon a time"], seeded, use_tqdm=False)
    assert again[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    assert llm.generate(["Once upon a time"], other_seed, use_tqdm=False)[0].outputs[0].token_ids \
        != alone[0].outputs[0].token_ids


def test_preemption_gives_the_same_tokens(tiny_llama):
    prompts = [f"The little engine number {i} served" for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(tiny_llama, num_kv_blocks=256, block_size=4, max_model_len=64)
    ref = texts(roomy.generate(prompts, params, use_tqdm=False))
    assert roomy.kv_cache_stats().num_preemptions == 0
    tight = LLM(tiny_llama, num_kv_blocks=24, block_size=4, max_model_len=64)
    assert texts(tight.generate(prompts, params, use_tqdm=False)) == ref
    stats = tight.kv_cache_stats()
    assert stats.num_preemptions > 0 and stats.peak_used_blocks <= 24


def test_an_itl_target_chunks_arriving_prompts_and_keeps_the_tokens(tiny_llama):
    """A target no step can meet caps every step that decodes at MIN_PREFILL_TOKENS prompt
    tokens per decoding sequence's worth of waiting prompts (once the engine has timed a
    decode-only step and a prompt); the tokens equal an uncapped run's."""
    from pagedserve.core.scheduler import MIN_PREFILL_TOKENS

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[(17 * i + 5 * j) % 200 + 3 for j in range(100)] for i in range(3)]

    def run(target):
        engine = LLM(tiny_llama, num_kv_blocks=256, block_size=4, max_model_len=128,
                     itl_target_ms=target).llm_engine
        chunks, schedule = [], engine.scheduler.schedule

        def recording():
            out = schedule()
            chunks.append({s.request.request_id: n for s, n in out.scheduled})
            return out
        engine.scheduler.schedule = recording
        done = {}
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
            for _ in range(2):
                for out in engine.step():
                    done[out.request_id] = out.outputs[0].token_ids
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out.outputs[0].token_ids
        return done, chunks

    ref, ref_chunks = run(0.0)
    assert ref_chunks[2]["1"] == 100  # uncapped: the second prompt in one step
    got, chunks = run(1e-3)
    assert got == ref
    assert chunks[2] == chunks[3] == {"0": 1, "1": MIN_PREFILL_TOKENS}
    # two prompts being read beside one decoding sequence: twice the budget, first come first
    # served
    assert chunks[4] == {"0": 1, "1": 2 * MIN_PREFILL_TOKENS}


def test_abort_frees_blocks_and_engine_continues(llm):
    engine = llm.llm_engine
    engine.add_request("long", "Once upon a time", SamplingParams(max_tokens=100, ignore_eos=True))
    engine.add_request("waiting", "the quick", SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.kv_cache_stats().num_used_blocks > 0
    engine.abort_request(["long", "waiting", "unknown-id"])
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_stats().num_used_blocks == 0
    assert llm.generate("hi", GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_finish_reasons_and_stop_token_ids(llm):
    out = llm.generate("The quick brown", GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10
    stop_id = out.token_ids[3]
    first = out.token_ids.index(stop_id)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_id])
    out2 = llm.generate("The quick brown", params, use_tqdm=False)[0].outputs[0]
    assert out2.finish_reason == "stop" and out2.stop_reason == stop_id
    assert out2.token_ids == out.token_ids[: first + 1]


def test_min_tokens_masks_stop_tokens(llm):
    first = llm.generate("hi", GREEDY, use_tqdm=False)[0].outputs[0].token_ids[0]
    stop_now = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[first])
    assert llm.generate("hi", stop_now, use_tqdm=False)[0].outputs[0].token_ids == [first]
    held = SamplingParams(temperature=0, max_tokens=10, min_tokens=3, stop_token_ids=[first])
    out = llm.generate("hi", held, use_tqdm=False)[0].outputs[0]
    assert first not in out.token_ids[:3] and len(out.token_ids) >= 3


def test_logprobs_returned(llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
    c = llm.generate("The quick", params, use_tqdm=False)[0].outputs[0]
    assert len(c.logprobs) == 5
    total = 0.0
    for token, entry in zip(c.token_ids, c.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks rank 1
        assert len(entry) == 3 and all(lp.logprob <= 0 for lp in entry.values())
        total += entry[token].logprob
    assert c.cumulative_logprob == pytest.approx(total)


def test_streaming_deltas_concatenate_to_final(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("s", "Héllo 🙂", params)
    text, ids = "", []
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text
            ids += out.outputs[0].token_ids
    final = llm.generate("Héllo 🙂", SamplingParams(temperature=0.8, seed=3, max_tokens=30,
                                                     ignore_eos=True), use_tqdm=False)
    assert ids == final[0].outputs[0].token_ids and text == final[0].outputs[0].text


def test_chat_uses_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    assert out.prompt == "<s>user: hi</s><s>assistant:"
    with pytest.raises(ValueError, match="empty"):
        llm.chat([], GREEDY, use_tqdm=False)


def test_stats_and_continuous_batching(tiny_llama):
    llm = LLM(tiny_llama, num_kv_blocks=64, block_size=4, max_num_seqs=2, max_model_len=64)
    engine = llm.llm_engine
    for i, n in enumerate([3, 10, 10]):
        engine.add_request(str(i), f"prompt {i}", SamplingParams(max_tokens=n, ignore_eos=True))
    running_per_step = []
    while engine.has_unfinished_requests():
        finished = [o.request_id for o in engine.step() if o.finished]
        running_per_step.append(([r.request_id for r in engine.scheduler.running], finished))
    # when request 0 finishes, request 2 takes its place at the very next step
    step = next(i for i, (_, fin) in enumerate(running_per_step) if "0" in fin)
    assert running_per_step[step + 1][0] == ["1", "2"]
    stats = llm.kv_cache_stats()
    assert stats.num_used_blocks == 0 and stats.num_free_blocks + stats.num_cached_blocks == 64
    assert 0 < stats.peak_used_blocks <= 64
    assert 0.5 < stats.kv_token_utilization <= 1.0


def test_unreadable_tokenizer_cache_is_rebuilt(tmp_path, monkeypatch):
    from pagedserve.loader import gguf as gguf_loader

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    calls = []

    def fake_load(path, gguf_file=None):
        calls.append((str(path), gguf_file))
        if gguf_file is None:
            raise ValueError("broken json")
        return _SavingTokenizer()

    class _SavingTokenizer:
        def save_pretrained(self, path):
            calls.append(("saved", path))

    monkeypatch.setattr("pagedserve.tokenizer.load_tokenizer", fake_load)
    first = gguf_loader.load_gguf_tokenizer(model, tmp_path)  # builds and caches
    cached = Path(calls[-1][1])
    cached.mkdir(parents=True)
    (cached / "tokenizer_config.json").write_text("{broken")
    second = gguf_loader.load_gguf_tokenizer(model, tmp_path)  # cache unreadable: rebuilt
    assert isinstance(first, _SavingTokenizer) and isinstance(second, _SavingTokenizer)
    assert [c[1] for c in calls if c[0] != "saved"] == ["m.gguf", None, "m.gguf"]
