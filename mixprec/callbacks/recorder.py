"""What a fit leaves behind: the :class:`Recorder` (per-step loss, learning rate, loss scale, skips; per-epoch
results) and the :class:`StepTimer` (wall time per step)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mixprec.callbacks.core import Callback, scaler_saw_step

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["EpochResult", "Recorder", "StepTimer"]


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
    """Keeps, per training batch, the loss; per optimizer step (on_step_end), the learning rate, the loss
    scale the step used (1.0 without scaling) and whether the step was skipped -- one per batch too, unless
    :class:`~mixprec.callbacks.GradientAccumulation` steps once per several; per epoch, an
    :class:`EpochResult`. Reset by each fit.

    The per-batch lists are filled at each epoch end (and at the end of training), from values kept on the
    device meanwhile: recording costs a few syncs per epoch, not per step.
    """

    order = -10  # before MixedPrecision's update: sees whether the scaler took part in this step

    def __init__(self) -> None:
        # Empty from the start, not only from on_train_begin: when an earlier callback's on_train_begin
        # raises, on_train_end still runs here and must not hide that error behind an AttributeError.
        self.on_train_begin()

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
        if self.training and self.loss is not None:  # None: the batch was cancelled before its loss
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
        path = Path(path)
        self.loss_figure(title).savefig(path, dpi=110)
        return path

    def loss_figure(self, title: str | None = None) -> Figure:
        """The figure :meth:`plot_losses` writes."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(8, 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.plot(self.losses, lw=1, label="train loss (per batch)")
        steps = [len(self.losses) * (r.epoch + 1) / len(self.epochs) for r in self.epochs]
        ax.plot(steps, [r.valid_loss for r in self.epochs], "o-", label="valid loss (per epoch)")
        ax.set(xlabel="step", ylabel="loss", yscale="log", title=title or "")
        # matplotlib leaves inf/NaN points out without a word: mark them, and the skipped steps, on the axis
        bad = [i for i, loss in enumerate(self.losses) if not math.isfinite(loss)]
        if bad:
            ax.plot(bad, [0.0] * len(bad), "rx", transform=ax.get_xaxis_transform(), clip_on=False,
                    label=f"loss inf/NaN ({len(bad)} steps, not drawn)")
        skipped = [i for i, s in enumerate(self.skipped) if s]
        if skipped:
            ax.plot(skipped, [0.02] * len(skipped), "|", color="orange", transform=ax.get_xaxis_transform(),
                    label=f"step skipped ({len(skipped)})")
        ax.legend(loc="upper right")
        if any(s != 1.0 for s in self.loss_scales):
            scale_ax = ax.twinx()
            scale_ax.plot(self.loss_scales, color="grey", lw=1, ls="--")
            scale_ax.set(ylabel="loss scale (dashed)", yscale="log")
        return fig


class StepTimer(Callback):
    """Wall time of each training step, forward to optimizer step (data loading excluded), in seconds.
    On CUDA it synchronizes at both ends so the time covers the kernels, not just their launch."""

    order = -20

    def on_train_begin(self) -> None:
        self.times: list[float] = []

    def _now(self) -> float:
        device = self.yb.device  # xb may be several inputs; the target is one tensor on the same device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def on_batch_begin(self) -> None:
        if self.training:
            self.start = self._now()

    def on_batch_end(self) -> None:
        if self.training:
            self.times.append(self._now() - self.start)

