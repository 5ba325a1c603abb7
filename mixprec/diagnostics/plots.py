"""Figures of the diagnostics: one shared look, written as PNG files for people to read.

Everything draws on a :class:`matplotlib.figure.Figure` with the Agg canvas attached directly, never
through ``pyplot``: no global backend is switched, no window can open, and figures are freed when the
function returns (pyplot keeps every figure alive until it is closed).

matplotlib is imported inside the functions, so importing :mod:`mixprec.diagnostics` stays cheap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixprec.formats import FormatInfo, info

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from mixprec.diagnostics.gradients import GradientReport
    from mixprec.diagnostics.memory import MemoryBreakdown

__all__ = [
    "FORMAT_MARKS",
    "FormatMark",
    "new_figure",
    "plot_gradient_exponents",
    "plot_memory",
    "save_png",
]

# Shared look: large enough to read on a slide, grid behind the data, no top/right frame.
STYLE: dict[str, Any] = {
    "font.size": 11,
    "axes.titlesize": 13,
    "axes.titleweight": "bold",
    "axes.labelsize": 11,
    "axes.grid": True,
    "axes.axisbelow": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.fontsize": 9,
    "legend.framealpha": 0.9,
    "savefig.dpi": 120,
}

FP16_COLOR = "#d62728"  # red: the format whose range is the problem
BF16_COLOR = "#1f77b4"  # blue
SCALED_COLOR = "#ff7f0e"


@dataclass(frozen=True)
class FormatMark:
    """A vertical line on a log2 axis at one limit of a format's range."""

    label: str
    log2: float
    color: str
    linestyle: str


_FP16 = info("fp16")
_BF16 = info("bf16")


def _pow2_text(x: float) -> str:
    return f"2^{math.log2(x):g}"


def _format_marks(fmt: FormatInfo, color: str, max_text: str) -> tuple[FormatMark, ...]:
    """Smallest subnormal (dotted), smallest normal (dashed) and largest finite value (solid) of ``fmt``."""
    return (
        FormatMark(f"{fmt.name} min subnormal {_pow2_text(fmt.smallest_subnormal)}",
                   math.log2(fmt.smallest_subnormal), color, ":"),
        FormatMark(f"{fmt.name} min normal {_pow2_text(fmt.smallest_normal)}",
                   math.log2(fmt.smallest_normal), color, "--"),
        FormatMark(f"{fmt.name} max {max_text}", math.log2(fmt.max), color, "-"),
    )


# Limits of the two half formats on a log2|x| axis, from mixprec.formats (fp16: 2^-24, 2^-14, 65504; bf16
# shares fp32's exponent range, 2^-133 .. ~2^128).
FORMAT_MARKS: tuple[FormatMark, ...] = (
    *_format_marks(_FP16, FP16_COLOR, f"{_FP16.max:g}"),
    *_format_marks(_BF16, BF16_COLOR, f"{_BF16.max:.1e}".replace("e+", "e")),
)

# Colours of the memory components, in stacking order (bottom first): weights dark, transient data light.
MEMORY_COLORS: dict[str, str] = {
    "params": "#1f4e79",
    "masters": "#2e75b6",
    "extras": "#8faadc",  # a LowPrecisionOptimizer's compensations / low halves: beside the masters
    "buffers": "#9dc3e6",
    "grads": "#c55a11",
    "master_grads": "#f4b183",
    "optimizer_state": "#548235",
    "weight_copies": "#bf9000",
    "activations": "#7f7f7f",
}


def new_figure(width: float = 9.0, height: float = 5.5, nrows: int = 1, **kwargs: Any) -> tuple[Figure, Any]:
    """A figure on the Agg canvas with the shared style, and its axes (``subplots`` semantics)."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(width, height), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(nrows=nrows, **kwargs)
    return fig, axes


def save_png(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (parent folders are created) and return the path."""
    import matplotlib

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with matplotlib.rc_context(STYLE):
        fig.savefig(out, format="png")
    return out


# ---------------------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------------------


