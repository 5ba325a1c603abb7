"""The mixed precision ladder: one model, one data set, one seed, trained once per rung, each rung adding one
technique, so a table and a plot show what each technique is for.

    fp32                  the reference
    fp16 naive            model.half(): fp16 weights, fp16 gradients, the optimizer updates fp16 weights
    fp16 + master         fp32 master weights: the update lands in an fp32 copy and is not rounded away
    + static scale 512    the loss times a fixed scale: small gradients no longer underflow in fp16
    + dynamic scale (O2)  the scale adapts (backs off on overflow, grows when clean): apex O2
    O1 (autocast)         fp32 weights, per-op casts under mixprec.autocast, dynamic scaling: apex O1
    bf16 + master         bf16 has fp32's range, so no scaling; 8 significant bits, so masters matter

Every rung computes its loss in fp32 from the logits (a cast of batch x classes values), so neighbouring
rungs differ only by the technique named. The rungs are data (:data:`LADDER`); :func:`run_ladder` trains them
with the :class:`~mixprec.learner.Learner` and the same callbacks users get.

What is measured (:class:`RungResult`): the last epoch's mean train loss and the final valid accuracy,
the median wall time of a training step (forward to optimizer step), memory counted from the tensors
themselves (:class:`_MemoryProbe`), the share of gradient entries that are zero or subnormal in their dtype
(underflow, :class:`_GradientProbe`), the share of updates rounded away (:class:`_UpdateProbe`), skipped
steps and the final loss scale. The numbers are what happened, whatever theory predicts.
"""

from __future__ import annotations

import copy
import csv
import functools
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mixprec.autocast import autocast
from mixprec.callbacks import DEFAULT_MAX_SCALE, AutocastMixedPrecision, Callback, MixedPrecision, StepTimer
from mixprec.data import DataBunch
from mixprec.errors import ConfigError
from mixprec.learner import Learner, accuracy
from mixprec.scaler import DEFAULT_GROWTH_INTERVAL, DEFAULT_INIT_SCALE

__all__ = [
    "Cast",
    "Rung",
    "LADDER",
    "RUNGS",
    "CompareSettings",
    "RungResult",
    "run_rung",
    "run_ladder",
    "write_outputs",
    "results_table",
    "STATIC_LOSS_SCALE",
    "DYNAMIC_INIT_SCALE",
]

# fastai's to_fp16 default static scale: it moves fp16's underflow threshold from 2**-24 down to 2**-33, and
# a logit gradient (at most 1 per sample, divided by the batch size) times 512 stays far below 65504.
STATIC_LOSS_SCALE = 512.0
# apex O1/O2 and torch.amp start dynamic scaling high and let the first overflows find the level: the
# scaler's own defaults (torch.amp's), not a second copy of them.
DYNAMIC_INIT_SCALE = DEFAULT_INIT_SCALE
DYNAMIC_GROWTH_INTERVAL = DEFAULT_GROWTH_INTERVAL


class Cast(str, Enum):
    """Where the precision of a rung comes from."""

    NONE = "none"  # fp32 throughout
    MODEL = "model"  # the model's weights are half precision (MixedPrecision callback)
    AUTOCAST = "autocast"  # fp32 weights, per-op casts under mixprec.autocast (AutocastMixedPrecision)


@dataclass(frozen=True)
class Rung:
    """One training configuration of the ladder."""

    key: str  # the name --rungs takes
    label: str  # the table row
    lesson: str  # what this rung adds, in one line
    cast: Cast = Cast.NONE
    dtype: torch.dtype = torch.float32
    master: bool = False  # fp32 master weights
    loss_scale: float | None = None  # None: no loss scaling
    dynamic: bool = False

    def __post_init__(self) -> None:
        if (self.cast is Cast.NONE) != (self.dtype is torch.float32):
            raise ConfigError(f"rung {self.key!r}: cast {self.cast.value} with dtype {self.dtype}.",
                              "fp32 rungs use Cast.NONE; half rungs Cast.MODEL or Cast.AUTOCAST.")


