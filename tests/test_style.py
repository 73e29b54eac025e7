"""The code stays ruff-clean (the project's style rules are in pyproject.toml)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is installed by the test extra")
def test_ruff_clean():
    proc = subprocess.run(["ruff", "check", "src", "tests", "benchmarks"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
