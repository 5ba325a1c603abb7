"""Where gradients lie on the exponent axis, and what fp16 (with and without a loss scale) does to them.

(Longer than most modules: the histogram, the underflow/subnormal/overflow fractions and the suggested
scale are one computation read three ways, and the monitor that collects them over a run.)

For each parameter tensor and overall: a histogram of ``floor(log2|g|)`` (bin ``e`` holds
``2^e <= |g| < 2^(e+1)``, read exactly from the float's exponent field with ``torch.frexp``, so no ``log2``
rounding puts a value in the wrong bin), and the fractions that casting ``g * S`` to fp16 would

- **underflow** (round to 0): ``|g*S| <= 2^-25``. fp16's smallest subnormal is 2^-24; values below half of
  it round down to 0, and exactly 2^-25 is a tie between 0 and 2^-24 that round-to-nearest-even resolves
  to 0 (the even significand). Above 2^-25 the result is 2^-24 or more: not lost.
- land in the **subnormal** range (non-zero but fewer than fp16's 11 significant bits):
  ``2^-25 < |g*S| < 2^-14 - 2^-25``. The upper end is the midpoint between the largest subnormal
  (2^-14 - 2^-24) and 2^-14; the tie rounds to 2^-14 (even significand), which is normal.
- **overflow** (round to inf): ``|g*S| >= 65520``, the midpoint between fp16's max 65504 and 2^16; the tie
  goes to the even 2^16, which does not exist, hence inf.

These counts are not computed from the thresholds above but by doing the cast: ``(g.float() * S)`` rounded
to fp16 by torch, then compared with 0, inf and 2^-14; the tests check the thresholds against that. The
same is reported for bf16 at scale 1 (its range is fp32's: underflow only at or below 2^-134; exactly 2^-134
is a tie that rounds to even, 0).

Fractions are of the finite non-zero gradients: exact zeros (dead ReLUs, unused embeddings) are counted
separately, as are inf/NaN. Gradients are analysed in fp32, which holds fp16, bf16 and fp32 gradients
exactly.

The **suggested loss scale** is the largest power of two ``S`` with ``max|g| * S * margin <= 65504``:
powers of two because multiplying by one only changes the exponent (exact, and what dynamic loss scaling
uses); the margin (default 8, three binades) because later batches' gradients can be several times larger
than this batch's, and every overflow costs a skipped step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from mixprec import formats
from mixprec.diagnostics.memory import call_model, default_loss, split_batch
from mixprec.errors import ConfigError
from mixprec.hardware import HALF_DTYPES

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "DEFAULT_MARGIN",
    "EXPONENTS",
    "CastOutcome",
    "GradStats",
    "GradientMonitor",
    "GradientReport",
    "analyze_grads",
    "grad_exponent_histogram",
    "model_grads",
    "suggest_loss_scale",
]

# floor(log2|x|) of finite non-zero fp32 values (gradients are analysed in fp32): 2^-149 (smallest
# subnormal) to 2^127 (largest binade).
_FP32 = formats.info("fp32")
MIN_EXPONENT, MAX_EXPONENT = _FP32.min_exponent - _FP32.mantissa_bits, _FP32.max_exponent
EXPONENTS: tuple[int, ...] = tuple(range(MIN_EXPONENT, MAX_EXPONENT + 1))

# Three binades of headroom above this batch's largest gradient (see the module docstring).
DEFAULT_MARGIN = 8.0

# The formats whose effect is reported: name -> torch dtype, from mixprec.formats.
_FORMATS: dict[str, torch.dtype] = {
    name: dtype for name in ("fp16", "bf16") if (dtype := formats.get_format(name).torch_dtype) is not None
}
FP16 = formats.info("fp16")

# The thresholds the casts imply (see the module docstring): half the smallest subnormal rounds to 0 (a tie
# to the even 0), and half an ulp above the max rounds to inf (a tie to the even 2^(max_exponent+1)).
_FP16_LIMITS = (
    f"fp16 keeps |x| > 2^{FP16.min_exponent - FP16.mantissa_bits - 1} (non-zero), subnormal below "
    f"2^{FP16.min_exponent}, inf from {FP16.max + formats.ulp(FP16.max, 'fp16') / 2:g} "
    "(round to nearest even)."
)


# ---------------------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CastOutcome:
    """What rounding ``g * scale`` to ``format`` does to ``nonzero`` finite non-zero gradients."""

    format: str
    scale: float
    nonzero: int
    underflow: int  # rounded to 0
    subnormal: int  # non-zero, below the format's smallest normal: precision lost
    overflow: int  # rounded to inf

    def fraction(self, kind: str) -> float:
        """``kind`` is "underflow", "subnormal" or "overflow"; 0.0 when there is nothing to count."""
        return getattr(self, kind) / self.nonzero if self.nonzero else 0.0

    def __add__(self, other: CastOutcome) -> CastOutcome:
        if (self.format, self.scale) != (other.format, other.scale):
            raise ValueError("only outcomes of the same format and scale add up")
        return CastOutcome(self.format, self.scale, self.nonzero + other.nonzero,
                           self.underflow + other.underflow, self.subnormal + other.subnormal,
                           self.overflow + other.overflow)

    def describe(self) -> str:
        scaled = "g" if self.scale == 1.0 else f"g x {_scale_text(self.scale)}"
        return (f"{scaled} in {self.format}: {_pct(self.fraction('underflow'))} underflow to 0, "
                f"{_pct(self.fraction('subnormal'))} subnormal, {_pct(self.fraction('overflow'))} overflow")


@dataclass(frozen=True)
class GradStats:
    """Exponent histogram and cast outcomes of one parameter's gradient (or of all of them: "all")."""

    name: str
    numel: int
    zeros: int
    nonfinite: int
    counts: tuple[int, ...]  # finite non-zero gradients per exponent in EXPONENTS
    max_abs: float  # largest finite |g| (0.0 if none)
    min_abs: float  # smallest non-zero finite |g| (inf if none)
    outcomes: tuple[CastOutcome, ...]

    @property
    def nonzero(self) -> int:
        """Finite non-zero gradients: what the histogram and the fractions are over."""
        return self.numel - self.zeros - self.nonfinite

    @property
    def exponents(self) -> tuple[int, ...]:
        return EXPONENTS

    def nonfinite_text(self) -> str | None:
        """A line on the inf/NaN gradients, which no histogram or fraction counts; None if there are none."""
        if not self.nonfinite:
            return None
        return (f"{self.nonfinite:,} of {self.numel:,} gradients ({_pct(self.nonfinite / self.numel)}) are "
                "already inf/NaN: not in the histogram or the fractions.")

    def nonempty_exponents(self) -> list[int]:
        return [e for e, c in zip(EXPONENTS, self.counts, strict=True) if c]

    def outcome(self, scale: float, format: str = "fp16") -> CastOutcome | None:
        return next((o for o in self.outcomes if o.scale == scale and o.format == format), None)

    def __add__(self, other: GradStats) -> GradStats:
        theirs = {(o.format, o.scale): o for o in other.outcomes}
        return GradStats(
            name="all",
            numel=self.numel + other.numel,
            zeros=self.zeros + other.zeros,
            nonfinite=self.nonfinite + other.nonfinite,
            counts=tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)),
            max_abs=max(self.max_abs, other.max_abs),
            min_abs=min(self.min_abs, other.min_abs),
            outcomes=tuple(o + theirs[(o.format, o.scale)] for o in self.outcomes),
        )