def plot_memory(breakdowns: Sequence[MemoryBreakdown], path: str | Path, title: str | None = None) -> Path:
    """Stacked bars: one per precision, one segment per memory component, in MB (1e6 bytes)."""
    import matplotlib

    from mixprec.diagnostics.memory import COMPONENTS, memory_unit

    if not breakdowns:
        raise ValueError("plot_memory needs at least one MemoryBreakdown.")
    with matplotlib.rc_context(STYLE):
        fig, ax = new_figure(width=max(6.0, 1.6 * len(breakdowns) + 4.5), height=5.5)
        names = [b.precision for b in breakdowns]
        x = list(range(len(breakdowns)))
        unit, per = memory_unit(breakdowns)  # the table's unit, binary
        bottom = [0.0] * len(breakdowns)
        for key, label, _ in COMPONENTS:
            heights = [getattr(b, key) / per for b in breakdowns]
            if not any(heights):
                continue
            ax.bar(x, heights, bottom=bottom, width=0.6, label=label, color=MEMORY_COLORS[key],
                   edgecolor="white", linewidth=0.5)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        top = max(bottom)
        for xi, total in zip(x, bottom, strict=True):
            ax.text(xi, total + 0.01 * top, f"{total:,.2f} {unit}", ha="center", va="bottom",
                    fontweight="bold")
        ax.set_xticks(x, names)
        ax.set_ylim(0, top * 1.12)
        ax.set_xlabel("precision")
        ax.set_ylabel(f"memory ({unit}, 1 {unit} = 2^{per.bit_length() - 1} bytes)")
        ax.set_title(title or "Training memory by precision")
        ax.grid(axis="x", visible=False)
        handles, labels = ax.get_legend_handles_labels()
        # Legend top-down in the order the segments are stacked top-down.
        ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_png(fig, path)


# ---------------------------------------------------------------------------------------------------------
# gradient exponents
# ---------------------------------------------------------------------------------------------------------


def plot_gradient_exponents(
    report: GradientReport, path: str | Path, scale: float | None = None, title: str | None = None
) -> Path:
    """Two panels over a shared log2|g| axis: the histogram of all gradients (before and after multiplying
    by ``scale``, log-scaled counts so the tails that underflow show) and a per-parameter heat map, with
    fp16's and bf16's limits drawn as vertical lines."""
    import matplotlib

    scale = report.suggested_scale if scale is None else scale
    with matplotlib.rc_context(STYLE):
        n_layers = len(report.layers)
        fig, (top, bottom) = new_figure(
            width=11.0, height=6.5 + 0.22 * n_layers, nrows=2, sharex=True,
            gridspec_kw={"height_ratios": [3.0, max(1.5, 0.25 * n_layers)]},
        )
        lo, hi = _exponent_window(report, scale)
        _draw_overall(top, report, scale)
        _draw_layers(fig, bottom, report)
        for ax in (top, bottom):
            _draw_format_marks(ax, lo, hi, label=ax is top)
            ax.set_xlim(lo, hi)
        bottom.set_xlabel("log2 |gradient|   (bin e holds 2^e <= |g| < 2^(e+1))")
        scaled = f", and after a loss scale of {scale:g}" if scale not in (None, 1.0) else ""
        fig.suptitle(title or f"Gradient magnitudes against the fp16 and bf16 ranges{scaled}",
                     fontsize=13, fontweight="bold")
        fig.legend(loc="outside lower center", ncols=3, fontsize=9)
    return save_png(fig, path)


def _exponent_window(report: GradientReport, scale: float | None) -> tuple[float, float]:
    exps = report.overall.nonempty_exponents()
    shift = math.log2(scale) if scale else 0.0
    data_lo = min(exps) if exps else -30
    data_hi = max(exps) + 1 if exps else 0
    # Always show fp16's whole range (2^-24 .. 2^16) and the data, before and after scaling.
    lo = min(data_lo, math.log2(_FP16.smallest_subnormal) - 2) - 2
    hi = max(data_hi + shift, _FP16.max_exponent + 2) + 2
    return float(lo), float(hi)


