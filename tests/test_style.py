"""The code stays ruff-clean (the project's style rules are in pyproject.toml), and the benchmark
scripts run beside the libraries they use."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed by the test extra")
def test_ruff_clean():
    proc = subprocess.run(["ruff", "check", "src", "tests", "benchmarks"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_benchmark_scripts_do_not_shadow_what_libraries_import():
    """``python benchmarks/X.py`` puts benchmarks/ first on sys.path, so a script named like a
    package a library imports replaces it (a ``kernels.py`` once broke transformers' model
    configs, hence every tokenizer built from a GGUF, in every benchmark)."""
    proc = subprocess.run([sys.executable, "-c", "import transformers.activations, "
                           "transformers.models.llama.configuration_llama"],
                          cwd=ROOT / "benchmarks", capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