@dataclass(frozen=True)
class GradientReport:
    """Per-parameter and overall gradient statistics, the scales they were evaluated at, and a suggestion."""

    layers: tuple[GradStats, ...]
    overall: GradStats
    scales: tuple[float, ...]
    suggested_scale: float | None
    margin: float
    # the half dtypes the gradients came in (empty: fp32): their zeros may be values lost in backward
    half_dtypes: tuple[str, ...] = ()

    def __repr__(self) -> str:  # the dataclass's own dumps every histogram bin of every parameter
        o = self.overall
        span = f", |g| in [{o.min_abs:.3g}, {o.max_abs:.3g}]" if o.nonzero else ""
        return (f"GradientReport({len(self.layers)} parameters, {o.nonzero:,} non-zero gradients{span}, "
                f"suggested scale {self.suggested_scale}; .summary(), .table(), .plot(path) show it)")

    def outcome(self, name: str, scale: float, format: str = "fp16") -> CastOutcome | None:
        """The outcome of parameter ``name`` (or ``"all"``) at ``scale``, if it was evaluated."""
        stats = self.overall if name == "all" else next((s for s in self.layers if s.name == name), None)
        return stats.outcome(scale, format) if stats is not None else None

    def table(self, scale: float | None = None) -> Table:
        """A rich table, one row per parameter plus "all": fp16 outcomes unscaled and at ``scale``; in
        colour with ``rich.print``, as plain text with ``print``."""
        return _report_table(self, self._other_scale(scale))

    def summary(self, scale: float | None = None) -> str:
        """A few plain lines: zeros, fp16 outcomes before and after ``scale``, bf16, the suggestion."""
        return _summary(self, self._other_scale(scale))

    def plot(self, path: str | Path, scale: float | None = None, title: str | None = None) -> Path:
        """Histogram and per-parameter heat map as a PNG; ``scale`` defaults to the suggested one."""
        from mixprec.diagnostics.plots import plot_gradient_exponents

        return plot_gradient_exponents(self, path, scale if scale is not None else self._other_scale(None),
                                       title)

    def _other_scale(self, scale: float | None) -> float | None:
        if scale is not None:
            if scale not in self.scales:
                raise ConfigError(f"scale {scale:g} was not evaluated in this report.",
                                  f"use one of {', '.join(f'{s:g}' for s in self.scales)}, or pass it in "
                                  "scales= when making the report.")
            return scale
        given = [s for s in self.scales if s not in (1.0, self.suggested_scale)]
        return given[0] if given else self.suggested_scale


