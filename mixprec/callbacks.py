"""Callbacks of the :class:`~mixprec.learner.Learner` loop: the base class, mixed precision, recording.

The loop fires fastai v1's events, in this order (:data:`EVENTS`; validation batches fire only
on_batch_begin, on_loss_begin and on_batch_end, with ``learn.training`` False)::

    on_train_begin
      on_epoch_begin
        on_batch_begin      xb, yb are on the device
        (forward)           pred = model(xb)
        on_loss_begin       pred may be changed (e.g. cast to fp32)
        (loss)              loss = loss_func(pred, yb); loss_grad = loss
        on_backward_begin   loss_grad may be changed (e.g. scaled)
        (backward)
        on_backward_end     gradients are ready; raise CancelStepException to skip the step
        (step)              scaler.step(opt) with a loss scaler (skips on inf/NaN), else opt.step()
        on_step_end         runs whether the step was taken or skipped (learn.step_skipped)
        (zero_grad)
        on_batch_end
      on_epoch_end          after validation: learn.valid_loss, learn.valid_metrics
    on_train_end            also when training stopped with an exception

A callback reads the learner's state as its own attributes (``self.loss`` is ``self.learn.loss``) and writes
it through ``self.learn``. Callbacks run in ascending ``order``.

Mixed precision as callbacks, each event one short method over the core parts (``GradScaler``,
``MasterWeights``, ``mixprec.autocast``): no numerics live here.

- :class:`MixedPrecision` -- fastai v1's ``to_fp16``: half model (BatchNorm fp32), fp32 master weights,
  loss scaling. apex's O2.
- :class:`AutocastMixedPrecision` -- fp32 weights, forward under a cast policy, loss scaling. apex's O1,
  fastai v2's ``MixedPrecision``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec.amp import DEFAULT_MAX_LOSS_SCALE, DYNAMIC, Properties, master_params
from mixprec.autocast import autocast, half_compute
from mixprec.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from mixprec.errors import ConfigError
from mixprec.master import HALF_DTYPES, Converted, MasterWeights, fp32_originals, model_to_half
from mixprec.scaler import DEFAULT_GROWTH_INTERVAL, DEFAULT_INIT_SCALE, GradScaler, HasMasterGrads, OptState

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

    from mixprec.learner import Learner

__all__ = [
    "EVENTS",
    "Callback",
    "CancelStepException",
    "CancelTrainException",
    "LossScaling",
    "MixedPrecision",
    "AutocastMixedPrecision",
    "Recorder",
    "EpochResult",
    "ProgressBar",
    "OneCycleScheduler",
    "StepTimer",
    "Checkpoint",
    "DEFAULT_MAX_SCALE",
    "DEFAULT_MAX_NOSKIP",
    "mixprec_callback_for",
    "model_to_half",
    "model_to_float",
]

# The loop's events, in the order they fire (see the module docstring).
EVENTS: tuple[str, ...] = (
    "on_train_begin",
    "on_epoch_begin",
    "on_batch_begin",
    "on_loss_begin",
    "on_backward_begin",
    "on_backward_end",
    "on_step_end",
    "on_batch_end",
    "on_epoch_end",
    "on_train_end",
)

# fastai v1's to_fp16 defaults, with their reasons:
DEFAULT_MAX_NOSKIP = 1000  # clean steps before a dynamic scale doubles: overflow is rare once tuned
DEFAULT_MAX_SCALE = DEFAULT_MAX_LOSS_SCALE  # apex's ceiling too: beyond it a scaled 2**-24 would already be 1


class CancelStepException(Exception):
    """Raised in on_backward_end to skip this iteration's optimizer step (e.g. inf/NaN gradients).

    The loop catches it; on_step_end still runs, with ``learn.step_skipped`` True."""


class CancelTrainException(Exception):
    """Raised by a callback to stop training early; on_train_end still runs."""


class Callback:
    """Base class: override the events you need (:data:`EVENTS`); every event is a no-op here."""

    order: int = 0  # callbacks run in ascending order
    learn: Learner

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the callback does not have: read them from the learner (fastai v2 style).
        if name == "learn" or "learn" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(self.__dict__["learn"], name)

    def on_train_begin(self) -> None: ...
    def on_epoch_begin(self) -> None: ...
    def on_batch_begin(self) -> None: ...
    def on_loss_begin(self) -> None: ...
    def on_backward_begin(self) -> None: ...
    def on_backward_end(self) -> None: ...
    def on_step_end(self) -> None: ...
    def on_batch_end(self) -> None: ...
    def on_epoch_end(self) -> None: ...
    def on_train_end(self) -> None: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# ---------------------------------------------------------------------------------------------------
# Mixed precision


def scaler_saw_step(scaler: GradScaler | None, optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether ``scaler`` unscaled or stepped ``optimizer`` in this iteration and has not been updated since.

    Read from the scaler's own per-optimizer stage (torch's record, same keys); ``.get`` so that asking
    does not create a record. No sync."""
    if scaler is None or optimizer is None:
        return False
    return scaler.stage(optimizer) is not OptState.READY


