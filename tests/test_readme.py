"""The README's reference training loop runs as written and trains."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def reference_loop() -> str:
    text = README.read_text()
    match = re.search(r"<!-- reference-loop[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its reference-loop block"
    return match.group(1)


def test_reference_loop_is_short() -> None:
    assert len(reference_loop().strip().splitlines()) <= 25


def test_reference_loop_trains(capsys) -> None:  # type: ignore[no-untyped-def]
    namespace: dict[str, object] = {}
    exec(compile(reference_loop(), "README.md", "exec"), namespace)
    out = capsys.readouterr().out
    accuracy = float(re.search(r"valid accuracy ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert accuracy >= 0.9, out
