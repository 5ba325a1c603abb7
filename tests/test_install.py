"""The Makefile's install: a script next to a clone named mixprec/ (the README's fresh-clone layout)
imports the real package, not the clone folder as an empty namespace package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = "import mixprec; print(mixprec.GradScaler.__name__, mixprec.initialize.__name__)"


def _run(cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # what a user's shell has
    (cwd / "probe.py").write_text(PROBE + "\n")
    return subprocess.run([sys.executable, "probe.py"], cwd=cwd, env=env, capture_output=True, text=True)


def test_a_script_beside_a_clone_named_mixprec_imports_the_package(tmp_path: Path) -> None:
    if _run(tmp_path).returncode != 0:
        pytest.skip("mixprec is not installed in this interpreter (only on PYTHONPATH): nothing to check")
    (tmp_path / "mixprec").mkdir()  # the clone's folder, as seen from its parent: no __init__.py
    out = _run(tmp_path)
    assert out.returncode == 0, out.stderr.strip().splitlines()[-1]
    assert out.stdout.split() == ["GradScaler", "initialize"]