class LossScaling(Callback):
    """Loss scaling with a :class:`~mixprec.scaler.GradScaler`: make the scaler (``learn.scaler``, which the
    learner's step goes through: it skips on inf/NaN), scale the loss, unscale the gradients (into the fp32
    masters), clip them when ``clip`` is set, update the scale.

    ``loss_scale=None`` turns scaling off (``GradScaler(enabled=False)``: every call a pass-through).
    """

    # Late: the loss is scaled after other callbacks changed it; callbacks ordered after this one see the
    # gradients unscaled (in the fp32 masters), those before it see them scaled, as backward left them.
    order = 100

    def __init__(
        self,
        loss_scale: float | None,
        dynamic: bool = True,
        max_noskip: int = DEFAULT_MAX_NOSKIP,
        max_scale: float | None = DEFAULT_MAX_SCALE,
        clip: float | None = None,
        allow_fp16_grads: bool = False,
    ) -> None:
        self.loss_scale, self.dynamic, self.max_noskip = loss_scale, dynamic, max_noskip
        self.max_scale, self.clip, self.allow_fp16_grads = max_scale, clip, allow_fp16_grads
        self.scaler: GradScaler | None = None

    def _make_scaler(self) -> GradScaler:
        device = next(self.learn.model.parameters()).device.type
        return GradScaler(
            device,
            init_scale=self.loss_scale if self.loss_scale is not None else 1.0,
            growth_interval=self.max_noskip,
            enabled=self.loss_scale is not None,
            dynamic=self.dynamic,
            max_scale=self.max_scale if self.dynamic else None,
            allow_fp16_grads=self.allow_fp16_grads,
            # the Recorder reads an epoch's scales from this ring buffer once per epoch: it must hold them all
            history_size=max(1, len(self.data.train)),
        )

    def _start_scaling(self) -> None:
        self.learn.scaler = self.scaler = self._make_scaler()

    def on_backward_begin(self) -> None:
        self.learn.loss_grad = self.scaler.scale(self.loss_grad)

    def on_backward_end(self) -> None:
        # Unscale here, not inside the learner's scaler.step(opt): callbacks after this one (and clipping)
        # see the true fp32 gradients where the optimizer reads them. unscale_ copies the half gradients to
        # the fp32 masters, divides by the scale and records inf/NaN on the device: no sync. The step then
        # skips on that record (on the device for a fused optimizer).
        if self.scaler.is_enabled():
            self.scaler.unscale_(self.opt)
        elif isinstance(self.opt, HasMasterGrads):
            self.opt.copy_grads_to_master()  # no scaler to do it (bf16): same contract for later callbacks
        if self.clip is not None:
            nn.utils.clip_grad_norm_(list(master_params(self.opt)), self.clip)

    def on_step_end(self) -> None:
        # An earlier callback may have cancelled the step before the scaler saw it: nothing to update.
        if scaler_saw_step(self.scaler, self.opt):
            self.scaler.update()  # back off after an overflow, grow after max_noskip clean steps


