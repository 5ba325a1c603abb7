"""One page for a ladder run (``mixprec compare --report DIR``): the ladder table and its notes, the loss
curves, the memory of one training step per precision and the gradient-exponent histogram.

:func:`write_report` takes what :func:`~mixprec.ladder.run_ladder` returned plus the ladder's initial model
and one batch, computes the two diagnostics, and writes under ``DIR``:

    report.md        Markdown that links the PNGs next to it (relative paths)
    report.html      the same page with the PNGs embedded as base64 data URIs: one self-contained file
    loss_curves.png  :func:`~mixprec.ladder.plot_ladder`
    memory.png       :func:`~mixprec.diagnostics.plots.plot_memory`, one bar per precision the rungs use
    gradients.png    :meth:`~mixprec.diagnostics.GradientReport.plot`, at the dynamic rung's final scale

Matplotlib is imported only when the PNGs are drawn; the HTML is plain strings (``html.escape``).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import html
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from mixprec.diagnostics.gradients import GradientReport, grad_exponent_histogram
from mixprec.diagnostics.memory import COMPONENTS, MB, MemoryBreakdown, Precision, memory_breakdown
from mixprec.ladder import COLUMNS, NOTES, CompareSettings, RungResult, plot_ladder, results_table

__all__ = [
    "Report",
    "write_report",
    "RUNG_PRECISIONS",
    "BF16_MASTER",
    "memory_for_rungs",
    "gradients_for_rungs",
    "report_scale",
]

# The ladder's bf16 rung keeps fp32 masters (bf16's 8 significant bits round small updates away); the
# diagnostics' "bf16" preset is pure bf16, so the report names its own recipe.
BF16_MASTER = Precision(
    "bf16 + master", "bf16 params except BatchNorm, fp32 master weights and optimizer state",
    torch.bfloat16, keep_batchnorm_fp32=True, master_weights=True,
)

# rung key -> (bar label, memory recipe). The three fp16 rungs with masters differ only in loss scaling,
# which costs no memory, so they share the O2 bar.
RUNG_PRECISIONS: dict[str, tuple[str, str | Precision]] = {
    "fp32": ("fp32", "fp32"),
    "fp16-naive": ("fp16 naive", "fp16"),
    "fp16-master": ("O2 (fp16 + master)", "O2"),
    "fp16-static": ("O2 (fp16 + master)", "O2"),
    "fp16-dynamic": ("O2 (fp16 + master)", "O2"),
    "o1": ("O1 (autocast)", "O1"),
    "bf16": ("bf16 + master", BF16_MASTER),
}

FILES = {"md": "report.md", "html": "report.html", "loss": "loss_curves.png", "memory": "memory.png",
         "gradients": "gradients.png"}


@dataclass(frozen=True)
class Report:
    """What the page shows, besides the ladder results: the breakdowns, the gradient report and its scale."""

    memory: tuple[MemoryBreakdown, ...]
    gradients: GradientReport
    scale: float | None  # the loss scale the histogram is also shown at (None: the suggested one)
    paths: dict[str, Path]


# ---------------------------------------------------------------------------------------------------
# The diagnostics


def memory_for_rungs(
    keys: Sequence[str], model: nn.Module, batch: tuple[Tensor, Tensor], settings: CompareSettings
) -> list[MemoryBreakdown]:
    """One estimated breakdown per distinct precision among ``keys`` (in ladder order), labelled as the
    rungs. Estimated under FakeTensorMode: nothing is computed, so this costs well under a second."""
    sgd = functools.partial(torch.optim.SGD, lr=settings.lr, momentum=settings.momentum)
    labels = dict.fromkeys(RUNG_PRECISIONS[k][0] for k in keys)
    recipes = {label: recipe for label, recipe in RUNG_PRECISIONS.values()}
    return [
        dataclasses.replace(memory_breakdown(model, sgd, batch, recipes[label], estimate=True),
                            precision=label)
        for label in labels
    ]


def report_scale(results: Sequence[RungResult]) -> float | None:
    """The loss scale the dynamic O2 rung ended with (or O1's, or any scaled rung's), else None."""
    scaled = {r.key: r.final_scale for r in results if r.ok and r.final_scale is not None}
    return next((scaled[k] for k in ("fp16-dynamic", "o1", "fp16-static") if k in scaled), None)


def gradients_for_rungs(
    results: Sequence[RungResult], model: nn.Module, batch: tuple[Tensor, Tensor]
) -> tuple[GradientReport, float | None]:
    """fp32 gradients of ``model`` on ``batch``, evaluated in fp16 unscaled and at :func:`report_scale`."""
    scale = report_scale(results)
    return grad_exponent_histogram(model, batch, loss_scale=() if scale is None else scale), scale


# ---------------------------------------------------------------------------------------------------
# The page, as a list of blocks both writers render


@dataclass(frozen=True)
class _Table:
    header: list[str]
    rows: list[list[str]]
    text_columns: tuple[int, ...] = (0,)  # left-aligned; the others hold numbers, right-aligned

    def numeric(self, column: int) -> bool:
        return column % len(self.header) not in self.text_columns


@dataclass(frozen=True)
class _Image:
    file: str
    alt: str


Block = tuple[str, str | list[str] | _Table | _Image]  # (kind, content): h1, h2, p, ul, pre, table, img


def _memory_table(breakdowns: Sequence[MemoryBreakdown]) -> _Table:
    rows = [[label, *(f"{getattr(b, key) / MB:,.3f}" for b in breakdowns), what]
            for key, label, what in COMPONENTS if any(getattr(b, key) for b in breakdowns)]
    rows.append(["**total**", *(f"**{b.total / MB:,.3f}**" for b in breakdowns),
                 "upper bound of one step's live tensors"])
    base = breakdowns[0].total if breakdowns else 0
    rows.append([f"vs {breakdowns[0].precision}" if breakdowns else "",
                 *(f"{b.total / base:.2f}x" if base else "—" for b in breakdowns), ""])
    return _Table(["component (MB)", *(b.precision for b in breakdowns), "what is counted"], rows, (0, -1))


def _scale_text(scale: float | None) -> str:
    if scale is None:
        return "the suggested scale (no rung used loss scaling)"
    power = scale > 0 and math.log2(scale).is_integer()
    return f"{scale:g} = 2^{math.log2(scale):g}" if power else f"{scale:g}"


def _blocks(results: Sequence[RungResult], settings: CompareSettings, notes: Sequence[str],
            report: Report) -> list[Block]:
    rows = results_table(results)
    batch_note = f"one training batch of {settings.batch_size}"
    return [
        ("h1", f"mixprec compare: {settings.title}"),
        ("h2", "The ladder"),
        ("table", _Table(list(COLUMNS), [list(r.values()) for r in rows])),
        ("ul", list(notes)),
        ("h2", "Loss curves"),
        ("img", _Image(FILES["loss"], "train loss per step, its gap to fp32, valid accuracy per epoch")),
        ("h2", "Memory of one training step"),
        ("p", f"Estimated for the same model and {batch_note} (FakeTensorMode: shapes and dtypes, nothing "
              "computed), SGD as in the ladder. MB = 10^6 bytes. fp16 + master, static and dynamic scaling "
              "share the O2 bar: loss scaling costs no memory."),
        ("table", _memory_table(report.memory)),
        ("img", _Image(FILES["memory"], "stacked memory bars per precision")),
        ("h2", "Gradient exponents"),
        ("p", f"fp32 gradients of the initial model (before training) on {batch_note}, against fp16's and "
              f"bf16's ranges, unscaled and times {_scale_text(report.scale)}, the loss scale the dynamic "
              "rung ended with."),
        ("pre", report.gradients.summary(report.scale)),
        ("img", _Image(FILES["gradients"], "histogram of gradient exponents")),
    ]


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def _markdown(blocks: Sequence[Block]) -> str:
    def render(kind: str, content: str | list[str] | _Table | _Image) -> str:
        if isinstance(content, _Table):
            align = ["---:" if content.numeric(i) else "---" for i in range(len(content.header))]
            lines = [content.header, align, *content.rows]
            return "\n".join("| " + " | ".join(map(_md_cell, line)) + " |" for line in lines)
        if isinstance(content, _Image):
            return f"![{content.alt}]({content.file})"
        if isinstance(content, list):
            return "\n".join(f"- {item}" for item in content)
        prefix = {"h1": "# ", "h2": "## ", "p": ""}
        return f"```\n{content}\n```" if kind == "pre" else prefix[kind] + content

    return "\n\n".join(render(kind, content) for kind, content in blocks) + "\n"


_BOLD = re.compile(r"\*\*(.+?)\*\*")


def _html_text(text: str) -> str:
    return _BOLD.sub(r"<b>\1</b>", html.escape(text))  # the one Markdown mark the tables use


def _html_row(cells: Sequence[str], table: _Table, tag: str) -> str:
    right = [' class="num"' if table.numeric(i) else "" for i in range(len(cells))]
    tds = "".join(f"<{tag}{r}>{_html_text(c)}</{tag}>" for c, r in zip(cells, right, strict=True))
    return f"<tr>{tds}</tr>"


def _html_table(table: _Table) -> str:
    body = "".join(_html_row(row, table, "td") for row in table.rows)
    return f"<table><thead>{_html_row(table.header, table, 'th')}</thead><tbody>{body}</tbody></table>"


def _html(blocks: Sequence[Block], folder: Path, title: str) -> str:
    def render(kind: str, content: str | list[str] | _Table | _Image) -> str:
        if isinstance(content, _Table):
            return _html_table(content)
        if isinstance(content, _Image):
            data = base64.b64encode((folder / content.file).read_bytes()).decode("ascii")
            return f'<img src="data:image/png;base64,{data}" alt="{html.escape(content.alt)}">'
        if isinstance(content, list):
            return "<ul>" + "".join(f"<li>{html.escape(item)}</li>" for item in content) + "</ul>"
        return f"<{kind}>{html.escape(content)}</{kind}>"

    style = ("body{font-family:sans-serif;max-width:1500px;margin:2em auto;padding:0 1em}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px}"
             ".num{text-align:right}img{max-width:100%}pre{background:#f6f6f6;padding:8px}")
    body = "\n".join(render(kind, content) for kind, content in blocks)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}'
            f"</title><style>{style}</style></head><body>\n{body}\n</body></html>\n")


# ---------------------------------------------------------------------------------------------------
# Writing


def write_report(
    results: Sequence[RungResult],
    settings: CompareSettings,
    model: nn.Module,
    batch: tuple[Tensor, Tensor],
    out: Path,
    notes: Sequence[str] = NOTES,
) -> Report:
    """Compute the memory breakdowns and the gradient histogram of ``model`` (the ladder's initial model,
    left unchanged) on ``batch``, and write report.md, report.html and their three PNGs under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {kind: out / name for kind, name in FILES.items()}
    memory = memory_for_rungs([r.key for r in results], model, batch, settings)
    gradients, scale = gradients_for_rungs(results, model, batch)
    report = Report(tuple(memory), gradients, scale, paths)
    plot_ladder(results, paths["loss"], f"Training of each rung: {settings.title}")
    _plot_memory(memory, paths["memory"], settings)
    gradients.plot(paths["gradients"], scale, title=_gradient_title(settings, scale))
    blocks = _blocks(results, settings, notes, report)
    paths["md"].write_text(_markdown(blocks))
    paths["html"].write_text(_html(blocks, out, f"mixprec compare: {settings.title}"))
    return report


def _plot_memory(memory: Sequence[MemoryBreakdown], path: Path, settings: CompareSettings) -> Path:
    from mixprec.diagnostics.plots import plot_memory

    title = (f"Memory of one training step: {settings.model}, batch {settings.batch_size}, SGD "
             f"(estimated)")
    return plot_memory(memory, path, title)


def _gradient_title(settings: CompareSettings, scale: float | None) -> str:
    scaled = "" if scale is None else f", and x {scale:g} (the dynamic rung's final scale)"
    return f"Gradients of the initial {settings.model} on one batch{scaled}"
