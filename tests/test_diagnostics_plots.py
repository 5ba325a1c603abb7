"""mixprec.diagnostics.plots: the format limits it draws, against torch's own dtypes."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.diagnostics.plots import FORMAT_MARKS


@pytest.mark.parametrize(("fmt", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_format_marks_are_the_limits_of_torch_dtypes(fmt: str, dtype: torch.dtype) -> None:
    marks = {m.linestyle: m for m in FORMAT_MARKS if m.label.startswith(fmt + " ")}
    finfo = torch.finfo(dtype)
    zero = torch.zeros((), dtype=dtype)
    smallest_subnormal = float(torch.nextafter(zero, torch.ones((), dtype=dtype)))  # reference: torch
    assert marks[":"].log2 == math.log2(smallest_subnormal)
    assert marks["--"].log2 == math.log2(finfo.smallest_normal)
    assert marks["-"].log2 == math.log2(finfo.max)
    assert f"2^{math.log2(finfo.smallest_normal):g}" in marks["--"].label
