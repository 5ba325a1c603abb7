"""One page for a ladder run (``mixprec compare --report DIR``): the ladder table and its notes, the loss
curves, the memory of one training step per precision and the gradient-exponent histogram.

:func:`write_report` takes what :func:`~mixprec.ladder.run_ladder` returned plus the ladder's initial model
and one batch, computes the two diagnostics, and writes under ``DIR``:

    report.md        Markdown that links the PNGs next to it (relative paths)
    report.html      the same page with the PNGs embedded as base64 data URIs: one self-contained file
    loss_curves.png  :func:`~mixprec.ladder_output.plot_ladder`
    memory.png       :func:`~mixprec.diagnostics.plots.plot_memory`, one bar per memory signature of the rungs
    gradients.png    :meth:`~mixprec.diagnostics.GradientReport.plot`, at the dynamic rung's final scale
    NAME_loss_curves.png, NAME_gradients.png   the same for each further experiment (:class:`Section`)

The table, its one-line measured explanation per rung and its notes are :mod:`mixprec.ladder_output`'s, as
in compare.md: the page shows what the run measured, in the same words.

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
from mixprec.diagnostics.memory import COMPONENTS, MIB, MemoryBreakdown, memory_breakdown
from mixprec.ladder import ALL_RUNGS, CompareSettings, Rung, RungResult, weighted_loss
from mixprec.ladder_output import CHANGE, COLUMNS, explained_rows, notes_for, plot_ladder

__all__ = [
    "Report",
    "Section",
    "write_report",
    "memory_for_rungs",
    "gradients_for_rungs",
    "report_scale",
]

FILES = {"md": "report.md", "html": "report.html", "loss": "loss_curves.png", "memory": "memory.png",
         "gradients": "gradients.png"}


@dataclass(frozen=True)
class Report:
    """What the page shows, besides the ladder results: the breakdowns, the gradient report and its scale."""

    memory: tuple[MemoryBreakdown, ...]
    gradients: GradientReport
    scale: float | None  # the loss scale the histogram is also shown at (None: the suggested one)
    paths: dict[str, Path]


@dataclass(frozen=True)
class Section:
    """Another experiment on the same page (e.g. the small-gradient one): its table with the measured
    explanations and notes, its loss curves, and the gradient histogram of its initial model."""

    name: str  # file stem of its PNGs
    why: str  # what it shows, one line
    settings: CompareSettings
    results: Sequence[RungResult]
    model: nn.Module
    batch: tuple[Tensor, Tensor]


# ---------------------------------------------------------------------------------------------------
# The diagnostics


def _memory_signature(rung: Rung) -> tuple[object, ...]:
    """What decides a rung's memory: loss scaling costs none, so rungs that differ only in it share a bar."""
    r = rung.recipe
    return (r.model_dtype, r.keep_batchnorm_fp32, r.uses_masters, r.autocast_dtype, rung.update)


def memory_for_rungs(
    keys: Sequence[str], model: nn.Module, batch: tuple[Tensor, Tensor], settings: CompareSettings
) -> list[MemoryBreakdown]:
    """One estimated breakdown per distinct memory signature among ``keys`` (in their order), labelled as
    the first rung of the ladder with that signature. Estimated under FakeTensorMode: nothing is computed,
    so this costs well under a second."""
    sgd = functools.partial(torch.optim.SGD, lr=settings.lr, momentum=settings.momentum)
    first = {}  # signature -> the first rung of the ladder that has it (names the bar)
    for rung in ALL_RUNGS.values():
        first.setdefault(_memory_signature(rung), rung)
    signatures = dict.fromkeys(_memory_signature(ALL_RUNGS[k]) for k in keys)
    return [
        dataclasses.replace(
            memory_breakdown(model, sgd, batch, first[sig].recipe, update=first[sig].update, estimate=True),
            precision=first[sig].label,
        )
        for sig in signatures
    ]


def report_scale(results: Sequence[RungResult]) -> float | None:
    """The loss scale the dynamic O2 rung ended with (or O1's, or any scaled rung's), else None."""
    scaled = {r.key: r.final_scale for r in results if r.ok and r.final_scale is not None}
    return next((scaled[k] for k in ("fp16-dynamic", "o1", "fp16-static") if k in scaled), None)


def gradients_for_rungs(
    results: Sequence[RungResult], model: nn.Module, batch: tuple[Tensor, Tensor], loss_weight: float = 1.0
) -> tuple[GradientReport, float | None]:
    """fp32 gradients of ``model`` on ``batch`` (the loss times ``loss_weight``), evaluated in fp16 unscaled
    and at :func:`report_scale`."""
    scale = report_scale(results)
    report = grad_exponent_histogram(model, batch, loss_fn=weighted_loss(loss_weight),
                                     loss_scale=() if scale is None else scale)
    return report, scale


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
    rows = [[label, *(f"{getattr(b, key) / MIB:,.3f}" for b in breakdowns), what]
            for key, label, what in COMPONENTS if any(getattr(b, key) for b in breakdowns)]
    rows.append(["**total**", *(f"**{b.total / MIB:,.3f}**" for b in breakdowns),
                 "upper bound of one step's live tensors"])
    rows.append(["bytes per parameter", *(f"{b.bytes_per_param:.1f}" for b in breakdowns),
                 "params + grads + masters/extras + optimizer state"])
    base = breakdowns[0].total if breakdowns else 0
    rows.append([f"vs {breakdowns[0].precision}" if breakdowns else "",
                 *(f"{b.total / base:.2f}x" if base else "—" for b in breakdowns), ""])
    return _Table(["component (MiB)", *(b.precision for b in breakdowns), "what is counted"], rows, (0, -1))


