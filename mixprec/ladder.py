"""The mixed precision ladder: one model, one data set, one seed, trained once per rung, each rung adding one
technique, so a table and a plot show what each technique is for.

    fp32                  the reference
    fp16 naive            model.half(): fp16 weights, fp16 gradients, the optimizer updates fp16 weights
    fp16 + master         fp32 master weights: the update lands in an fp32 copy and is not rounded away
    + static scale 512    the loss times a fixed scale: small gradients no longer underflow in fp16
    + dynamic scale (O2)  the scale adapts (backs off on overflow, grows when clean): apex O2
    O1 (autocast)         fp32 weights, per-op casts under mixprec.autocast, dynamic scaling: apex O1
    pure bf16             bf16 weights updated in bf16: fp32's range, 8 significant bits
    + stochastic rounding the update rounded up or down at random: unbiased, so small updates add up
    + Kahan               a bf16 compensation keeps what the weight could not absorb
    16+16 split           the fp32 master's low 16 bits beside the bf16 weight: exact, 4 bytes/param
    bf16 + master         bf16 model with fp32 masters

A rung is a :class:`~mixprec.recipe.Recipe` (a preset of :data:`~mixprec.recipe.RECIPES`), plus, for the
pure bf16 rungs, the :class:`~mixprec.low_precision.LowPrecisionOptimizer` mode that writes updates back.
Every rung computes its loss in fp32 from the logits, so neighbouring rungs differ only by the technique
named. :func:`run_ladder` trains them with the :class:`~mixprec.learner.Learner` and the callbacks users get;
:mod:`mixprec.ladder_probes` measures; :mod:`mixprec.ladder_output` writes the table, notes and files.

Two experiments (:data:`EXPERIMENTS`): the demo as it is, and the same data with small gradients (the loss
times 2**-16, the learning rate times 2**16: the same fp32 training step for step), where fp16 gradients
underflow and loss scaling is what keeps fp16 training with fp32.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec.autocast import autocast
from mixprec.callbacks import Callback, StepTimer, callback_for
from mixprec.data import DataBunch
from mixprec.diagnostics.memory import check_update
from mixprec.errors import ConfigError
from mixprec.hardware import half_arithmetic
from mixprec.ladder_probes import GradientProbe, MemoryProbe, UpdateProbe
from mixprec.learner import Learner, accuracy
from mixprec.low_precision import LowPrecisionOptimizer, UpdateMode
from mixprec.recipe import FASTAI_LOSS_SCALE, RECIPES, Recipe

__all__ = [
    "Rung",
    "LADDER",
    "PURE_BF16",
    "DEMO_RUNGS",
    "RUNGS",
    "ALL_RUNGS",
    "CompareSettings",
    "Experiment",
    "EXPERIMENTS",
    "RungResult",
    "callbacks_for",
    "weighted_loss",
    "run_rung",
    "run_ladder",
]


@dataclass(frozen=True)
class Rung:
    """One training configuration of the ladder: a recipe, and what the table says about it."""

    key: str  # the name --rungs takes (the recipe's name, or recipe+update mode)
    label: str  # the table row
    lesson: str  # what this rung adds, in one line
    recipe: Recipe
    update: UpdateMode | None = None  # pure half weights written back by LowPrecisionOptimizer in this mode
    bases: tuple[str, ...] = ()  # the rungs it adds its technique to, first present one wins (the table
    # explains the difference to it, from measured values)
    shows: tuple[str, ...] = ()  # the measures its lesson is about (ladder_output.MEASURES' keys)

    def __post_init__(self) -> None:
        check_update(self.recipe, self.update)


def _pure(mode: UpdateMode, label: str, lesson: str, base: str, shows: tuple[str, ...]) -> Rung:
    return Rung(f"pure-bf16+{mode.value}", label, lesson, RECIPES["pure-bf16"], mode, (base,), shows)


LADDER: tuple[Rung, ...] = (
    Rung("fp32", "fp32", "the reference", RECIPES["fp32"]),
    Rung("fp16-naive", "fp16 naive", "fp16 weights updated in fp16: small updates round away",
         # grads 0 too: in the underflow experiment the gradients that flush to 0 are this rung's loss
         RECIPES["pure-fp16"], bases=("fp32",), shows=("zero", "lost", "loss")),
    Rung("fp16-master", "fp16 + master", "updates land in fp32 copies of the weights",
         RECIPES["fp16-master"], bases=("fp16-naive", "fp32"), shows=("lost", "bytes")),
    Rung("fp16-static", f"+ static scale {FASTAI_LOSS_SCALE:g}", "small gradients lifted above underflow",
         RECIPES["fp16-static"], bases=("fp16-master", "fp32"), shows=("zero", "subnormal")),
    # apex O2: the dynamic scale starts at 2**16 and the first overflows find the level (fastai's fp16-dynamic
    # starts at 512 and grows only after 1000 clean steps: within the demo, the static rung again).
    Rung("fp16-dynamic", "+ dynamic scale (O2)", "the scale adapts: back off on overflow, grow when clean",
         RECIPES["O2"], bases=("fp16-static", "fp32"), shows=("zero", "subnormal", "scale")),
    Rung("o1", "O1 (autocast)", "fp32 weights, per-op casts, dynamic loss scale",
         RECIPES["O1"], bases=("fp32",), shows=("bytes", "ms")),
    Rung("bf16", "bf16 + master", "fp32's range (no scaling), 8 significant bits, fp32 masters",
         RECIPES["bf16"], bases=("pure-bf16+split", "fp32"), shows=("lost", "bytes", "ms")),
)  # fmt: skip

# Issue 11's ladder: what fp32 masters buy in bf16, and the cheaper ways to buy it.
PURE_BF16: tuple[Rung, ...] = (
    Rung("pure-bf16", "pure bf16", "bf16 weights updated in bf16: updates below half an ulp round away",
         RECIPES["pure-bf16"], bases=("fp32",), shows=("lost", "loss", "bytes")),
    _pure(UpdateMode.STOCHASTIC, "+ stochastic rounding", "rounded up or down at random: unbiased",
          "pure-bf16", ("lost", "loss")),
    _pure(UpdateMode.KAHAN, "+ Kahan", "a bf16 compensation carries what the weight could not absorb",
          "pure-bf16+stochastic", ("lost", "bytes")),
    _pure(UpdateMode.SPLIT, "16+16 split", "the fp32 master's low 16 bits kept: exact",
          "pure-bf16+kahan", ("lost", "bytes")),
)  # fmt: skip

RUNGS: dict[str, Rung] = {r.key: r for r in LADDER}  # the mixed precision ladder
ALL_RUNGS: dict[str, Rung] = {r.key: r for r in (*LADDER, *PURE_BF16)}
# The demo's order: the fp16 story, then the bf16 one ending at fp32 masters.
DEMO_RUNGS: tuple[str, ...] = (*(r.key for r in LADDER[:-1]), *(r.key for r in PURE_BF16), "bf16")


# ---------------------------------------------------------------------------------------------------
# From a rung to callbacks


class LowPrecisionUpdate(Callback):
    """Wrap the learner's optimizer in a :class:`~mixprec.low_precision.LowPrecisionOptimizer` once the
    model is half (pure half weights, no masters)."""

    order = 110  # after MixedPrecision (100) cast the model at on_train_begin

    def __init__(self, mode: UpdateMode) -> None:
        self.mode = mode

    def on_train_begin(self) -> None:
        self.learn.opt = LowPrecisionOptimizer(self.learn.opt, self.mode)


def callbacks_for(rung: Rung) -> list[Callback]:
    """The callbacks that train as ``rung`` says: the recipe's own (:func:`mixprec.callbacks.callback_for`:
    none for fp32), plus :class:`LowPrecisionUpdate` for an update mode."""
    mixed = callback_for(rung.recipe)
    if mixed is None:
        return []
    return [mixed] if rung.update is None else [mixed, LowPrecisionUpdate(rung.update)]


def _autocast_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``mixprec.autocast(device, dtype)`` cannot run here, or None when it can."""
    try:
        a = torch.ones(2, 2, device=device)
        with autocast(device.type, dtype):
            a @ a
    except (ValueError, RuntimeError, NotImplementedError) as err:
        return f"not available: mixprec.autocast failed ({type(err).__name__}: {err})"
    return None


