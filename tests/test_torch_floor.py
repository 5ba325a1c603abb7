"""The torch floor (mixprec/torch_floor.py): the version rule, pyproject's requirement kept equal to it, the
ImportError an older torch gets on ``import mixprec``, and the Makefile's check before it installs one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixprec import torch_floor

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("version", "expected"), [("2.13.0+cpu", (2, 13)), ("2.11.0a0+git1a2b3c", (2, 11)),
                                                   ("2.10.1", (2, 10)), ("3.0.0", (3, 0))])
def test_the_release_is_read_from_any_torch_version_string(version: str, expected: tuple[int, int]) -> None:
    assert torch_floor.release(version) == expected


def test_older_releases_are_refused_with_the_fix_and_this_one_is_not() -> None:
    assert torch_floor.too_old(torch.__version__) is None  # the suite runs: so does mixprec
    assert torch_floor.too_old("2.11.0") is None and torch_floor.too_old("3.0.0") is None
    why = torch_floor.too_old("2.10.1+cu128")
    assert why is not None and "torch >= 2.11" in why and "2.10.1+cu128" in why and "pip install" in why
    with pytest.raises(ValueError, match="not a torch version"):
        torch_floor.release("nightly")


def test_pyproject_requires_the_same_floor() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(r'"torch>=(\d+)\.(\d+)"', text)
    assert found is not None and (int(found[1]), int(found[2])) == torch_floor.MIN_TORCH


def _fake_torch(tmp_path: Path, version: str) -> dict[str, str]:
    """An environment whose ``import torch`` finds a package of that version first."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}


def test_import_mixprec_on_an_older_torch_names_the_floor_and_the_fix(tmp_path: Path) -> None:
    env = _fake_torch(tmp_path, "2.8.0")
    run = subprocess.run([sys.executable, "-c", "import mixprec"], env=env, capture_output=True, text=True)
    assert run.returncode == 1
    assert "ImportError: mixprec needs torch >= 2.11; this environment has torch 2.8.0" in run.stderr


def test_the_makefiles_check_installs_torch_only_where_none_is_recent_enough(tmp_path: Path) -> None:
    assert "mixprec/torch_floor.py ||" in (ROOT / "Makefile").read_text()
    script = [sys.executable, str(ROOT / "mixprec" / "torch_floor.py")]
    assert subprocess.run(script).returncode == 0  # this environment's torch
    assert subprocess.run(script, env=_fake_torch(tmp_path, "2.8.0")).returncode == 1
    recent = tmp_path / "recent"
    recent.mkdir()
    assert subprocess.run(script, env=_fake_torch(recent, "2.11.0")).returncode == 0