def model_to_float(converted: list[Converted], masters: MasterWeights | None) -> None:
    """Undo :func:`model_to_half`; parameters with an fp32 master take the master's value, not the
    rounded half value (so leaving mixed precision loses nothing the optimizer accumulated)."""
    values = {}
    if masters is not None:
        values = {id(p): m for p, m in zip(masters.model_params(), masters.master_views(), strict=True)}
    with torch.no_grad():
        for c in converted:
            tensor = getattr(c.module, c.name)
            if c.is_param:
                master = values.get(id(tensor), tensor)
                tensor.data = master.detach().to(c.dtype, copy=True)
                tensor.grad = None
            else:
                setattr(c.module, c.name, tensor.to(c.dtype))


class MixedPrecision(LossScaling):
    """fastai v1's mixed precision training: a half model, fp32 master weights, loss scaling (apex O2).

    Events: on_train_begin -- model to ``dtype`` with BatchNorm kept fp32, fp32 masters of the half
    parameters (from the fp32 values, not their rounding); on_batch_begin -- inputs to ``dtype``;
    forward under ``mixprec.autocast.half_compute`` (fp16 GEMMs as a tensor core computes them, on a CPU
    too); on_loss_begin -- output to fp32, so the loss and its reductions run
    in fp32; on_backward_begin -- scale the loss; on_backward_end -- gradients to the masters, unscaled and
    checked (no sync), clipped with ``clip``; the learner's step is ``scaler.step(masters)``: skipped on
    inf/NaN, else the masters updated and copied back into the model
    (``MasterWeights.step``); the loop zeroes both gradients; on_step_end -- update
    the scale; on_train_end -- the model back to fp32, holding the masters' values.

    Args:
        dtype: torch.float16 or torch.bfloat16.
        loss_scale: the initial (dynamic) or fixed (static) loss scale; None: no loss scaling (bf16 has
            fp32's range and needs none).
        flat_master: one contiguous fp32 master buffer per param group (one long optimizer kernel).
        dynamic: adjust the scale: halve it on overflow, double it after ``max_noskip`` clean steps.
        max_noskip: clean steps before the scale doubles.
        clip: clip the masters' gradient norm to this, after unscaling.
        max_scale: the dynamic scale never grows beyond this.
        loss_fp32: compute the loss from an fp32 copy of the output.
        master_weights: False lets the optimizer update the half parameters themselves (apex O3; the
            "naive fp16" rung of ``mixprec compare``): updates below half an ulp of a weight are lost.
        keep_bn_fp32: keep BatchNorm parameters and statistics in fp32.
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.float16,
        loss_scale: float | None = 512.0,
        flat_master: bool = False,
        dynamic: bool = True,
        max_noskip: int = DEFAULT_MAX_NOSKIP,
        clip: float | None = None,
        max_scale: float | None = DEFAULT_MAX_SCALE,
        loss_fp32: bool = True,
        master_weights: bool = True,
        keep_bn_fp32: bool = True,
    ) -> None:
        if dtype not in HALF_DTYPES:
            raise ConfigError(
                f"MixedPrecision trains in half precision; dtype={dtype} is not one.",
                "use dtype=torch.float16 or torch.bfloat16 (for fp32, remove the callback: learn.to_fp32()).",
            )
        fp16_grads = not master_weights  # without masters the scaler unscales the half gradients in place
        super().__init__(loss_scale, dynamic, max_noskip, max_scale, clip, allow_fp16_grads=fp16_grads)
        self.dtype, self.flat_master, self.loss_fp32 = dtype, flat_master, loss_fp32
        self.master_weights, self.keep_bn_fp32 = master_weights, keep_bn_fp32
        self.converted: list[Converted] = []
        self.masters: MasterWeights | None = None
        self.forward = ExitStack()

    def on_train_begin(self) -> None:
        self.converted = model_to_half(self.learn.model, self.dtype, self.keep_bn_fp32)
        if self.master_weights:
            self.learn.opt = self.masters = MasterWeights(
                self.learn.opt, flat=self.flat_master, model=self.learn.model,
                initial=fp32_originals(self.converted),  # the fp32 values, not their rounding
            )
        self._start_scaling()

    def on_batch_begin(self) -> None:
        if self.xb.is_floating_point():
            self.learn.xb = self.xb.to(self.dtype)
        self.forward.enter_context(half_compute(self.xb.device.type, self.dtype))

    def on_loss_begin(self) -> None:
        self.forward.close()
        if self.loss_fp32:
            self.learn.pred = self.pred.float()  # reductions (log-softmax, mean) in fp32

    def on_train_end(self) -> None:
        self.forward.close()
        model_to_float(self.converted, self.masters)
        self.converted, self.masters = [], None

    def __repr__(self) -> str:
        scaling = "off" if self.loss_scale is None else f"{'dynamic' if self.dynamic else 'static'} "
        scaling += "" if self.loss_scale is None else f"{self.loss_scale:g}"
        return (
            f"MixedPrecision({self.dtype}, loss scale {scaling}, master_weights={self.master_weights}, "
            f"flat_master={self.flat_master})"
        )


class AutocastMixedPrecision(LossScaling):
    """fp32 weights; the forward runs under ``mixprec.autocast`` (a per-op cast policy); loss scaling
    (apex O1; fastai v2's MixedPrecision). No master copies: the weights are fp32 already.

    Args: ``dtype`` and ``policy`` as ``mixprec.autocast``; ``loss_scale`` (None: off) and the rest as
    :class:`MixedPrecision`. The default starts dynamic scaling at 2**16, as torch.amp and apex do.
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.float16,
        loss_scale: float | None = DEFAULT_INIT_SCALE,
        dynamic: bool = True,
        max_noskip: int = DEFAULT_GROWTH_INTERVAL,
        clip: float | None = None,
        policy: Any = None,
    ) -> None:
        super().__init__(loss_scale, dynamic, max_noskip, None, clip)
        self.dtype, self.policy = dtype, policy
        self.forward = ExitStack()

    def on_train_begin(self) -> None:
        self._start_scaling()

    def on_batch_begin(self) -> None:
        self.forward.enter_context(autocast(self.xb.device.type, self.dtype, policy=self.policy))

    def on_loss_begin(self) -> None:
        self.forward.close()
        self.learn.pred = self.pred.float()  # the loss outside the region, in fp32

    def on_train_end(self) -> None:
        self.forward.close()