def arithmetic_of(recipe: Recipe, device: torch.device) -> str:
    """Which arithmetic the rung's GEMMs run in here, as mixprec.hardware decided it: "fp32", or e.g.
    "bf16 emulated" (fp32 kernels on bf16-rounded inputs) / "fp16 native"."""
    dtype = recipe.half_dtype
    if dtype is None:
        return "fp32"
    name = "fp16" if dtype == torch.float16 else "bf16"
    return f"{name} {half_arithmetic(device.type, dtype).arithmetic.value}"


# ---------------------------------------------------------------------------------------------------
# Settings and experiments


# CompareSettings field -> (valid?, the rule in words, a valid value as `mixprec compare` takes it). lr and
# momentum must be finite: nan or inf trains on NaN losses to the end and exits as if all went well.
_SETTING_RULES: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "epochs": (lambda v: v >= 1, ">= 1", "--epochs 6"),
    "batch_size": (lambda v: v >= 1, ">= 1", "--batch-size 64"),
    "lr": (lambda v: math.isfinite(v) and v > 0, "a finite number > 0", "--lr 0.01"),
    "momentum": (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0", "--momentum 0.9"),
}


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
    hidden: int | None = None  # the MLP's hidden width; None: the model's default (8192)
    # The loss is multiplied by this before backward. A power of two changes no fp32 value but the
    # exponent, so with lr divided by it fp32 takes the same steps; in fp16 the gradients move down.
    loss_weight: float = 1.0

    @property
    def data_name(self) -> str:
        return self.data if self.size is None else f"{self.data}@{self.size}x{self.size}"

    @property
    def model_name(self) -> str:
        return self.model if self.hidden is None else f"{self.model} (hidden {self.hidden})"

    @property
    def title(self) -> str:
        """One line naming the experiment, for the table, the plots and the report."""
        epochs = f"{self.epochs} epoch{'s' if self.epochs != 1 else ''}"
        weight = "" if self.loss_weight == 1 else f", loss x 2^{math.log2(self.loss_weight):g}"
        return (f"{self.model_name} on {self.data_name}: {epochs}, SGD lr {self.lr:g} momentum "
                f"{self.momentum:g}, batch {self.batch_size}, seed {self.seed}{weight}")

    def __post_init__(self) -> None:
        bad = [(name, rule, example) for name, (valid, rule, example) in _SETTING_RULES.items()
               if not valid(getattr(self, name))]
        if bad:  # only the settings that are wrong, each with a value the command line can take
            raise ConfigError("; ".join(f"{name} must be {rule}, got {getattr(self, name)!r}"
                                        for name, rule, _ in bad),
                              f"e.g. {' '.join(example for *_, example in bad)}.")
        if not (self.loss_weight > 0 and math.log2(self.loss_weight).is_integer()):
            raise ConfigError(f"loss_weight must be a power of two, got {self.loss_weight!r}.",
                              "e.g. 2**-16: a power of two changes only the exponent (exact in fp32).")

    def build_model(self, data: DataBunch) -> nn.Module:
        """The initial model every rung copies (seeded)."""
        from mixprec.models import build

        torch.manual_seed(self.seed)
        return build(self.model, data, **({} if self.hidden is None else {"n_hidden": self.hidden}))


