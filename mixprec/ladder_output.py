"""What a ladder run writes: the table (one row per rung), the one-line explanation of each rung's difference
to the rung it builds on, the notes under the table, and the files (csv, json, md, png).

Everything a reader is told about a run is computed from that run's measurements: the explanations compare
measured values (:data:`MEASURES`), and :func:`measured_notes` says which arithmetic ran (as
:mod:`mixprec.hardware` decided it, with each half rung's time against fp32's), why gradients underflow
(the fp32 rung's gradients against fp16's thresholds) and whether lost updates are where the theory puts
them. :data:`NOTES` only defines the columns.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mixprec.hardware import half_arithmetic
from mixprec.ladder import ALL_RUNGS, CompareSettings, RungResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["COLUMNS", "CHANGE", "NOTES", "MEASURES", "explain", "explained_rows", "measured_notes",
           "ladder_figure", "notes_for", "results_table", "plot_ladder",
           "write_outputs"]


def _num(value: float | None, fmt: str) -> str:
    if value is None:
        return "—"
    return "nan" if math.isnan(value) else format(value, fmt)


# column header -> how a result fills it
COLUMNS: dict[str, Callable[[RungResult], str]] = {
    "rung": lambda r: r.label,
    "arithmetic": lambda r: r.arithmetic,
    "train loss": lambda r: _num(r.train_loss, ".4f"),
    "valid acc %": lambda r: _num(None if r.valid_accuracy is None else 100 * r.valid_accuracy, ".2f"),
    "ms/step": lambda r: _num(r.ms_per_step, ".1f"),
    "B/param": lambda r: _num(r.bytes_per_param, ".1f"),
    "state MiB": lambda r: _num(r.state_mib, ".1f"),
    "saved MiB": lambda r: _num(r.saved_mib, ".2f"),
    "grads 0 %": lambda r: _num(r.zero_grad_pct, ".2f"),
    "grads subn. %": lambda r: _num(r.subnormal_grad_pct, ".2f"),
    "upd. lost %": lambda r: _num(r.lost_update_pct, ".2f"),
    "upd. < ½ulp %": lambda r: _num(r.predicted_lost_pct, ".2f"),
    "skipped": lambda r: "—" if r.skipped_steps is None else str(r.skipped_steps),
    "final scale": lambda r: _num(r.final_scale, "g"),
}

NOTES = (
    "train loss: mean over the last epoch's batches; valid acc %: after the last epoch. arithmetic: what "
    "the GEMMs ran in (emulated: fp32 kernels on half-rounded inputs, one rounding of the result).",
    "ms/step: median wall time of a training step (forward, backward, optimizer step).",
    "B/param: bytes per parameter of weights + gradients + fp32 masters and their gradients (or a "
    "low-precision optimizer's compensation / low halves) + optimizer state; state MiB: the same in MiB. "
    "saved MiB: tensors autograd saved for backward, beyond the parameters. Counted from the tensors after "
    "the first step; not an allocator peak (the CPU reports none).",
    "grads 0 % / subn. %: gradient entries exactly 0, or stored as subnormals of their dtype (fewer "
    "significant bits), after backward and before unscaling; fp32 shows the zeros that are real.",
    "upd. lost %: entries with a nonzero gradient whose optimizer-held value (fp32 master, the half weight "
    "itself, or weight + compensation / the 16+16 master) did not change in the step: the update rounded "
    "away. upd. < ½ulp %: the theory for plain SGD, |lr * grad| below half the spacing of the stored dtype "
    "at the weight.",
    "grads 0 %, grads subn. %, upd. lost % and upd. < ½ulp % are sampled on the last batch of each epoch.",
)


# measure name -> (words, value, format): what an explanation line may compare
MEASURES: dict[str, tuple[str, Callable[[RungResult], float | None], str]] = {
    "lost": ("updates lost", lambda r: r.lost_update_pct, ".1f%"),
    # Apart, not summed: a scale can lift a gradient from 0 (lost) to a subnormal (kept, with fewer bits).
    "zero": ("grads 0", lambda r: r.zero_grad_pct, ".1f%"),
    "subnormal": ("grads subnormal", lambda r: r.subnormal_grad_pct, ".1f%"),
    "loss": ("train loss", lambda r: r.train_loss, ".4f"),
    "bytes": ("bytes/param", lambda r: r.bytes_per_param, ".1f"),
    "ms": ("ms/step", lambda r: r.ms_per_step, ".1f"),
    "scale": ("final scale", lambda r: r.final_scale, "g"),
}


def _fmt(value: float | None, fmt: str) -> str:
    pct = fmt.endswith("%")
    return _num(value, fmt.rstrip("%")) + ("%" if pct and value is not None else "")


def explain(result: RungResult, results: Sequence[RungResult]) -> str:
    """One line: what ``result`` changed against the first of its rung's bases that ran, in the measures
    its lesson is about, and in accuracy. The rung's lesson when no base ran."""
    rung = ALL_RUNGS.get(result.key)
    if rung is None or not result.ok:
        return result.status if not result.ok else ""
    ran = {r.key: r for r in results if r.ok}
    base = next((ran[k] for k in rung.bases if k in ran), None)
    if base is None:
        return rung.lesson
    parts = []
    for name in rung.shows:
        words, value, fmt = MEASURES[name]
        parts.append(f"{words} {_fmt(value(base), fmt)} -> {_fmt(value(result), fmt)}")
    if result.valid_accuracy is not None and base.valid_accuracy is not None:
        parts.append(f"acc {100 * (result.valid_accuracy - base.valid_accuracy):+.2f} pts")
    return f"vs {base.label}: " + ", ".join(parts)