def mixprec_callback_for(props: Properties, flat_master: bool = False) -> LossScaling | None:
    """The learner callback that trains as an apex opt level does (``mixprec.amp.OPT_LEVELS[level]``, or
    ``initialize``'s resolved properties): None for fp32 (O0), :class:`AutocastMixedPrecision` for a cast
    policy over fp32 weights (O1), :class:`MixedPrecision` for a half model, with or without fp32 masters
    and BatchNorm in fp32 as the properties say (O2, O3). Dynamic scaling as ``mixprec.initialize``:
    start at 2**16, grow after 2000 clean steps, at most 2**24.

    ``flat_master``: one flat fp32 master buffer; only for properties with master weights."""
    if flat_master and not props.master_weights:
        raise ConfigError(
            f"flat_master=True, but opt level {props.opt_level} keeps no fp32 master weights.",
            "use opt level O2 (fp32 masters), or drop flat_master.",
        )
    dynamic = props.loss_scale == DYNAMIC
    scale = DEFAULT_INIT_SCALE if dynamic else float(props.loss_scale)
    if props.patch_torch_functions:
        return AutocastMixedPrecision(props.half_dtype, scale, dynamic, DEFAULT_GROWTH_INTERVAL)
    if not props.enabled or props.cast_model_type not in HALF_DTYPES:
        return None
    return MixedPrecision(
        props.cast_model_type, scale, flat_master, dynamic, DEFAULT_GROWTH_INTERVAL,
        max_scale=DEFAULT_MAX_LOSS_SCALE, master_weights=bool(props.master_weights),
        keep_bn_fp32=bool(props.keep_batchnorm_fp32),
    )