# ---------------------------------------------------------------------------------------------------------
# analysis
# ---------------------------------------------------------------------------------------------------------


def suggest_loss_scale(
    max_abs: float, margin: float = DEFAULT_MARGIN, fmt_max: float = FP16.max
) -> float | None:
    """The largest power of two ``S`` with ``max_abs * S * margin <= fmt_max``; None if max_abs is 0/inf."""
    if not (math.isfinite(max_abs) and max_abs > 0):
        return None
    if not (math.isfinite(margin) and margin > 0):
        raise ConfigError(f"margin must be a positive number, got {margin!r}.", "use e.g. margin=8.")
    k = math.floor(math.log2(fmt_max / (margin * max_abs)))
    # log2 is rounded: step to the exact boundary (products by powers of two are exact).
    while max_abs * margin * 2.0**k > fmt_max:
        k -= 1
    while max_abs * margin * 2.0 ** (k + 1) <= fmt_max:
        k += 1
    return 2.0**k


# The outcome counts of one cast, in the order CastOutcome's fields take them (below_normal includes zeros).
_OUTCOME_COUNTS = 3


def _outcome_counts(values: Tensor, fmt: str, scale: float) -> list[Tensor]:
    """``values``: the finite non-zero gradients, fp32. The cast itself decides (round to nearest even);
    the module docstring gives the thresholds it implies. 0-dim counts, not yet read by the host."""
    h = (values * scale).to(_FORMATS[fmt])
    tiny = formats.info(fmt).smallest_normal
    return [torch.count_nonzero(h == 0), torch.count_nonzero(h.abs() < tiny), torch.count_nonzero(h.isinf())]


@dataclass
class _Layer:
    """One gradient, read once: its finite non-zero values (fp32) and what does not depend on the scale."""

    name: str
    numel: int
    values: Tensor
    zeros: int
    nonfinite: int
    counts: tuple[int, ...]
    max_abs: float
    min_abs: float


def _read_layer(name: str, grad: Tensor, unscale: float) -> _Layer:
    """The one pass over a gradient. Boolean indexing syncs (its size is data-dependent); the counts,
    histogram and extremes are then fetched with one more sync, stacked in float64 (exact for counts below
    2^53 and for every fp32 value)."""
    g = grad.detach()
    # a complex gradient's parts are each a float the format holds (.float() would drop the imaginary part)
    g = (torch.view_as_real(g.resolve_conj()) if g.is_complex() else g).float().flatten()
    if unscale != 1.0:
        g = g / unscale  # exact for a power of two
    finite = g.isfinite()
    values = g[finite & (g != 0)]
    _, exponent = torch.frexp(values)  # |g| = m * 2^exponent with 0.5 <= m < 1: floor(log2|g|) = exponent-1
    counts = torch.bincount((exponent - 1 - MIN_EXPONENT).long(), minlength=len(EXPONENTS))
    magnitudes = values.abs()
    empty = values.numel() == 0
    extremes = torch.stack([
        torch.count_nonzero(finite).double(),
        g.new_zeros((), dtype=torch.float64) if empty else magnitudes.max().double(),
        g.new_full((), math.inf, dtype=torch.float64) if empty else magnitudes.min().double(),
    ])
    n_finite, max_abs, min_abs, *histogram = torch.cat([extremes, counts.double()]).tolist()
    return _Layer(
        name=name,
        numel=g.numel(),
        values=values,
        zeros=int(n_finite) - values.numel(),
        nonfinite=g.numel() - int(n_finite),
        counts=tuple(int(c) for c in histogram),
        max_abs=max_abs,
        min_abs=min_abs,
    )