def _draw_overall(ax: Axes, report: GradientReport, scale: float | None) -> None:
    overall = report.overall
    exps = list(overall.exponents)
    total = max(overall.nonzero, 1)
    pct = [100.0 * c / total for c in overall.counts]
    # Subnormal from where a value stops rounding to 0 (half the smallest subnormal) to the smallest normal.
    underflow, normal = math.log2(_FP16.smallest_subnormal / 2), math.log2(_FP16.smallest_normal)
    ax.axvspan(underflow, normal, color=FP16_COLOR, alpha=0.10,
               label="fp16 subnormal: fewer significant bits")
    ax.axvspan(normal, math.log2(_FP16.max), color=FP16_COLOR, alpha=0.04, label="fp16 normal range")
    # Only the non-empty bins: a zero-height bar (or an all-zero line) has no place on a log axis, and
    # matplotlib warns "Data has no positive values" when that is all there is (all zeros, all inf/NaN).
    shown = [(e, p) for e, p in zip(exps, pct, strict=True) if p > 0]
    ax.bar([e + 0.5 for e, _ in shown], [p for _, p in shown], width=1.0, color="#4d4d4d", alpha=0.8,
           label=f"gradients g ({overall.nonzero:,} non-zero finite; {overall.zeros:,} zeros and "
                 f"{overall.nonfinite:,} inf/NaN not shown)")
    if scale not in (None, 1.0) and shown:
        shift = math.log2(scale)
        ax.step([e + shift for e in exps] + [exps[-1] + 1 + shift], pct + [pct[-1]], where="post",
                color=SCALED_COLOR, linewidth=1.8, label=f"g x loss scale {scale:g} (= 2^{shift:g})")
    ax.set_yscale("log")
    smallest = min((p for _, p in shown), default=1e-4)
    ax.set_ylim(max(smallest / 3, 1e-7), 150.0)
    ax.set_ylabel("% of non-zero gradients (log scale)")
    ax.set_title("\n".join(_overall_header(report, scale)), loc="left", fontsize=9, fontweight="normal")


def _overall_header(report: GradientReport, scale: float | None) -> list[str]:
    """The fp16 outcomes, and the inf/NaN gradients they leave out. With no finite non-zero gradient the
    outcomes would read "0% overflow" of nothing: the header says what there is instead."""
    overall = report.overall
    nonfinite = overall.nonfinite_text()
    if not overall.nonzero:
        return [f"no finite non-zero gradient to histogram: {overall.nonfinite:,} inf/NaN and "
                f"{overall.zeros:,} exact zeros, of {overall.numel:,}."]
    lines = [o.describe() for o in (overall.outcome(1.0), overall.outcome(scale) if scale else None) if o]
    return lines + ([nonfinite] if nonfinite else [])


def _draw_layers(fig: Figure, ax: Axes, report: GradientReport) -> None:
    import numpy as np
    from matplotlib.colors import LogNorm

    exps = report.overall.exponents
    grid = np.array([[c / max(layer.nonzero, 1) for c in layer.counts] for layer in report.layers])
    grid = np.where(grid > 0, grid * 100.0, np.nan)
    extent = (exps[0], exps[-1] + 1, len(report.layers), 0)
    image = ax.imshow(grid, aspect="auto", extent=extent, cmap="viridis", interpolation="nearest",
                      norm=LogNorm(vmin=max(np.nanmin(grid), 1e-4) if np.isfinite(grid).any() else 1e-4,
                                   vmax=100.0))
    ax.set_yticks([i + 0.5 for i in range(len(report.layers))], [layer.name for layer in report.layers],
                  fontsize=8)
    ax.set_ylabel("parameter")
    ax.grid(False)
    fig.colorbar(image, ax=ax, label="% of the parameter's\nnon-zero gradients", pad=0.01)


def _draw_format_marks(ax: Axes, lo: float, hi: float, label: bool) -> None:
    for mark in FORMAT_MARKS:
        if lo <= mark.log2 <= hi:
            ax.axvline(mark.log2, color=mark.color, linestyle=mark.linestyle, linewidth=1.4,
                       label=mark.label if label else None)
    if label and lo > _BF16.min_exponent:
        # bf16's limits lie far outside a typical gradient window: say where instead of squashing the axis.
        span = f"{_pow2_text(_BF16.smallest_subnormal)} .. 2^{_BF16.max_exponent + 1}"
        ax.text(0.01, 0.97, f"bf16 range: {span}\n(beyond both ends of this axis)",
                transform=ax.transAxes, color=BF16_COLOR, fontsize=9, va="top")