LADDER: tuple[Rung, ...] = (
    Rung("fp32", "fp32", "the reference"),
    Rung("fp16-naive", "fp16 naive", "fp16 weights updated in fp16: small updates round away",
         Cast.MODEL, torch.float16),
    Rung("fp16-master", "fp16 + master", "updates land in fp32 copies of the weights",
         Cast.MODEL, torch.float16, master=True),
    Rung("fp16-static", f"+ static scale {STATIC_LOSS_SCALE:g}", "small gradients lifted above underflow",
         Cast.MODEL, torch.float16, master=True, loss_scale=STATIC_LOSS_SCALE),
    Rung("fp16-dynamic", "+ dynamic scale (O2)", "the scale adapts: back off on overflow, grow when clean",
         Cast.MODEL, torch.float16, master=True, loss_scale=DYNAMIC_INIT_SCALE, dynamic=True),
    Rung("o1", "O1 (autocast)", "fp32 weights, per-op casts, dynamic loss scale",
         Cast.AUTOCAST, torch.float16, loss_scale=DYNAMIC_INIT_SCALE, dynamic=True),
    Rung("bf16", "bf16 + master", "fp32's range (no scaling), 8 significant bits",
         Cast.MODEL, torch.bfloat16, master=True),
)
RUNGS: dict[str, Rung] = {r.key: r for r in LADDER}


# ---------------------------------------------------------------------------------------------------
# From a rung to callbacks


def _model_cast(rung: Rung) -> Callback:
    # The naive rung is model.half() whole, BatchNorm included; the others keep BatchNorm fp32 as fastai does.
    return MixedPrecision(
        rung.dtype, rung.loss_scale, dynamic=rung.dynamic, max_noskip=DYNAMIC_GROWTH_INTERVAL,
        max_scale=DEFAULT_MAX_SCALE, master_weights=rung.master, keep_bn_fp32=rung.master,
    )


def _autocast_cast(rung: Rung) -> Callback:
    return AutocastMixedPrecision(rung.dtype, rung.loss_scale, rung.dynamic, DYNAMIC_GROWTH_INTERVAL)


_CALLBACKS: dict[Cast, Callable[[Rung], Callback | None]] = {
    Cast.NONE: lambda rung: None,
    Cast.MODEL: _model_cast,
    Cast.AUTOCAST: _autocast_cast,
}