@dataclass(frozen=True)
class Experiment:
    """A named ladder run: which rungs, and how its settings derive from the demo's."""

    name: str  # file stem of its outputs
    why: str  # what it shows, one line
    rungs: tuple[str, ...]
    derive: Callable[[CompareSettings], CompareSettings]


# The small-gradient experiment: 2**-16 moves the typical gradient of this model (2**-10 .. 2**-20) below
# fp16's smallest subnormal 2**-24, so unscaled fp16 flushes most of it to 0; fastai's 512 = 2**9 lifts most
# of it back. The MLP is narrowed to 1024 units so the experiment adds seconds, not a minute, to the demo.
UNDERFLOW_LOSS_WEIGHT = 2.0**-16
UNDERFLOW_HIDDEN = 1024


def _small_gradients(s: CompareSettings) -> CompareSettings:
    hidden = UNDERFLOW_HIDDEN if s.model == "mlp" else s.hidden
    return dataclasses.replace(s, loss_weight=s.loss_weight * UNDERFLOW_LOSS_WEIGHT,
                               lr=s.lr / UNDERFLOW_LOSS_WEIGHT, hidden=hidden)


EXPERIMENTS: dict[str, Experiment] = {
    "compare": Experiment("compare", "the demo: every technique on the 784-8192-10 MLP", DEMO_RUNGS,
                          lambda s: s),
    "underflow": Experiment(
        "underflow",
        "small gradients (loss x 2^-16, lr x 2^16: the same fp32 steps): where loss scaling matters",
        ("fp32", "fp16-naive", "fp16-master", "fp16-static", "fp16-dynamic"), _small_gradients,
    ),
}


