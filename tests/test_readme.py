"""Every python block of the README runs as written; the reference loop trains."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def reference_loop() -> str:
    match = re.search(r"<!-- reference-loop[^>]*-->\s*```python\n(.*?)```", README.read_text(), re.S)
    assert match, "README.md lost its reference-loop block"
    return match.group(1)


def test_reference_loop_is_short() -> None:
    assert len(reference_loop().strip().splitlines()) <= 25


def test_reference_loop_trains(capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(reference_loop(), "README.md", "exec"), {})
    out = capsys.readouterr().out
    accuracy = float(re.search(r"valid accuracy ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert accuracy >= 0.9, out


@pytest.mark.parametrize("index", range(1, len(BLOCKS)))
def test_other_blocks_run(index: int) -> None:
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {})
