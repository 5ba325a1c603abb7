"""mixprec.diagnostics.plots: the format limits it draws, against torch's own dtypes."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

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


def _figure_texts(report: object, path: Path, scale: float | None, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every text of the gradient figure (titles, legend, labels), read from the figure before it is saved."""
    import matplotlib.text

    from mixprec.diagnostics import plots

    texts: list[str] = []
    save = plots.save_png

    def recording(fig: object, where: Path) -> Path:
        texts.extend(t.get_text() for t in fig.findobj(matplotlib.text.Text))  # type: ignore[attr-defined]
        return save(fig, where)  # type: ignore[arg-type]

    monkeypatch.setattr(plots, "save_png", recording)
    report.plot(path, scale)  # type: ignore[attr-defined]
    return "\n".join(texts)


@pytest.mark.parametrize("scale", [None, 1024.0])
@pytest.mark.parametrize("case", ["nan", "inf", "zeros", "mixed"])
def test_gradient_plot_says_how_many_gradients_were_inf_or_nan(
    case: str, scale: float | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plot left inf/NaN gradients out without a word (the text summary counts them): all-NaN read
    "0% overflow", and matplotlib warned "Data has no positive values" on the empty log axis."""
    from mixprec.diagnostics.gradients import analyze_grads

    grads = {"nan": torch.full((50,), math.nan), "inf": torch.full((50,), -math.inf),
             "zeros": torch.zeros(50),
             "mixed": torch.tensor([0.0, math.nan, 1e-3, 1e-9, math.inf])}[case]
    nonfinite = int((~torch.isfinite(grads)).sum())  # reference: torch's own count
    report = analyze_grads({"a": grads, "b": torch.zeros(3)}, scales=(1024.0,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "Data has no positive values" among them
        text = _figure_texts(report, tmp_path / "g.png", scale, monkeypatch)
    assert f"{nonfinite:,} inf/NaN not shown" in text
    finite_nonzero = int((torch.isfinite(grads) & (grads != 0)).sum())
    if finite_nonzero:
        assert f"{nonfinite} of {grads.numel() + 3} gradients" in text and "% overflow" in text
    else:  # the fractions are of nothing: no "0% overflow"
        assert "% overflow" not in text and "no finite non-zero gradient" in text
        assert f"{nonfinite:,} inf/NaN and {int((grads == 0).sum()) + 3:,} exact zeros" in text