def _scale_text(scale: float | None) -> str:
    if scale is None:
        return "the suggested scale (no rung used loss scaling)"
    power = scale > 0 and math.log2(scale).is_integer()
    return f"{scale:g} = 2^{math.log2(scale):g}" if power else f"{scale:g}"


def _ladder_table(results: Sequence[RungResult]) -> _Table:
    return _Table([*COLUMNS, CHANGE], explained_rows(results), (0, 1, len(COLUMNS)))


def _blocks(results: Sequence[RungResult], settings: CompareSettings, notes: Sequence[str],
            report: Report, sections: Sequence[tuple[Section, Sequence[str], GradientReport, float | None]],
            ) -> list[Block]:
    batch_note = f"one training batch of {settings.batch_size}"
    blocks: list[Block] = [
        ("h1", f"mixprec compare: {settings.title}"),
        ("h2", "The ladder"),
        ("table", _ladder_table(results)),
        ("ul", list(notes)),
        ("h2", "Loss curves"),
        ("img", _Image(FILES["loss"], "train loss per step, its gap to fp32, valid accuracy per epoch")),
        ("h2", "Memory of one training step"),
        ("p", f"Estimated for the same model and {batch_note} (FakeTensorMode: shapes and dtypes, nothing "
              "computed), SGD as in the ladder. MiB = 2^20 bytes. Rungs that differ only in loss scaling "
              "share a bar: loss scaling costs no memory."),
        ("table", _memory_table(report.memory)),
        ("img", _Image(FILES["memory"], "stacked memory bars per precision")),
        ("h2", "Gradient exponents"),
        ("p", f"fp32 gradients of the initial model (before training) on {batch_note}, against fp16's and "
              f"bf16's ranges, unscaled and times {_scale_text(report.scale)}, the loss scale the dynamic "
              "rung ended with."),
        ("pre", report.gradients.summary(report.scale)),
        ("img", _Image(FILES["gradients"], "histogram of gradient exponents")),
    ]
    for section in sections:
        blocks += _section_blocks(*section)
    return blocks


def _section_blocks(section: Section, notes: Sequence[str], gradients: GradientReport,
                    scale: float | None) -> list[Block]:
    return [
        ("h2", f"Experiment {section.name}: {section.why}"),
        ("p", section.settings.title),
        ("table", _ladder_table(section.results)),
        ("ul", list(notes)),
        ("img", _Image(f"{section.name}_loss_curves.png", f"{section.name}: train loss and accuracy")),
        ("p", f"fp32 gradients of its initial model on one batch, with the loss weight, unscaled and times "
              f"{_scale_text(scale)}:"),
        ("pre", gradients.summary(scale)),
        ("img", _Image(f"{section.name}_gradients.png", f"{section.name}: histogram of gradient exponents")),
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
    notes: Sequence[str] | None = None,
    sections: Sequence[Section] = (),
) -> Report:
    """Compute the memory breakdowns and the gradient histogram of ``model`` (the ladder's initial model,
    left unchanged) on ``batch``, and write report.md, report.html and their PNGs under ``out``; each of
    ``sections`` adds its table, notes, loss curves and gradient histogram. ``notes`` default to the
    ladder's (:func:`mixprec.ladder_output.notes_for`)."""
    out.mkdir(parents=True, exist_ok=True)
    notes = notes_for(results) if notes is None else notes
    paths = {kind: out / name for kind, name in FILES.items()}
    memory = memory_for_rungs([r.key for r in results], model, batch, settings)
    gradients, scale = gradients_for_rungs(results, model, batch, settings.loss_weight)
    report = Report(tuple(memory), gradients, scale, paths)
    plot_ladder(results, paths["loss"], f"Training of each rung: {settings.title}")
    _plot_memory(memory, paths["memory"], settings)
    gradients.plot(paths["gradients"], scale, title=_gradient_title(settings, scale))
    pages = []
    for section in sections:
        plot_ladder(section.results, out / f"{section.name}_loss_curves.png", section.settings.title)
        grads, grad_scale = gradients_for_rungs(section.results, section.model, section.batch,
                                                section.settings.loss_weight)
        grads.plot(out / f"{section.name}_gradients.png", grad_scale,
                   title=_gradient_title(section.settings, grad_scale))
        pages.append((section, notes_for(section.results), grads, grad_scale))
    blocks = _blocks(results, settings, notes, report, pages)
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