# ---------------------------------------------------------------------------------------------------
# Recording and display


@dataclass(frozen=True)
class EpochResult:
    """One row of the results table."""

    epoch: int
    train_loss: float  # mean of the epoch's batch losses (unscaled)
    valid_loss: float
    metrics: tuple[tuple[str, float], ...]
    seconds: float

    def metric(self, name: str) -> float:
        return dict(self.metrics)[name]


class Recorder(Callback):
    """Keeps, per training batch, the loss, the learning rate, the loss scale the step used (1.0 without
    scaling) and whether the step was skipped; per epoch, an :class:`EpochResult`. Reset by each fit.

    The per-batch lists are filled at each epoch end (and at the end of training), from values kept on the
    device meanwhile: recording costs a few syncs per epoch, not per step.
    """

    order = -10  # before LossScaling's update: sees whether the scaler took part in this step

    def on_train_begin(self) -> None:
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.loss_scales: list[float] = []
        self.skipped: list[bool] = []
        self.epochs: list[EpochResult] = []
        self._clear_pending()

    def _clear_pending(self) -> None:
        # This epoch's steps, kept on the device (detached losses, skip flags) and turned into Python
        # values once per epoch: a float() per step would wait for the device at every step.
        self._losses: list[torch.Tensor] = []
        self._skips: list[bool | torch.Tensor] = []
        self._scaler_saw: list[bool] = []

    def on_epoch_begin(self) -> None:
        self.epoch_start, self.epoch_first_batch = time.perf_counter(), len(self.losses)

    def on_step_end(self) -> None:
        self.lrs.append(float(self.opt.param_groups[0]["lr"]))  # a Python number: no sync
        self._skips.append(self.learn.step_skipped_async())
        self._scaler_saw.append(scaler_saw_step(self.learn.scaler, self.opt))

    def on_batch_end(self) -> None:
        if self.training:
            self._losses.append(self.loss.detach())

    def _flush(self) -> None:
        """Move the pending steps into the per-step lists: one sync for the losses, one for the flags, one
        for the scales."""
        if not self._losses and not self._skips:
            return
        if self._losses:
            self.losses.extend(torch.stack([t.float() for t in self._losses]).tolist())
        on_device = [f for f in self._skips if isinstance(f, torch.Tensor)]
        values = iter(torch.stack(on_device).tolist() if on_device else [])
        self.skipped.extend(bool(next(values)) if isinstance(f, torch.Tensor) else f for f in self._skips)
        self.loss_scales.extend(self._step_scales())
        self._clear_pending()

    def _step_scales(self) -> list[float]:
        """The scale each pending step used: the scaler's history holds one entry per update (per step it
        saw); a step cancelled before the scaler saw it used the scale of the next update, or the current
        scale when none followed."""
        scaler = self.learn.scaler
        if scaler is None or not scaler.is_enabled():
            return [1.0] * len(self._scaler_saw)
        seen = sum(self._scaler_saw)
        history = scaler.scale_history()[-seen:] if seen else []
        history.append(scaler.get_scale())
        scales, i = [], 0
        for saw in self._scaler_saw:
            scales.append(history[i])
            i += saw
        return scales

    def on_epoch_end(self) -> None:
        self._flush()
        batch_losses = self.losses[self.epoch_first_batch :]
        train_loss = sum(batch_losses) / len(batch_losses) if batch_losses else math.nan
        metrics = tuple(zip(self.learn.metric_names, self.learn.valid_metrics, strict=True))
        seconds = time.perf_counter() - self.epoch_start
        self.epochs.append(EpochResult(self.epoch, train_loss, self.learn.valid_loss, metrics, seconds))

    def on_train_end(self) -> None:
        self._flush()  # a fit stopped mid-epoch keeps the steps it took

    @property
    def skipped_steps(self) -> int:
        return sum(self.skipped)

    def state_dict(self) -> dict[str, Any]:
        """The history so far, so that a resumed fit records (and plots) the whole run."""
        names = ("losses", "lrs", "loss_scales", "skipped", "epochs")
        return {name: list(getattr(self, name)) for name in names}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, values in state_dict.items():
            setattr(self, name, list(values))

    def plot_losses(self, path: str | Path, title: str | None = None) -> Path:
        """Write a PNG of the batch losses and, when scaled, the loss scale per step (matplotlib, Agg)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(8, 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.plot(self.losses, lw=1, label="train loss (per batch)")
        steps = [len(self.losses) * (r.epoch + 1) / len(self.epochs) for r in self.epochs]
        ax.plot(steps, [r.valid_loss for r in self.epochs], "o-", label="valid loss (per epoch)")
        ax.set(xlabel="step", ylabel="loss", yscale="log", title=title or "")
        ax.legend(loc="upper right")
        if any(s != 1.0 for s in self.loss_scales):
            scale_ax = ax.twinx()
            scale_ax.plot(self.loss_scales, color="grey", lw=1, ls="--")
            scale_ax.set(ylabel="loss scale (dashed)", yscale="log")
        path = Path(path)
        fig.savefig(path, dpi=110)
        return path


class StepTimer(Callback):
    """Wall time of each training step, forward to optimizer step (data loading excluded), in seconds.
    On CUDA it synchronizes at both ends so the time covers the kernels, not just their launch."""

    order = -20

    def on_train_begin(self) -> None:
        self.times: list[float] = []

    def _now(self) -> float:
        if self.xb.device.type == "cuda":
            torch.cuda.synchronize(self.xb.device)
        return time.perf_counter()

    def on_batch_begin(self) -> None:
        if self.training:
            self.start = self._now()

    def on_batch_end(self) -> None:
        if self.training:
            self.times.append(self._now() - self.start)


def _fmt_time(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes:02d}:{secs:02d}"


class ProgressBar(Callback):
    """A rich progress bar over each epoch's batches (on a terminal) and fastai's results table, one row per
    epoch (epoch, train_loss, valid_loss, metrics, time), printed as each epoch ends."""

    order = -5  # after the Recorder, whose epoch result it prints

    def __init__(self, console: Console | None = None) -> None:
        self.console = console

    def on_train_begin(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.out = self.console or Console(highlight=False)
        self.columns = ["epoch", "train_loss", "valid_loss", *self.learn.metric_names, "time"]
        self.widths = [max(len(c), 10) for c in self.columns]
        self.bar: Progress | None = None
        if self.out.is_terminal:  # a live bar only where it can redraw; logs get the rows alone
            self.bar = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                console=self.out, transient=True,
            )
            self.bar.start()
        self._print(self.columns, style="bold")

    def _print(self, cells: list[str], style: str = "") -> None:
        line = "  ".join(c.ljust(w) for c, w in zip(cells, self.widths, strict=True)).rstrip()
        self.out.print(line, style=style, highlight=False)

    def on_epoch_begin(self) -> None:
        if self.bar is not None:
            description = f"epoch {self.epoch + 1}/{self.n_epochs}"
            self.task: TaskID = self.bar.add_task(description, total=len(self.data.train))

    def on_batch_end(self) -> None:
        if self.training and self.bar is not None:
            self.bar.advance(self.task)

    def on_epoch_end(self) -> None:
        if self.bar is not None:
            self.bar.remove_task(self.task)
        r = self.learn.recorder.epochs[-1]
        values = [f"{v:.6f}" for v in (r.train_loss, r.valid_loss, *(m for _, m in r.metrics))]
        self._print([str(r.epoch), *values, _fmt_time(r.seconds)])

    def on_train_end(self) -> None:
        bar = self.__dict__.get("bar")
        if bar is not None:
            bar.stop()


# ---------------------------------------------------------------------------------------------------
# Schedules


def _cos_anneal(start: float, end: float, pct: float) -> float:
    return start + (end - start) * (1 - math.cos(math.pi * pct)) / 2


class OneCycleScheduler(Callback):
    """fastai's 1cycle policy: the learning rate rises from ``lr_max / div_factor`` to ``lr_max`` over the
    first ``pct_start`` of the steps, then falls to ``lr_max / final_div``, both on cosine curves (the
    schedule of torch's OneCycleLR with ``final_div_factor = final_div / div_factor``); momentum
    (or Adam's beta1) moves the opposite way between ``moms``. High lr with low momentum explores, the long
    descent settles. Momentum is scheduled only for optimizers that use it (betas, or momentum > 0)."""

    order = -15  # before anything that reads the learning rate of this step

    def __init__(
        self,
        lr_max: float,
        div_factor: float = 25.0,
        pct_start: float = 0.3,
        final_div: float | None = None,
        moms: tuple[float, float] = (0.95, 0.85),
    ) -> None:
        if not 0.0 <= pct_start <= 1.0:
            raise ConfigError(f"pct_start must be in [0, 1], got {pct_start}.", "e.g. pct_start=0.3.")
        self.lr_max, self.div_factor, self.pct_start, self.moms = lr_max, div_factor, pct_start, moms
        # fastai's default: end 1e4 times below the start, so the last steps barely move the weights
        self.final_div = final_div if final_div is not None else div_factor * 1e4

    def on_train_begin(self) -> None:
        self.total = max(1, self.n_epochs * len(self.data.train))
        # Step indices where the rise ends and the fall ends: both ends are reached exactly, as in
        # torch.optim.lr_scheduler.OneCycleLR (two phases), which the tests compare against.
        self.peak = max(0.0, self.pct_start * self.total - 1)
        self.step_no = 0
        self.setters = [_momentum_setter(g) for g in self.opt.param_groups]

    def _at(self, i: int) -> tuple[float, float]:
        lr_start, lr_end = self.lr_max / self.div_factor, self.lr_max / self.final_div
        if i <= self.peak:
            pct = i / self.peak if self.peak > 0 else 1.0
            return _cos_anneal(lr_start, self.lr_max, pct), _cos_anneal(*self.moms, pct)
        pct = (i - self.peak) / max(1e-12, self.total - 1 - self.peak)
        return _cos_anneal(self.lr_max, lr_end, pct), _cos_anneal(self.moms[1], self.moms[0], pct)

    def on_batch_begin(self) -> None:
        if not self.training:
            return
        lr, mom = self._at(min(self.step_no, self.total - 1))
        for group, set_momentum in zip(self.opt.param_groups, self.setters, strict=True):
            group["lr"] = lr
            set_momentum(group, mom)

    def on_batch_end(self) -> None:
        if self.training:
            self.step_no += 1

    def state_dict(self) -> dict[str, Any]:
        return {"step_no": self.step_no}  # the rest is rebuilt from the arguments and n_epochs

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step_no = int(state_dict["step_no"])


def _set_beta1(group: dict[str, Any], mom: float) -> None:
    group["betas"] = (mom, group["betas"][1])


def _set_momentum(group: dict[str, Any], mom: float) -> None:
    group["momentum"] = mom


def _momentum_setter(group: dict[str, Any]) -> Callable[[dict[str, Any], float], None]:
    if "betas" in group:
        return _set_beta1
    if group.get("momentum", 0) > 0:
        return _set_momentum
    return lambda group, mom: None  # plain SGD: leave it without momentum


# ---------------------------------------------------------------------------------------------------
# Checkpoints


def _stateful_callbacks(learn: Learner) -> list[Callback]:
    """Callbacks with their own state (the Recorder, schedules), in the learner's order. Looked up on the
    class: an instance would forward a missing ``state_dict`` to the learner (``Callback.__getattr__``)."""
    return [cb for cb in learn.callbacks if callable(getattr(type(cb), "state_dict", None))]


class Checkpoint(Callback):
    """Save at every epoch end, and resume at an epoch boundary, bit for bit.

    Events: on_train_begin -- with ``resume_from``, load model, optimizer (under ``MasterWeights`` its
    fp32 masters too), loss scaler, the state of stateful callbacks (Recorder, OneCycleScheduler), the
    global RNGs and the train loader's shuffle generator, and set ``learn.start_epoch`` and
    ``learn.iteration``: the loop continues with the next epoch. on_epoch_end -- write all of that to
    ``path`` with :func:`~mixprec.checkpoint.save_checkpoint` (atomic: a crash mid-write keeps the last
    good file). Saved after validation, so the RNG and the generator are where the next epoch starts.

    The resumed fit must be set up as the saved one: same model, precision (``to_fp16``/``to_bf16``,
    ``flat_master``), optimizer, callbacks with state, and ``epochs`` (a one-cycle schedule spans all
    epochs; resumed with another count it continues a different schedule).
    """

    order = 200  # last: MixedPrecision (100) has wrapped the optimizer and made the scaler before a load

    def __init__(
        self, path: str | os.PathLike[str] | None = None, resume_from: str | os.PathLike[str] | None = None
    ) -> None:
        self.path = None if path is None else Path(path)
        self.resume_from = None if resume_from is None else Path(resume_from)
        if self.resume_from is not None and not self.resume_from.is_file():
            raise CheckpointError(
                f"Cannot resume: there is no checkpoint at {self.resume_from}.",
                "check the path; fit(..., checkpoint=PATH) and `mixprec train --out DIR` (DIR/checkpoint.pt) "
                "write one at every epoch end. Or train from the start without resume.",
            )

    def _objects(self) -> dict[str, Any]:
        scaler = self.learn.scaler
        return {"model": self.learn.model, "optimizer": self.learn.opt,
                "scaler": [] if scaler is None else [scaler], "scheduler": _stateful_callbacks(self.learn)}

    def on_train_begin(self) -> None:
        if self.resume_from is None:
            return
        # RNG last of all: nothing may draw from it between this load and the first batch.
        resumed = load_checkpoint(self.resume_from, **self._objects())
        epoch = int(resumed.extra["epoch"])
        if epoch > self.n_epochs:
            raise ConfigError(
                f"{self.resume_from} is at epoch {epoch}, beyond this fit's {self.n_epochs} epochs.",
                f"resume with epochs >= {epoch} (the same count as the saved run for an identical result).",
            )
        generator, state = self.data.train.generator, resumed.extra["train_generator"]
        if generator is not None and state is not None:
            generator.set_state(state)
        self.learn.start_epoch, self.learn.iteration = epoch, int(resumed.extra["iteration"])

    def on_epoch_end(self) -> None:
        if self.path is None:
            return
        generator = self.data.train.generator  # the shuffle order of the epochs to come
        extra = {"epoch": self.epoch + 1, "n_epochs": self.n_epochs, "iteration": self.iteration,
                 "train_generator": None if generator is None else generator.get_state()}
        save_checkpoint(self.path, step=self.iteration, extra=extra, **self._objects())

    def __repr__(self) -> str:
        return f"Checkpoint(path={self.path}, resume_from={self.resume_from})"