def _stats(layer: _Layer, scales: Sequence[float]) -> GradStats:
    """The layer's cast outcomes at fp16 x each of ``scales`` and bf16 x 1, fetched with one sync."""
    casts = [("fp16", s) for s in scales] + [("bf16", 1.0)]
    counts = torch.stack([c for fmt, s in casts for c in _outcome_counts(layer.values, fmt, s)]).tolist()
    n, outcomes = layer.values.numel(), []
    for i, (fmt, s) in enumerate(casts):
        underflow, below_normal, overflow = counts[i * _OUTCOME_COUNTS:(i + 1) * _OUTCOME_COUNTS]
        outcomes.append(CastOutcome(fmt, s, n, underflow, below_normal - underflow, overflow))
    return GradStats(
        name=layer.name,
        numel=layer.numel,
        zeros=layer.zeros,
        nonfinite=layer.nonfinite,
        counts=layer.counts,
        max_abs=layer.max_abs,
        min_abs=layer.min_abs,
        outcomes=tuple(outcomes),
    )


def analyze_grads(
    grads: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
    scales: Sequence[float] = (),
    margin: float = DEFAULT_MARGIN,
    unscale: float = 1.0,
) -> GradientReport:
    """Histogram and fp16/bf16 outcomes of named gradients, at scale 1, at each of ``scales`` and at the
    suggested scale.

    ``unscale`` is the loss scale the gradients were computed with (they are divided by it first, exactly for
    a power of two), so the report is about the true gradients. Tensors that are None are skipped.
    Each gradient is read once (an fp32 copy of its finite non-zero values is held until the report is
    made) and costs three host-device syncs.
    """
    items = [(n, g) for n, g in (grads.items() if isinstance(grads, Mapping) else grads) if g is not None]
    if not items:
        raise ConfigError("there are no gradients to analyse.",
                          "run backward first, or pass a batch so the gradients are computed.")
    for s in (*scales, unscale):
        if not (math.isfinite(s) and s > 0):
            raise ConfigError(f"loss scales must be positive and finite, got {s!r}.", "use e.g. 1024.0.")
    read = [_read_layer(n, g, unscale) for n, g in items]
    suggested = suggest_loss_scale(max(layer.max_abs for layer in read), margin)
    all_scales = tuple(dict.fromkeys((1.0, *(float(s) for s in scales),
                                      *((suggested,) if suggested is not None else ()))))
    layers = tuple(_stats(layer, all_scales) for layer in read)
    overall = dataclasses.replace(functools.reduce(operator.add, layers), name="all")
    halves = tuple(sorted({str(g.dtype).removeprefix("torch.") for _, g in items if g.dtype in HALF_DTYPES}))
    return GradientReport(layers, overall, all_scales, suggested, margin, halves)


def model_grads(model: nn.Module, batch: Tensor | Sequence[Any], loss_fn: Callable[..., Tensor] | None = None,
                loss_scale: float = 1.0) -> dict[str, Tensor]:
    """Gradients of ``loss_fn(model(x), y) * loss_scale`` w.r.t. the trainable parameters, by name.

    Uses ``torch.autograd.grad``: the parameters' ``.grad`` are left as they were; so are the buffers (a
    training forward's BatchNorm statistics, an init-done flag) and the random number generators (dropout),
    put back after it: a diagnostic must not change the run it looks at (a trial's histogram
    moved BatchNorm's statistics and fired a Glow's data-dependent init on its batch). The model runs in its
    own dtypes (the usual question: how would *these* gradients fare in fp16?). The batch and the default
    loss are those of :func:`~mixprec.diagnostics.memory.memory_breakdown`.
    """
    x, y = split_batch(batch)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices):
            loss = (loss_fn or default_loss)(call_model(model, x), y)
        _check_loss(loss)
        grads = torch.autograd.grad(loss * loss_scale, [p for _, p in named], allow_unused=True)
    finally:  # after the backward: BatchNorm saved its statistics for it
        with torch.no_grad():
            for b, kept in buffers:
                b.copy_(kept)
    return {n: g for (n, _), g in zip(named, grads, strict=True) if g is not None}