def _autocast_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``mixprec.autocast(device, dtype)`` cannot run here, or None when it can."""
    try:
        a = torch.ones(2, 2, device=device)
        with autocast(device.type, dtype):
            a @ a
    except (ValueError, RuntimeError, NotImplementedError) as err:
        return f"not available: mixprec.autocast failed ({type(err).__name__}: {err})"
    return None


_AVAILABILITY: dict[Cast, Callable[[torch.device, torch.dtype], str | None]] = {
    Cast.NONE: lambda device, dtype: None,
    Cast.MODEL: lambda device, dtype: None,
    Cast.AUTOCAST: _autocast_unavailable,
}


# ---------------------------------------------------------------------------------------------------
# Measurements


def _storages(tensors: Sequence[Tensor | None]) -> dict[int, int]:
    """Bytes per distinct storage (views and shared tensors counted once)."""
    out: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
    return out


def _state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[Tensor | None]:
    tensors: list[Tensor | None] = []
    params = [*model.parameters(), *(p for g in opt.param_groups for p in g["params"])]
    for p in params:
        tensors += [p, p.grad]
    for state in opt.state.values():
        tensors += [v for v in state.values() if isinstance(v, Tensor) and v.dim() > 0]
    return tensors


class _MemoryProbe(Callback):
    """Memory of the first training step, counted from the tensors (not an allocator peak, which the CPU
    does not report): ``state`` is the bytes of parameters, gradients, fp32 masters and their gradients and
    optimizer state, taken at on_step_end before gradients are cleared; ``saved`` is the bytes of the
    tensors autograd saved for backward during that forward, beyond the parameters, taken while they are
    alive. Distinct storages are counted once. On CUDA, ``peak`` is torch.cuda.max_memory_allocated over
    the whole run."""

    order = 50  # after the callbacks that replace the optimizer at on_train_begin

    def on_train_begin(self) -> None:
        self.saved: dict[int, int] = {}
        self.saved_bytes: int | None = None
        self.state_bytes: int | None = None
        self.hooks: Any = None
        if self.learn.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.learn.device)

    def _pack(self, t: Tensor) -> Tensor:
        self.saved.update(_storages([t]))
        return t

    def on_batch_begin(self) -> None:
        if self.training and self.saved_bytes is None:
            self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self.hooks.__enter__()

    def on_backward_begin(self) -> None:
        if self.hooks is None:
            return
        self.hooks.__exit__(None, None, None)
        self.hooks = None
        # Now, while the saved tensors are alive (their addresses are not yet reused), leave out parameters.
        optimized = [p for g in self.opt.param_groups for p in g["params"]]
        params = _storages([*optimized, *self.model.parameters()])
        self.saved_bytes = sum(n for ptr, n in self.saved.items() if ptr not in params)
        self.saved = {}

    def on_step_end(self) -> None:
        if self.state_bytes is None:
            self.state_bytes = sum(_storages(_state_tensors(self.learn.model, self.opt)).values())

    def on_train_end(self) -> None:
        if self.hooks is not None:
            self.hooks.__exit__(None, None, None)

    def mib(self) -> tuple[float | None, float | None]:
        state, saved = self.state_bytes, self.saved_bytes
        return (None if state is None else state / 2**20, None if saved is None else saved / 2**20)


def _sampled(cb: Callback) -> bool:
    """The probes below look at the last training batch of every epoch: a few samples suffice, and the
    cost stays out of most timed steps (ms/step is a median)."""
    return (cb.iteration + 1) % len(cb.data.train) == 0


class _GradientProbe(Callback):
    """Gradient entries as backward left them in the model (scaled, before unscaling): the share that is
    exactly 0, and the share stored as a subnormal of its dtype (below ``finfo.smallest_normal``: 2**-14 in
    fp16, where a value keeps fewer significant bits, down to 2**-24 and then 0). fp32 shows the zeros that
    are real (e.g. ReLU units inactive for the whole batch); what fp16 adds is underflow."""

    order = 50  # before LossScaling (100) unscales

    def on_train_begin(self) -> None:
        self.zero: list[float] = []
        self.subnormal: list[float] = []

    def on_backward_end(self) -> None:
        if not _sampled(self):
            return
        grads = [p.grad for p in self.learn.model.parameters() if p.grad is not None]
        n = max(1, sum(g.numel() for g in grads))
        self.zero.append(sum(int((g == 0).sum()) for g in grads) / n)
        tiny = [torch.finfo(g.dtype).smallest_normal for g in grads]
        subnormal = sum(int(((g != 0) & (g.abs() < t)).sum()) for g, t in zip(grads, tiny, strict=True))
        self.subnormal.append(subnormal / n)


class _UpdateProbe(Callback):
    """Updates lost to rounding: among the entries the optimizer updates (fp32 masters, or the fp16 weights
    themselves without masters) whose gradient is nonzero, the share whose stored value did not change in
    the step. In fp16, w + lr*g rounds back to w when |lr*g| is below half the spacing of numbers at w."""

    order = 150  # after LossScaling put the unscaled gradients where the optimizer reads them

    def on_train_begin(self) -> None:
        self.lost: list[float] = []
        self.before: list[tuple[Tensor, Tensor, Tensor]] = []

    def on_backward_end(self) -> None:
        if _sampled(self):
            params = [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]
            self.before = [(p, p.detach().clone(), p.grad != 0) for p in params]

    def on_step_end(self) -> None:
        if self.before and not self.learn.step_skipped:
            lost = sum(int(((p == old) & moved).sum()) for p, old, moved in self.before)
            self.lost.append(lost / max(1, sum(int(moved.sum()) for _, _, moved in self.before)))
        self.before = []


# ---------------------------------------------------------------------------------------------------
# Running


@dataclass(frozen=True)
class CompareSettings:
    """What the ladder is trained on. The defaults are the `mixprec compare` demo (see commands/compare)."""

    model: str = "mlp"
    data: str = "digits"
    size: int | None = 28  # digits resized to MNIST's 28x28: the 784-8192-10 MLP's input
    epochs: int = 6
    lr: float = 0.01
    momentum: float = 0.0  # plain SGD: the update is lr * grad, no momentum buffer to accumulate it
    batch_size: int = 64
    seed: int = 0

    @property
    def data_name(self) -> str:
        return self.data if self.size is None else f"{self.data}@{self.size}x{self.size}"

    @property
    def title(self) -> str:
        """One line naming the experiment, for the table, the plots and the report."""
        epochs = f"{self.epochs} epoch{'s' if self.epochs != 1 else ''}"
        return (f"{self.model} on {self.data_name}: {epochs}, SGD lr {self.lr:g} momentum {self.momentum:g}, "
                f"batch {self.batch_size}, seed {self.seed}")

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or not self.lr > 0:
            raise ConfigError(
                f"epochs ({self.epochs}) and batch_size ({self.batch_size}) must be >= 1, lr ({self.lr}) > 0",
                "e.g. --epochs 6 --batch-size 64 --lr 0.01.",
            )


@dataclass(frozen=True)
class RungResult:
    """What one rung did. Numbers are None when the rung did not run (``status`` says why)."""

    key: str
    label: str
    status: str  # "ok", or "not available: ..."
    train_loss: float | None = None  # mean over the last epoch's batches
    valid_loss: float | None = None
    valid_accuracy: float | None = None
    ms_per_step: float | None = None  # median
    state_mib: float | None = None
    saved_mib: float | None = None
    peak_cuda_mib: float | None = None
    zero_grad_pct: float | None = None  # means over the sampled steps (see _GradientProbe, _UpdateProbe)
    subnormal_grad_pct: float | None = None
    lost_update_pct: float | None = None
    skipped_steps: int | None = None
    final_scale: float | None = None  # None: no loss scaling
    seconds: float | None = None
    losses: tuple[float, ...] = field(default=(), repr=False)  # per training batch
    valid_accuracies: tuple[float, ...] = field(default=(), repr=False)  # per epoch

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _sgd(momentum: float) -> Callable[..., torch.optim.Optimizer]:
    return functools.partial(torch.optim.SGD, momentum=momentum)


def run_rung(
    rung: Rung, data: Callable[[], DataBunch], model: nn.Module, settings: CompareSettings
) -> RungResult:
    """Train a copy of ``model`` on fresh ``data()`` (same batches for every rung) as ``rung`` says."""
    device = next(model.parameters()).device
    reason = _AVAILABILITY[rung.cast](device, rung.dtype)
    if reason is not None:
        return RungResult(rung.key, rung.label, reason)
    torch.manual_seed(settings.seed)  # dropout and anything else drawing from the global generator
    probes = StepTimer(), _MemoryProbe(), _GradientProbe(), _UpdateProbe()
    learn = Learner(data(), copy.deepcopy(model), opt_func=_sgd(settings.momentum), metrics=[accuracy],
                    callbacks=probes, silent=True)
    cb = _CALLBACKS[rung.cast](rung)
    if cb is not None:
        learn.add_cb(cb)
    start = time.perf_counter()
    learn.fit(settings.epochs, settings.lr)
    seconds = time.perf_counter() - start
    return _result(rung, learn, probes, seconds)


def _pct(samples: list[float]) -> float | None:
    return 100 * statistics.fmean(samples) if samples else None


def _result(
    rung: Rung,
    learn: Learner,
    probes: tuple[StepTimer, _MemoryProbe, _GradientProbe, _UpdateProbe],
    seconds: float,
) -> RungResult:
    timer, memory, grads, updates = probes
    rec, scaler = learn.recorder, learn.scaler
    last = rec.epochs[-1]
    state, saved = memory.mib()
    peak = torch.cuda.max_memory_allocated(learn.device) / 2**20 if learn.device.type == "cuda" else None
    return RungResult(
        rung.key, rung.label, "ok",
        train_loss=last.train_loss,
        valid_loss=last.valid_loss,
        valid_accuracy=last.metric("accuracy"),
        ms_per_step=1e3 * statistics.median(timer.times),
        state_mib=state,
        saved_mib=saved,
        peak_cuda_mib=peak,
        zero_grad_pct=_pct(grads.zero),
        subnormal_grad_pct=_pct(grads.subnormal),
        lost_update_pct=_pct(updates.lost),
        skipped_steps=rec.skipped_steps,
        final_scale=scaler.get_scale() if scaler is not None and scaler.is_enabled() else None,
        seconds=seconds,
        losses=tuple(rec.losses),
        valid_accuracies=tuple(r.metric("accuracy") for r in rec.epochs),
    )


def run_ladder(
    rungs: Sequence[Rung],
    data: Callable[[], DataBunch],
    model: nn.Module,
    settings: CompareSettings,
    on_result: Callable[[RungResult], None] | None = None,
) -> list[RungResult]:
    """Train every rung from the same initial ``model`` on the same batches; ``on_result`` sees each result
    as it comes (for progress output)."""
    results = []
    for rung in rungs:
        result = run_rung(rung, data, model, settings)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


# ---------------------------------------------------------------------------------------------------
# Output


def _num(value: float | None, fmt: str) -> str:
    if value is None:
        return "—"
    return "nan" if math.isnan(value) else format(value, fmt)


# column header -> how a result fills it
COLUMNS: dict[str, Callable[[RungResult], str]] = {
    "rung": lambda r: r.label,
    "train loss": lambda r: _num(r.train_loss, ".4f"),
    "valid acc %": lambda r: _num(None if r.valid_accuracy is None else 100 * r.valid_accuracy, ".2f"),
    "ms/step": lambda r: _num(r.ms_per_step, ".1f"),
    "state MiB": lambda r: _num(r.state_mib, ".1f"),
    "saved MiB": lambda r: _num(r.saved_mib, ".2f"),
    "grads 0 %": lambda r: _num(r.zero_grad_pct, ".2f"),
    "grads subn. %": lambda r: _num(r.subnormal_grad_pct, ".2f"),
    "upd. lost %": lambda r: _num(r.lost_update_pct, ".2f"),
    "skipped": lambda r: "—" if r.skipped_steps is None else str(r.skipped_steps),
    "final scale": lambda r: _num(r.final_scale, "g"),
}

NOTES = (
    "train loss: mean over the last epoch's batches; valid acc %: after the last epoch. 'master': fp32 "
    "master weights; 'scale': loss scale.",
    "ms/step: median wall time of a training step (forward, backward, optimizer step).",
    "state MiB: parameters + gradients + fp32 masters and their gradients + optimizer state, counted from "
    "the tensors after the first step; saved MiB: tensors autograd saved for backward in that step, beyond "
    "the parameters. Not an allocator peak (the CPU reports none).",
    "grads 0 % / subn. %: gradient entries exactly 0, or stored as subnormals of their dtype (fewer "
    "significant bits), after backward and before unscaling; fp32 shows the zeros that are real.",
    "upd. lost %: entries with a nonzero gradient whose optimizer-held value (fp32 master, or the "
    "fp16 weight itself) did not change in the step: the update rounded away.",
    "The last three are sampled on the last batch of each epoch.",
)


def results_table(results: Sequence[RungResult]) -> list[dict[str, str]]:
    """One dict per rung: column header -> text (the rows of every output format)."""
    rows = []
    for r in results:
        row = {name: cell(r) for name, cell in COLUMNS.items()}
        if not r.ok:
            row = {name: (r.label if name == "rung" else "—") for name in COLUMNS} | {"train loss": r.status}
        rows.append(row)
    return rows


def _markdown(rows: list[dict[str, str]], settings: CompareSettings, notes: Sequence[str]) -> str:
    header = list(COLUMNS)
    lines = [
        f"# mixprec compare: {settings.title}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|",
    ]
    lines += ["| " + " | ".join(row[h] for h in header) + " |" for row in rows]
    return "\n".join([*lines, "", *(f"- {n}" for n in notes), ""])


def _ema(values: Sequence[float], beta: float = 0.9) -> list[float]:
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))  # bias-corrected, as fastai's smoothed loss
    return out


def plot_ladder(results: Sequence[RungResult], path: Path, title: str) -> Path:
    """One PNG: every rung's train loss per step (smoothed), its gap to the fp32 rung on the same batches
    (when fp32 ran), and valid accuracy per epoch."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ran = [r for r in results if r.ok]
    reference = next((r for r in ran if r.key == "fp32"), None)
    fig = Figure(figsize=(15, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, gap_ax, acc_ax = fig.subplots(1, 3, width_ratios=(3, 3, 2))
    for r in ran:
        (line,) = loss_ax.plot(_ema(r.losses), lw=1.3, label=r.label)
        if reference is not None:
            gap = [a - b for a, b in zip(r.losses, reference.losses, strict=False)]
            gap_ax.plot(_ema(gap), lw=1.3, color=line.get_color())
        epochs = range(1, len(r.valid_accuracies) + 1)
        acc_ax.plot(epochs, [100 * a for a in r.valid_accuracies], "o-", lw=1.3, color=line.get_color())
    loss_ax.set(xlabel="training step", ylabel="train loss (EMA 0.9, bias-corrected)", yscale="log")
    gap_ax.set(xlabel="training step", ylabel="train loss minus fp32's, same batches (EMA 0.9)")
    gap_ax.axhline(0.0, color="black", lw=0.6)
    if reference is None:
        gap_ax.set_title("(no fp32 rung to compare with)", fontsize=9)
    acc_ax.set(xlabel="epoch", ylabel="valid accuracy %")
    loss_ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return path


def write_outputs(
    results: Sequence[RungResult], settings: CompareSettings, out: Path, notes: Sequence[str] = NOTES
) -> dict[str, Path]:
    """compare.csv, compare.json (with every per-step loss), compare.md and compare.png under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    rows = results_table(results)
    paths = {kind: out / f"compare.{kind}" for kind in ("csv", "json", "md", "png")}
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    payload = {
        "settings": asdict(settings),
        "notes": list(notes),
        "results": [asdict(r) | {"losses": list(r.losses)} for r in results],
    }
    paths["json"].write_text(json.dumps(payload, indent=1, allow_nan=True) + "\n")
    paths["md"].write_text(_markdown(rows, settings, notes))
    plot_ladder(results, paths["png"], settings.title)
    return paths
