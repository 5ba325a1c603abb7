"""The :class:`Checkpoint` callback: save at every epoch end, resume at an epoch boundary, bit for bit. The
file format and its atomic write are :mod:`mixprec.checkpoint`'s."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from mixprec.callbacks.core import Callback, stateful_callbacks
from mixprec.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from mixprec.errors import ConfigError

__all__ = ["Checkpoint"]


class Checkpoint(Callback):
    """Save at every epoch end, and resume at an epoch boundary, bit for bit.

    Events: on_train_begin -- with ``resume_from``, load model, optimizer (under ``MasterWeights`` its
    fp32 masters too), loss scaler, the state of stateful callbacks (Recorder, OneCycleScheduler,
    GradientAccumulation with its pending gradients), the global RNGs and the train loader's shuffle
    generator, and set ``learn.start_epoch`` and ``learn.iteration``: the loop continues with the next
    epoch. on_epoch_end -- write all of that to
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
                "scaler": [] if scaler is None else [scaler],
                "scheduler": stateful_callbacks(self.learn.callbacks)}

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
        generator, state = _shuffle_generator(self.data.train), resumed.extra["train_generator"]
        if generator is not None and state is not None:
            generator.set_state(state)
        self.learn.start_epoch, self.learn.iteration = epoch, int(resumed.extra["iteration"])

    def on_epoch_end(self) -> None:
        if self.path is None:
            return
        generator = _shuffle_generator(self.data.train)  # the shuffle order of the epochs to come
        extra = {"epoch": self.epoch + 1, "n_epochs": self.n_epochs, "iteration": self.iteration,
                 "train_generator": None if generator is None else generator.get_state()}
        save_checkpoint(self.path, step=self.iteration, extra=extra, **self._objects())

    def __repr__(self) -> str:
        return f"Checkpoint(path={self.path}, resume_from={self.resume_from})"


def _shuffle_generator(loader: Any) -> torch.Generator | None:
    """A DataLoader's own generator (its shuffle order), or None: a loader of another kind (an iterable of
    batches; a fit trains on one) draws from the global RNGs, which a checkpoint restores. Its ``.generator``
    was read unchecked, and a fit with such a loader failed with a bare AttributeError at its first save."""
    generator = getattr(loader, "generator", None)
    return generator if isinstance(generator, torch.Generator) else None