# ---------------------------------------------------------------------------------------------------
# Notes from measurement


def _arithmetic_notes(results: Sequence[RungResult], device_type: str) -> list[str]:
    fp32 = next((r for r in results if r.ok and r.key == "fp32"), None)
    notes = []
    for dtype, name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
        rungs = [r for r in results if r.ok and r.arithmetic.startswith(name)]
        if not rungs:
            continue
        decided = half_arithmetic(device_type, dtype)
        line = f"{name} GEMMs ran {decided.arithmetic.value} ({decided.decided_by.value}: {decided.reason})"
        if fp32 is not None and fp32.ms_per_step:
            ratio = {r.label: r.ms_per_step / fp32.ms_per_step for r in rungs if r.ms_per_step is not None}
            line += "; ms/step against fp32's: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items())
            if decided.emulated and ratio and min(ratio.values()) < IMPLAUSIBLE_SPEEDUP:
                line += (f". Emulated GEMMs are fp32 GEMMs plus roundings: a ratio below "
                         f"{IMPLAUSIBLE_SPEEDUP}x means the machine was busy while fp32 ran (rungs run one "
                         "after another); run again for timings (losses and accuracies do not depend on it)")
        notes.append(line + ".")
    return notes


# Below this, an emulated rung "faster" than fp32 is load noise, not arithmetic: the best measured eager
# emulated step was 0.91x fp32 (an O2 MLP, whose elementwise ops move half the bytes).
IMPLAUSIBLE_SPEEDUP = 0.8


def _gradient_note(results: Sequence[RungResult]) -> list[str]:
    fp32 = next((r for r in results if r.ok and r.key == "fp32"), None)
    if fp32 is None or fp32.flushed_grad_pct is None or fp32.below_fp16_normal_pct is None:
        return []
    return [
        f"fp32's gradients: {fp32.below_fp16_normal_pct:.1f}% of entries are nonzero and below fp16's "
        f"smallest normal 2^-14 (fp16 keeps fewer bits), {fp32.flushed_grad_pct:.1f}% below 2^-25, half "
        "its smallest subnormal (fp16 stores them as 0): what an unscaled fp16 gradient loses here."
    ]


def _theory_notes(results: Sequence[RungResult]) -> list[str]:
    half_weights = {k for k, g in ALL_RUNGS.items() if g.recipe.casts_model and not g.recipe.uses_masters}
    rungs = [r for r in results if r.ok and r.key in half_weights
             and r.predicted_lost_pct is not None and r.lost_update_pct is not None]
    return [
        f"{r.label}: {r.lost_update_pct:.1f}% of updates lost; {r.predicted_lost_pct:.1f}% were below half "
        "an ulp of their half weight (what rounding to nearest loses, the theory). Both count entries with "
        "a nonzero gradient: a gradient that underflowed to 0 is in grads 0 %"
        + (f" ({r.zero_grad_pct:.1f}% here)." if r.zero_grad_pct is not None else ".") for r in rungs
    ]


def measured_notes(results: Sequence[RungResult], device_type: str = "cpu") -> list[str]:
    """The notes that depend on this run: arithmetic per half dtype with measured speed, the fp32
    gradients against fp16's thresholds, and lost updates against the theory for half weights."""
    return [*_arithmetic_notes(results, device_type), *_gradient_note(results), *_theory_notes(results)]


def notes_for(results: Sequence[RungResult], device_type: str = "cpu") -> list[str]:
    """The column definitions, then the measured notes."""
    return [*NOTES, *measured_notes(results, device_type)]


# ---------------------------------------------------------------------------------------------------
# Rows and files

CHANGE = "what changed (measured)"


def results_table(results: Sequence[RungResult]) -> list[dict[str, str]]:
    """One dict per rung: column header -> text (the rows of every output format)."""
    rows = []
    for r in results:
        row = {name: cell(r) for name, cell in COLUMNS.items()}
        if not r.ok:
            row = {name: (r.label if name == "rung" else "—") for name in COLUMNS} | {"train loss": r.status}
        rows.append(row)
    return rows


