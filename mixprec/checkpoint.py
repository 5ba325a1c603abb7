"""Checkpoints that resume a mixed-precision run exactly, written so that a crash never destroys the last
good one.

What a mixed-precision run needs to resume bit for bit, and where it lives:

======================  =========================================================================
state                   why it must be saved
======================  =========================================================================
model                   the half (or fp32) weights the forward runs on
optimizer               momentum / Adam moments; under ``MasterWeights`` also the fp32 masters.
                        The masters hold the bits below half precision: reloading the rounded
                        model weights instead would lose every update smaller than half an ulp.
scaler(s)               the loss scale, its growth tracker and hysteresis: a fresh scaler would
                        restart at 2**16 and overflow again, and would grow at other steps
scheduler               the learning rate at this step
RNG                     torch CPU (dropout, init), CUDA (if present), numpy, Python ``random``
data position           epoch, batch within it and the shuffle generator (``ResumableLoader``)
step, extra             where the loop was, plus anything the caller adds
======================  =========================================================================

Atomic write: the checkpoint goes to a temporary file in the target's directory, is flushed and fsynced,
then moved over the target with ``os.replace`` (atomic on POSIX within one file system), and the directory
is fsynced so the rename itself survives a power loss. A crash at any point leaves either the old or the new
checkpoint whole, never a torn one.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

from mixprec.errors import ConfigError, MixprecError

__all__ = [
    "CheckpointError",
    "Resumed",
    "ResumableLoader",
    "save_checkpoint",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
]

FORMAT_VERSION = 1  # bump when the layout of the saved dict changes; load refuses unknown versions


class CheckpointError(MixprecError, RuntimeError):
    """A checkpoint cannot be read, or does not fit the objects it is loaded into."""


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


@dataclass(frozen=True)
class Resumed:
    """What ``load_checkpoint`` returns: the step to continue from and the caller's ``extra`` dict."""

    step: int
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------- RNG state
def rng_state() -> dict[str, Any]:
    """Every global random generator a training loop draws from. CUDA only when it is initialised."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------------------------- data order
class ResumableLoader:
    """Iterate a ``DataLoader`` one epoch per ``for`` loop, remembering enough to restart mid-epoch with the
    same batches: the epoch, the batches already yielded in it, and the shuffle generator's state at the
    start of the epoch.

    On resume the generator is reset to that state and the consumed batches are drawn again and dropped,
    so the sampler's permutation (and the loader's worker seed, also drawn from the generator) are the
    ones the interrupted run had. Dropping batches costs their loading, not a forward pass.

    Shuffling must come from a generator the loader owns (``DataLoader(..., generator=g)``) or from a
    sampler with ``set_epoch`` (``DistributedSampler``, called here at each epoch start); a
    ``RandomSampler`` without a generator draws from the global RNG and its order could not be replayed.
    """

    def __init__(self, loader: DataLoader) -> None:
        sampler = loader.sampler
        self._generator: torch.Generator | None = loader.generator or getattr(sampler, "generator", None)
        if isinstance(sampler, RandomSampler) and self._generator is None:
            raise ConfigError(
                "This DataLoader shuffles with torch's global RNG, so its batch order cannot be replayed "
                "after a resume.",
                "give it its own generator: DataLoader(..., shuffle=True, "
                "generator=torch.Generator().manual_seed(seed)).",
            )
        self.loader = loader
        self.epoch = 0
        self.batch = 0  # batches yielded so far in the current epoch
        self._epoch_start: torch.Tensor | None = self._gen_state()
        self._resume_pending = False

    def _gen_state(self) -> torch.Tensor | None:
        return None if self._generator is None else self._generator.get_state()

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        skip = self.batch if self._resume_pending else 0
        self._resume_pending = False
        if skip and self._generator is not None and self._epoch_start is not None:
            self._generator.set_state(self._epoch_start)
        self._epoch_start = self._gen_state()
        if hasattr(self.loader.sampler, "set_epoch"):
            self.loader.sampler.set_epoch(self.epoch)
        self.batch = 0
        batches = iter(self.loader)
        for _ in range(skip):
            next(batches)
            self.batch += 1
        for item in batches:
            self.batch += 1
            yield item
        self.epoch += 1
        self.batch = 0
        self._epoch_start = self._gen_state()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch": self.batch, "generator": self._epoch_start}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.batch = int(state_dict["batch"])
        self._epoch_start = state_dict["generator"]
        if self._generator is not None and self._epoch_start is not None:
            # Also correct when batch == 0: the next epoch starts from the saved generator state.
            self._generator.set_state(self._epoch_start)
        self._resume_pending = self.batch > 0


# --------------------------------------------------------------------------------------------- atomic I/O
@contextlib.contextmanager
def _atomic_file(path: Path) -> Iterator[Any]:
    """Yield a binary file in ``path``'s directory; on success it replaces ``path`` atomically and durably,
    on any exception it is deleted and ``path`` is left as it was."""
    directory = path.parent
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them visible
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: Path) -> None:
    """Persist the rename. Not every platform can open a directory (Windows cannot): then skip."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# --------------------------------------------------------------------------------------------- save / load
