"""What ``mixprec train --resume`` does with the folder it is given, decided before anything is built.

- no checkpoint yet: start afresh and say so (an automatic restart in the first epoch works);
- the checkpoint's run is finished (it trained ``--epochs`` already): say so, write nothing;
- the settings differ from the saved run's (another ``--precision``, ``--opt-level``, ``--opt``, ``--model``,
  ``--loss-scale`` ...): refuse, naming each difference and the two ways on. A resumed run continues the
  saved one bit for bit, so a changed setting would either fail deep inside ``load_state_dict`` or, worse,
  be silently ignored (a new ``--loss-scale`` against the saved scaler state) or silently applied (bf16
  on an fp16 run's weights, dropping its scaler);
- otherwise: continue.

The settings travel inside the checkpoint, as the state of the ``TrainSettings`` callback, so they are
written atomically with the weights they describe.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixprec.callbacks import Callback
from mixprec.checkpoint import read_checkpoint
from mixprec.commands.train import UsageError

# The arguments a resumed run must share with the saved one, each with the reason. --epochs may grow under
# --schedule constant (the Learner continues to the new count), not under one-cycle (the schedule spans
# the epochs); --out and --resume are where and how, not what.
MUST_MATCH: dict[str, str] = {
    "model": "the weights have this architecture",
    "data": "the batches and classes come from it",
    "size": "the input side sets the first layer's shape",
    "batch_size": "the saved position in the epoch counts batches of this size",
    "seed": "the shuffle order and the initial weights follow it",
    "precision": "the weights, masters and loss scaler are saved at this precision",
    "opt_level": "the weights, masters and loss scaler are saved at this opt level",
    "loss_scale": "the saved loss scaler continues from its own state; a new scale would be ignored",
    "flat_master": "the fp32 masters are saved in this layout",
    "opt": "the optimizer state (moments, momentum) belongs to this optimizer",
    "lr": "the learning rate schedule continues where it stopped",
    "schedule": "the learning rate schedule continues where it stopped",
}
SETTINGS_KEY = "train_settings"


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The MUST_MATCH arguments as the run uses them: defaults spelled out, so that `--loss-scale dynamic`
    and no --loss-scale compare equal."""
    values = {name: getattr(args, name) for name in MUST_MATCH}
    if values["precision"] is None and values["opt_level"] is None:
        values["precision"] = "fp32"
    if values["loss_scale"] is None and values["precision"] == "fp16":
        values["loss_scale"] = "dynamic"
    return values


class TrainSettings(Callback):
    """Carries the run's settings into the checkpoint (callbacks with a state_dict are saved with it)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings

    def state_dict(self) -> dict[str, Any]:
        return {SETTINGS_KEY: dict(self.settings)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: ``plan`` compared the saved settings before the run was built."""


@dataclass(frozen=True)
class Plan:
    """``start_fresh``: train from the first epoch (maybe with a note why); ``finished``: do nothing, the
    note says why; otherwise resume. ``keep_settings``: add TrainSettings (False for a checkpoint written
    before settings were saved, whose callback list must stay as it was)."""

    start_fresh: bool
    finished: bool = False
    keep_settings: bool = True
    note: str | None = None


def plan(args: argparse.Namespace, checkpoint: Path) -> Plan:
    """Raise ``UsageError`` for a resume that cannot continue the saved run; else say what to do."""
    if not args.resume:
        return Plan(start_fresh=True)
    if not checkpoint.is_file():
        return Plan(start_fresh=True, note=f"--resume: no checkpoint at {checkpoint} yet; starting afresh.")
    payload = read_checkpoint(checkpoint)
    saved = _saved_settings(payload)
    if saved is not None:
        _refuse_differences(saved, settings_of(args), checkpoint)
    done, planned = int(payload["extra"]["epoch"]), int(payload["extra"]["n_epochs"])
    if args.schedule == "one-cycle" and args.epochs != planned:
        raise UsageError(
            f"--resume: --epochs {args.epochs} here, {planned} in the saved run: the one-cycle schedule "
            "spans all epochs, so another count would continue a different schedule from the saved step.",
            f"resume with --epochs {planned}; to train longer, start a new run (or use --schedule constant).",
        )
    if done > args.epochs:
        raise UsageError(
            f"--resume: the run in {checkpoint.parent} has trained {done} epochs, more than --epochs "
            f"{args.epochs}.",
            f"resume with --epochs {done} or more (the saved run's count continues it exactly).",
        )
    if done == args.epochs:
        return Plan(start_fresh=False, finished=True,
                    note=f"The run in {checkpoint.parent} is finished: it has trained its {done} epoch(s). "
                    "Nothing was trained or written. To train on, pass a larger --epochs (under --schedule "
                    "constant), or another --out for a new run.")
    return Plan(start_fresh=False, keep_settings=saved is not None)


def _saved_settings(payload: dict[str, Any]) -> dict[str, Any] | None:
    states = payload.get("schedulers", [])
    return next((s[SETTINGS_KEY] for s in states if isinstance(s, dict) and SETTINGS_KEY in s), None)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(value: Any) -> str:
    if value is None or value is False:
        return "not given"
    if value is True:
        return "given"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _as_given(name: str, value: Any) -> str:
    """How to pass ``value`` for ``name`` on the command line."""
    if value is None or value is False:
        return f"no {_flag(name)}"
    return _flag(name) if value is True else f"{_flag(name)} {value}"


def _refuse_differences(saved: dict[str, Any], now: dict[str, Any], checkpoint: Path) -> None:
    diffs = [name for name in MUST_MATCH if saved.get(name) != now.get(name)]
    if "precision" in diffs or "opt_level" in diffs:
        diffs = [n for n in diffs if n != "loss_scale"]  # the default scale follows the precision
    if not diffs:
        return
    lines = "; ".join(f"{_flag(n)} {_shown(now.get(n))} here, {_shown(saved.get(n))} in the saved run "
                      f"({MUST_MATCH[n]})" for n in diffs)
    again = ", ".join(_as_given(n, saved.get(n)) for n in diffs)
    raise UsageError(
        f"--resume: these settings differ from the run saved in {checkpoint}: {lines}.",
        f"resume with the saved settings ({again}), or drop --resume / pick another --out to start a new "
        "run with the new ones.",
    )