def explained_rows(results: Sequence[RungResult]) -> list[list[str]]:
    """The table's rows as lists of cells, each ending with the rung's measured explanation (header:
    ``[*COLUMNS, CHANGE]``)."""
    rows = results_table(results)
    return [[*row.values(), explain(r, results)] for row, r in zip(rows, results, strict=True)]


def _markdown(results: Sequence[RungResult], settings: CompareSettings, notes: Sequence[str]) -> str:
    header = [*COLUMNS, CHANGE]
    rows = explained_rows(results)
    lines = [
        f"# mixprec compare: {settings.title}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i in (0, 1, len(header) - 1) else "---:" for i in range(len(header))) + "|",
    ]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join([*lines, "", *(f"- {n}" for n in notes), ""])


def _ema(values: Sequence[float], beta: float = 0.9) -> list[float]:
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))  # bias-corrected, as fastai's smoothed loss
    return out


# Rungs whose curves coincide (fp16 + master, + static scale and + dynamic scale often train alike) would
# hide each other: each later rung is drawn thinner, on top, and in the next dash pattern, so a curve under
# another still shows at its edges and between its dashes.
_LINESTYLES = ("-", "--", "-.", ":")
_WIDEST, _NARROWEST = 3.0, 1.0


def _line_styles(n: int) -> list[tuple[str, float]]:
    """(linestyle, linewidth) of each of ``n`` rungs, in drawing order."""
    step = (_WIDEST - _NARROWEST) / max(n - 1, 1)
    return [(_LINESTYLES[i % len(_LINESTYLES)], _WIDEST - i * step) for i in range(n)]


def ladder_figure(results: Sequence[RungResult], title: str) -> Figure:
    """Every rung's train loss per step (smoothed), its gap to the fp32 rung on the same batches (when fp32
    ran), and valid accuracy per epoch, side by side."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ran = [r for r in results if r.ok]
    reference = next((r for r in ran if r.key == "fp32"), None)
    fig = Figure(figsize=(15, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, gap_ax, acc_ax = fig.subplots(1, 3, width_ratios=(3, 3, 2))
    for r, (style, width) in zip(ran, _line_styles(len(ran)), strict=True):
        (line,) = loss_ax.plot(_ema(r.losses), ls=style, lw=width, label=r.label)
        if reference is not None:
            gap = [a - b for a, b in zip(r.losses, reference.losses, strict=False)]
            gap_ax.plot(_ema(gap), ls=style, lw=width, color=line.get_color())
        epochs = range(1, len(r.valid_accuracies) + 1)
        acc_ax.plot(epochs, [100 * a for a in r.valid_accuracies], marker="o", ls=style, lw=width,
                    color=line.get_color())
    loss_ax.set(xlabel="training step", ylabel="train loss (EMA 0.9, bias-corrected)", yscale="log")
    gap_ax.set(xlabel="training step", ylabel="train loss minus fp32's, same batches (EMA 0.9)")
    gap_ax.axhline(0.0, color="black", lw=0.6)
    if reference is None:
        gap_ax.set_title("(no fp32 rung to compare with)", fontsize=9)
    acc_ax.set(xlabel="epoch", ylabel="valid accuracy %")
    loss_ax.legend(fontsize=8, title="later rungs thinner, on top", title_fontsize=8)
    fig.suptitle(title)
    return fig


def plot_ladder(results: Sequence[RungResult], path: Path, title: str) -> Path:
    """:func:`ladder_figure` written to ``path`` (PNG)."""
    ladder_figure(results, title).savefig(path, dpi=110)
    return path


def write_outputs(
    results: Sequence[RungResult],
    settings: CompareSettings,
    out: Path,
    notes: Sequence[str] | None = None,
    stem: str = "compare",
) -> dict[str, Path]:
    """``stem``.csv, .json (with every per-step loss), .md and .png under ``out``. ``notes`` default to
    :func:`notes_for` the results."""
    notes = notes_for(results) if notes is None else notes
    out.mkdir(parents=True, exist_ok=True)
    paths = {kind: out / f"{stem}.{kind}" for kind in ("csv", "json", "md", "png")}
    with paths["csv"].open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*COLUMNS, CHANGE])
        writer.writerows(explained_rows(results))
    payload = {
        "settings": asdict(settings),
        "notes": list(notes),
        "results": [asdict(r) | {"losses": list(r.losses), "change": explain(r, results)} for r in results],
    }
    paths["json"].write_text(json.dumps(payload, indent=1, allow_nan=True) + "\n")
    paths["md"].write_text(_markdown(results, settings, notes))
    plot_ladder(results, paths["png"], settings.title)
    return paths