def _check_loss(loss: Any) -> None:
    if not (isinstance(loss, Tensor) and loss.is_floating_point() and loss.numel() == 1):
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else repr(loss)
        raise ConfigError(
            f"loss_fn returned {got}; it must return the loss, a floating one-element tensor.",
            "pass loss_fn=lambda out, y: ... returning the loss from the model's output (e.g. out[1] or "
            "out.loss for a model that computes it); a model whose forward needs more than its inputs "
            "(a hidden state carried between batches): run your own backward and call "
            "grad_exponent_histogram(model) on the gradients it left.",
        )


def grad_exponent_histogram(
    model: nn.Module,
    batch: Tensor | Sequence[Any] | None = None,
    *,
    loss_fn: Callable[..., Tensor] | None = None,
    loss_scale: float | Sequence[float] = (),
    margin: float = DEFAULT_MARGIN,
    grad_scale: float = 1.0,
) -> GradientReport:
    """The :class:`GradientReport` of ``model``'s gradients on ``batch``, or of its current ``.grad``.

    Args:
        batch: ``x`` or ``(x, y)``, ``x`` a tensor or a tuple (dict) of the model's inputs: ``model(*x)``
            (``model(**x)``); None reads the gradients already in ``.grad`` (after a backward).
        loss_scale: the scale(s) at which to evaluate fp16 underflow/overflow, besides 1 and the suggestion.
        margin: headroom factor of the suggested scale (see the module docstring).
        grad_scale: the loss scale the existing ``.grad`` were computed with (with ``batch=None``), e.g.
            ``scaler.get_scale()``; they are divided by it.
    """
    scales = (loss_scale,) if isinstance(loss_scale, int | float) else tuple(loss_scale)
    if batch is None:
        grads: dict[str, Tensor] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return analyze_grads(grads, scales, margin, unscale=grad_scale)
    return analyze_grads(model_grads(model, batch, loss_fn), scales, margin)


# ---------------------------------------------------------------------------------------------------------
# during training
# ---------------------------------------------------------------------------------------------------------


@dataclass
class GradientMonitor:
    """Callback-like recorder of gradient reports during training.

    Call :meth:`after_backward` after every ``backward()`` (and before the optimizer step and
    ``zero_grad``); every ``every``-th call analyses the current ``.grad`` and appends ``(call, report)`` to
    :attr:`reports`. ``loss_scale`` is the scale the gradients carry: a number, or a function such as
    ``scaler.get_scale`` (which syncs with the device, paid only on the analysed steps). Each report also
    evaluates fp16 at that current scale. Between analysed steps a call costs one integer increment.
    :attr:`reports` keeps the latest ``max_reports`` only (oldest dropped first), so a monitor left on
    for a long run holds bounded memory; ``calls`` keeps counting, so each kept report's call number
    still says when it was taken.
    """

    model: nn.Module
    every: int = 100
    loss_scale: float | Callable[[], float] = 1.0
    scales: Sequence[float] = ()
    margin: float = DEFAULT_MARGIN
    reports: list[tuple[int, GradientReport]] = field(default_factory=list)
    calls: int = 0
    # A report holds a few statistics per parameter tensor (a few KiB for a large model): 1000 of them,
    # at the default every=100, cover the last 100k steps in a few MiB -- a whole run, usually, but not a
    # leak in a run that never ends.
    max_reports: int = 1000

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ConfigError(f"every must be >= 1, got {self.every}.", "use every=1 to analyse every step.")
        if self.max_reports < 1:
            raise ConfigError(f"max_reports must be >= 1, got {self.max_reports}.",
                              "keep at least the latest report, e.g. max_reports=1000 (the default).")

    def after_backward(self) -> GradientReport | None:
        """Analyse this step's gradients if it is an ``every``-th call; returns the report, or None."""
        self.calls += 1
        if (self.calls - 1) % self.every:
            return None
        current = float(self.loss_scale() if callable(self.loss_scale) else self.loss_scale)
        grads = {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}
        report = analyze_grads(grads, (*self.scales, current), self.margin, unscale=current)
        self.reports.append((self.calls, report))
        del self.reports[: -self.max_reports]  # the oldest beyond the bound; a no-op below it
        return report

    @property
    def latest(self) -> GradientReport | None:
        return self.reports[-1][1] if self.reports else None


# ---------------------------------------------------------------------------------------------------------
# text
# ---------------------------------------------------------------------------------------------------------


def _pct(fraction: float) -> str:
    if fraction == 0:
        return "0%"
    return f"{100 * fraction:.3g}%" if fraction >= 1e-4 else f"{100 * fraction:.1e}%"