@dataclass(frozen=True)
class RungResult:
    """What one rung did. Numbers are None when the rung did not run (``status`` says why)."""

    key: str
    label: str
    status: str  # "ok", or "not available: ..."
    train_loss: float | None = None  # mean over the last epoch's batches (divided by the loss weight)
    valid_loss: float | None = None
    valid_accuracy: float | None = None
    ms_per_step: float | None = None  # median
    state_mib: float | None = None
    saved_mib: float | None = None
    peak_cuda_mib: float | None = None
    zero_grad_pct: float | None = None  # means over the sampled steps (see mixprec.ladder_probes)
    subnormal_grad_pct: float | None = None
    lost_update_pct: float | None = None
    skipped_steps: int | None = None
    final_scale: float | None = None  # None: no loss scaling
    seconds: float | None = None
    losses: tuple[float, ...] = field(default=(), repr=False)  # per training batch
    valid_accuracies: tuple[float, ...] = field(default=(), repr=False)  # per epoch
    arithmetic: str = "fp32"  # what the GEMMs ran in (arithmetic_of)
    bytes_per_param: float | None = None  # weights + grads + masters/extra + optimizer state
    flushed_grad_pct: float | None = None  # nonzero gradients below fp16's smallest subnormal / 2
    below_fp16_normal_pct: float | None = None  # nonzero gradients below fp16's smallest normal
    predicted_lost_pct: float | None = None  # updates below half the spacing at the weight (theory)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _sgd(momentum: float) -> Callable[..., torch.optim.Optimizer]:
    return functools.partial(torch.optim.SGD, momentum=momentum)


def weighted_loss(weight: float) -> Callable[[Tensor, Tensor], Tensor]:
    """Cross-entropy times ``weight`` (a power of two: exact in fp32; see CompareSettings.loss_weight)."""
    if weight == 1:
        return F.cross_entropy
    return lambda pred, target: F.cross_entropy(pred, target) * weight


def run_rung(
    rung: Rung, data: Callable[[], DataBunch], model: nn.Module, settings: CompareSettings
) -> RungResult:
    """Train a copy of ``model`` on fresh ``data()`` (same batches for every rung) as ``rung`` says."""
    device = next(model.parameters()).device
    if rung.recipe.autocast_dtype is not None:
        reason = _autocast_unavailable(device, rung.recipe.autocast_dtype)
        if reason is not None:
            return RungResult(rung.key, rung.label, reason)
    torch.manual_seed(settings.seed)  # dropout and anything else drawing from the global generator
    probes = StepTimer(), MemoryProbe(), GradientProbe(), UpdateProbe()
    learn = Learner(data(), copy.deepcopy(model), loss_func=weighted_loss(settings.loss_weight),
                    opt_func=_sgd(settings.momentum), metrics=[accuracy], callbacks=probes, silent=True)
    for cb in callbacks_for(rung):
        learn.add_cb(cb)
    if learn.device.type == "cuda":  # each rung's own peak, not the largest of the rungs so far
        torch.cuda.reset_peak_memory_stats(learn.device)
    start = time.perf_counter()
    learn.fit(settings.epochs, settings.lr)
    seconds = time.perf_counter() - start
    return _result(rung, learn, probes, seconds, settings.loss_weight)


def _pct(samples: list[float]) -> float | None:
    return 100 * statistics.fmean(samples) if samples else None


def _result(
    rung: Rung,
    learn: Learner,
    probes: tuple[StepTimer, MemoryProbe, GradientProbe, UpdateProbe],
    seconds: float,
    loss_weight: float,
) -> RungResult:
    timer, memory, grads, updates = probes
    rec, scaler = learn.recorder, learn.scaler
    last = rec.epochs[-1]
    state, saved = memory.mib()
    peak = torch.cuda.max_memory_allocated(learn.device) / 2**20 if learn.device.type == "cuda" else None
    return RungResult(
        rung.key, rung.label, "ok",
        train_loss=last.train_loss / loss_weight,  # exact: a power of two
        valid_loss=last.valid_loss / loss_weight,
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
        losses=tuple(x / loss_weight for x in rec.losses),
        valid_accuracies=tuple(r.metric("accuracy") for r in rec.epochs),
        arithmetic=arithmetic_of(rung.recipe, learn.device),
        bytes_per_param=memory.per_param,
        flushed_grad_pct=_pct(grads.flushed),
        below_fp16_normal_pct=_pct(grads.below_fp16_normal),
        predicted_lost_pct=_pct(updates.predicted),
    )  # fmt: skip


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


# The output writers live in mixprec.ladder_output (which imports this module); their old names here
# resolve lazily, so `from mixprec.ladder import write_outputs` keeps working without an import cycle.
_MOVED = frozenset({"COLUMNS", "NOTES", "results_table", "plot_ladder", "write_outputs"})


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        from mixprec import ladder_output

        return getattr(ladder_output, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