T = TypeVar("T")


def _as_list(value: T | Sequence[T] | None) -> list[T]:
    if value is None:
        return []
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return list(value)
    return [value]  # type: ignore[list-item]


def _states(objects: Sequence[Any]) -> list[dict[str, Any]]:
    return [obj.state_dict() for obj in objects]


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    scaler: Stateful | Sequence[Stateful] | None = None,
    scheduler: Stateful | Sequence[Stateful] | None = None,
    step: int = 0,
    extra: Mapping[str, Any] | None = None,
    loader: ResumableLoader | None = None,
) -> Path:
    """Write everything needed to resume at ``step`` to ``path``, atomically (see the module docstring).

    ``model``, ``optimizer``, ``scaler`` and ``scheduler`` each take one object or a sequence (several
    models / optimizers / scalers); ``load_checkpoint`` must get them in the same order. Pass the
    ``MasterWeights`` wrapper (not the wrapped optimizer) so the fp32 masters are saved, and the unwrapped
    model (``ddp.module``) so the checkpoint loads without DDP. Call it after ``scaler.update()``: the
    scaler refuses to serialise mid-iteration. Syncs with the device (the scaler's counters). Returns the
    path written."""
    target = Path(path)
    if not target.parent.is_dir():
        raise ConfigError(
            f"Cannot write checkpoint {target}: directory {target.parent} does not exist.",
            f"create it first: Path({str(target.parent)!r}).mkdir(parents=True, exist_ok=True).",
        )
    payload = {
        "format": FORMAT_VERSION,
        "step": int(step),
        "extra": dict(extra or {}),
        "models": _states(_as_list(model)),
        "optimizers": _states(_as_list(optimizer)),
        "scalers": _states(_as_list(scaler)),
        "schedulers": _states(_as_list(scheduler)),
        "loader": None if loader is None else loader.state_dict(),
        "rng": rng_state(),
    }
    with _atomic_file(target) as f:
        torch.save(payload, f)
    return target


def _load_into(kind: str, objects: Sequence[Any], states: Sequence[dict[str, Any]]) -> None:
    if len(objects) != len(states):
        raise CheckpointError(
            f"The checkpoint holds {len(states)} {kind} state(s), but {len(objects)} were given to load "
            "into.",
            f"pass the same {kind}(s), in the same order, as to save_checkpoint.",
        )
    for obj, state in zip(objects, states, strict=True):
        obj.load_state_dict(state)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    scaler: Stateful | Sequence[Stateful] | None = None,
    scheduler: Stateful | Sequence[Stateful] | None = None,
    loader: ResumableLoader | None = None,
    map_location: str | torch.device | None = "cpu",
    restore_rng: bool = True,
) -> Resumed:
    """Load a checkpoint written by ``save_checkpoint`` into freshly built objects (same architecture, same
    optimizer wrapping) and restore the global RNGs. Returns ``Resumed(step, extra)``: continue the loop at
    ``step``. Tensors are loaded to ``map_location`` first, then copied where the objects live."""
    source = Path(path)
    if not source.is_file():
        raise CheckpointError(f"No checkpoint at {source}.", "check the path, or start without --resume.")
    try:
        # weights_only=False: the RNG state holds numpy arrays and Python tuples; load only your own files.
        payload = torch.load(source, map_location=map_location, weights_only=False)
    except Exception as exc:  # a truncated or foreign file: say which, keep the cause
        raise CheckpointError(
            f"{source} is not a readable mixprec checkpoint ({type(exc).__name__}: {exc}).",
            "load an earlier checkpoint; files written by save_checkpoint are never left half-written.",
        ) from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{source} is not a mixprec checkpoint of format {FORMAT_VERSION}.",
            "write it with mixprec.checkpoint.save_checkpoint (of this mixprec version).",
        )
    _load_into("model", _as_list(model), payload["models"])
    # Optimizers after models: MasterWeights.load_state_dict copies the masters into the model weights.
    _load_into("optimizer", _as_list(optimizer), payload["optimizers"])
    _load_into("scaler", _as_list(scaler), payload["scalers"])
    _load_into("scheduler", _as_list(scheduler), payload["schedulers"])
    if loader is not None:
        if payload["loader"] is None:
            raise CheckpointError(
                "The checkpoint has no data-loader position.",
                "save it with save_checkpoint(..., loader=...), or load without loader=.",
            )
        loader.load_state_dict(payload["loader"])
    if restore_rng:
        set_rng_state(payload["rng"])
    return Resumed(payload["step"], payload["extra"])