def _scale_text(scale: float) -> str:
    k = math.log2(scale)
    return f"2^{int(k)} = {scale:g}" if k.is_integer() else f"{scale:g}"


def _log2_text(x: float) -> str:
    return f"2^{math.log2(x):.1f}" if x > 0 and math.isfinite(x) else "-"


def _report_table(report: GradientReport, scale: float | None) -> Table:
    from mixprec.diagnostics.tables import PlainTable as Table

    table = Table(title="Gradient magnitudes and what fp16 does to them (fractions of non-zero gradients)",
                  title_justify="left")
    for header in ("parameter", "numel", "zeros", "inf/NaN", "min |g|", "max |g|", "fp16 underflow",
                   "fp16 subnormal"):
        table.add_column(header, justify="left" if header == "parameter" else "right")
    if scale is not None:
        for header in (f"underflow x{scale:g}", f"subnormal x{scale:g}", f"overflow x{scale:g}"):
            table.add_column(header, justify="right")
    for stats in (*report.layers, report.overall):
        if stats is report.overall:
            table.add_section()
        row = [stats.name, f"{stats.numel:,}", f"{stats.zeros:,}", f"{stats.nonfinite:,}",
               _log2_text(stats.min_abs), _log2_text(stats.max_abs)]
        plain = stats.outcome(1.0)
        assert plain is not None  # scale 1 is always evaluated

        def pct(outcome: Any, kind: str, stats: GradStats = stats) -> str:
            return _pct(outcome.fraction(kind)) if stats.nonzero else "-"  # a fraction of nothing: none

        row += [pct(plain, "underflow"), pct(plain, "subnormal")]
        scaled = stats.outcome(scale) if scale is not None else None
        if scaled is not None:
            row += [pct(scaled, k) for k in ("underflow", "subnormal", "overflow")]
        table.add_row(*row, style="bold" if stats is report.overall else None)
    return table


def _nothing_finite(o: GradStats) -> str:
    if o.nonfinite:
        return (f"Every non-zero gradient is inf/NaN ({o.nonfinite:,} of {o.numel:,}): the backward "
                "overflowed at this loss scale (a GradScaler skips this step and lowers the scale), or the "
                "forward made inf/NaN (mixprec.diagnostics.trace_nonfinite finds where).")
    return "Every gradient is exactly zero: nothing reached these parameters, or all of it underflowed."


def _summary(report: GradientReport, scale: float | None) -> str:
    o = report.overall
    counts = (f"{o.nonzero:,} non-zero finite gradients; {o.zeros:,} exact zeros and {o.nonfinite:,} inf/NaN "
              "excluded from the fractions.")
    if report.half_dtypes and o.zeros:
        # a zero of a half gradient may be a value that underflowed in backward: not countable here
        zero_share = _pct(o.zeros / (o.zeros + o.nonzero))
        counts += (f" The gradients are {'/'.join(report.half_dtypes)}: {zero_share} of them are zero, and a "
                   "zero may be a value that already underflowed in backward, which these fractions cannot "
                   "count. Analyse an fp32 copy (copy.deepcopy(model).float()) to see what the half format "
                   "loses.")
    if not o.nonzero:  # no range and no fractions to give: say what there is instead of sentinel values
        return "\n".join([counts, _nothing_finite(o)])
    lines = [
        counts,
        f"|g| from {o.min_abs:.3g} ({_log2_text(o.min_abs)}) to {o.max_abs:.3g} ({_log2_text(o.max_abs)}).",
        _FP16_LIMITS,
    ]
    for s in dict.fromkeys((1.0, *((scale,) if scale is not None else ()))):
        outcome = o.outcome(s)
        if outcome is not None:
            lines.append("  " + outcome.describe())
    bf16 = o.outcome(1.0, "bf16")
    if bf16 is not None:
        lines.append("  " + bf16.describe())
    if report.suggested_scale is None:
        lines.append("No loss scale suggested: there are no non-zero finite gradients.")
    else:
        s = report.suggested_scale
        at = o.outcome(s)
        lines.append(
            f"Suggested loss scale: {_scale_text(s)}, the largest power of two with max|g| x S x "
            f"{report.margin:g} (margin) <= {FP16.max:g}."
        )
        if at is not None:
            lines.append(f"  at it, {_pct(at.fraction('underflow'))} still underflow to 0 and "
                         f"{_pct(at.fraction('subnormal'))} are subnormal.")
    return "\n".join(lines)
