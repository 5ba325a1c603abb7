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
import glob
import os
import random
import sys
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

from mixprec.amp import loss_scalers_of
from mixprec.checkpoint_checks import (
    check_can_save,
    check_classes,
    check_counts,
    check_model,
    check_optimizer,
    check_scaler,
    describe,
)
from mixprec.checkpoint_digest import payload_digest
from mixprec.distributed import process_rank
from mixprec.errors import CheckpointError, ConfigError

__all__ = [
    "CheckpointError",
    "Resumed",
    "ResumableLoader",
    "save_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "rng_state",
    "set_rng_state",
]

# Bump when the layout of the saved dict changes; load refuses unknown versions. 2 added "classes" and
# "checksum"; format 1 files still load, unverified, with a warning.
FORMAT_VERSION = 2
LEGACY_FORMATS = (1,)


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
    """Every global random generator a training loop draws from. CUDA only when it is initialised. NumPy's
    key array is held as a tensor: with it, a state (a ResumableLoader's, in a user's own checkpoint) loads
    with ``torch.load``'s default ``weights_only=True``, which refuses NumPy arrays (torch's state is a
    tensor, Python's tuples of ints)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Set what :func:`rng_state` gave (NumPy's keys as a tensor, or as the array older checkpoints hold)."""
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, cached))
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
    ones the interrupted run had. Dropping batches costs their loading, not a forward pass. The global
    RNGs are set to what they were at the epoch's start for that replay (a loader without a generator
    draws its worker seed there; workers then replay their own augmentations) and put back afterwards:
    a dataset or collate function that augments with torch's, NumPy's or Python's global RNG in the main
    process (``num_workers=0``) would otherwise draw the dropped batches' numbers from the training
    loop's, and every later batch and dropout mask would differ from the uninterrupted run's.

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
        self._epoch_start_rng: dict[str, Any] | None = None  # the global RNGs when the epoch began
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
        if skip:
            batches = self._replayed(skip)
        else:
            self._epoch_start_rng = rng_state()
            batches = iter(self.loader)
        for item in batches:
            self.batch += 1
            yield item
        self.epoch += 1
        self.batch = 0
        self._epoch_start = self._gen_state()

    def _replayed(self, skip: int) -> Iterator[Any]:
        """The loader's iterator past its first ``skip`` batches, drawn from the global RNGs as at the
        epoch's start, which are then put back as they were (class docstring)."""
        now = rng_state()
        if self._epoch_start_rng is not None:  # None: a checkpoint saved before mixprec kept it
            set_rng_state(self._epoch_start_rng)
        try:
            batches = iter(self.loader)
            for _ in range(skip):
                next(batches)
                self.batch += 1
        finally:
            set_rng_state(now)
        return batches

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch": self.batch, "generator": self._epoch_start,
                "rng_at_epoch_start": self._epoch_start_rng}  # fmt: skip

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.batch = int(state_dict["batch"])
        self._epoch_start_rng = state_dict.get("rng_at_epoch_start")
        self._epoch_start = state_dict["generator"]
        if self._generator is not None and self._epoch_start is not None:
            # Also correct when batch == 0: the next epoch starts from the saved generator state.
            self._generator.set_state(self._epoch_start)
        self._resume_pending = self.batch > 0


# --------------------------------------------------------------------------------------------- atomic I/O
def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


TEMP_SUFFIX = ".tmp"


def _remove_leftovers(path: Path) -> None:
    """Delete the temporary files a killed save of ``path`` left behind (a SIGKILL runs no cleanup). Two
    processes must not save the same path at once anyway: the later rename would win."""
    for stale in path.parent.glob(f"{glob.escape(_temp_prefix(path))}*{TEMP_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()


def _umask() -> int:
    """The process umask. Linux shows it in /proc; elsewhere set-and-restore is the only way to read it
    (a thread creating a file in between would see 0o022 for that instant)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def _atomic_file(path: Path) -> Iterator[Any]:
    """Yield a binary file in ``path``'s directory; on success it replaces ``path`` atomically and durably,
    on any exception it is deleted and ``path`` is left as it was."""
    directory = path.parent
    _remove_leftovers(path)
    fd, tmp_name = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=TEMP_SUFFIX, dir=directory)
    try:
        # mkstemp makes the file 0o600; the checkpoint gets the mode open() would give it (0o666 less the
        # umask), as torch.save(path) would, so that a group-shared run directory stays readable.
        os.chmod(tmp_name, 0o666 & ~_umask())
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


def _uncompiled(model: nn.Module) -> nn.Module:
    """The module torch.compile wrapped (same parameters): its state dict's keys carry no ``_orig_mod.``
    prefix, so a checkpoint of a compiled model loads into the plain one and the other way round."""
    frames = sys.modules.get("torch._dynamo.eval_frame")  # not loaded: nothing was compiled (and no import)
    compiled = frames is not None and isinstance(model, frames.OptimizedModule)
    return model._orig_mod if compiled else model  # type: ignore[return-value]


_COMPILED_PREFIX = "_orig_mod."


def _from_compiled_saves(payload: dict[str, Any], models: Sequence[nn.Module]) -> None:
    """A checkpoint of a compiled model written before models were saved unwrapped: its names carry
    ``_orig_mod.`` and its class is OptimizedModule. Read it as the model it wraps (in place)."""
    for i, (state, model) in enumerate(zip(payload["models"], models, strict=False)):
        if state and all(k.startswith(_COMPILED_PREFIX) for k in state):
            payload["models"][i] = {k.removeprefix(_COMPILED_PREFIX): v for k, v in state.items()}
            classes = payload.get("classes", {}).get("model")
            if classes is not None and i < len(classes):
                classes[i] = describe(model)


def _objects(model: Any, optimizer: Any, scaler: Any, scheduler: Any) -> dict[str, list[Any]]:
    objects = dict(zip(KINDS, map(_as_list, (model, optimizer, scaler, scheduler)), strict=True))
    objects["model"] = [_uncompiled(m) for m in objects["model"]]
    return objects


def _states(objects: Sequence[Any]) -> list[dict[str, Any]]:
    return [obj.state_dict() for obj in objects]


KINDS = ("model", "optimizer", "scaler", "scheduler")  # the payload holds each under KIND + "s"


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
    """Write everything needed to resume at ``step`` to ``path``, atomically (see the module docstring),
    with the classes of the objects and a checksum of their state (``load_checkpoint`` verifies both).

    ``model``, ``optimizer``, ``scaler`` and ``scheduler`` each take one object or a sequence (several
    models / optimizers / scalers); ``load_checkpoint`` must get them in the same order. Without
    ``scaler``, the loss scalers of the ``mixprec.initialize`` calls that returned the optimizers are
    saved (and loaded) with them. Pass the ``MasterWeights`` wrapper (not the wrapped optimizer) so the
    fp32 masters are saved, and the unwrapped model (``ddp.module``) so the checkpoint loads without
    DDP. Call it after ``scaler.update()``. Both mistakes raise ``CheckpointError``. Syncs with the
    device (the scaler's counters, the checksum). Returns the path written."""
    target = Path(path)
    if not target.parent.is_dir():
        raise ConfigError(
            f"Cannot write checkpoint {target}: directory {target.parent} does not exist.",
            f"create it first: Path({str(target.parent)!r}).mkdir(parents=True, exist_ok=True).",
        )
    objects = _objects(model, optimizer, scaler, scheduler)
    if scaler is None:  # an apex-style run's scale lives with its optimizers: keep it without being asked
        objects["scaler"] = loss_scalers_of(objects["optimizer"])
    check_can_save(objects["model"], objects["optimizer"], objects["scaler"])
    payload: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "step": int(step),
        "extra": dict(extra or {}),
        **{f"{kind}s": _states(objs) for kind, objs in objects.items()},
        "loader": None if loader is None else loader.state_dict(),
        "rng": rng_state(),
        "rank": process_rank(),  # whose RNG state this is (load_checkpoint warns another rank)
        "classes": {kind: [describe(o) for o in objs] for kind, objs in objects.items()},
    }
    payload["checksum"] = payload_digest(payload)
    with _atomic_file(target) as f:
        torch.save(payload, f)
    return target


def _read(source: Path, map_location: str | torch.device | None) -> dict[str, Any]:
    """The verified payload of ``source``: readable, of a known format, and with a matching checksum."""
    if not source.is_file():
        raise CheckpointError(f"No checkpoint at {source}.", "check the path, or start without --resume.")
    try:
        # weights_only=False: `extra` holds whatever the caller put there, and checkpoints written before
        # rng_state kept NumPy's keys as a tensor hold a NumPy array; load only your own files.
        payload = torch.load(source, map_location=map_location, weights_only=False)
    except Exception as exc:  # a truncated or foreign file: say which, keep the cause
        raise CheckpointError(
            f"{source} is not a readable mixprec checkpoint ({type(exc).__name__}: {exc}).",
            "load an earlier checkpoint; files written by save_checkpoint are never left half-written.",
        ) from exc
    version = payload.get("format") if isinstance(payload, dict) else None
    if version not in (FORMAT_VERSION, *LEGACY_FORMATS):
        raise CheckpointError(
            f"{source} is not a mixprec checkpoint of format {FORMAT_VERSION}.",
            "write it with mixprec.checkpoint.save_checkpoint (of this mixprec version).",
        )
    if version in LEGACY_FORMATS:
        warnings.warn(f"{source} was written by an older mixprec without a checksum: loaded unverified. "
                      "The next save_checkpoint writes one.", stacklevel=3)
        return payload
    stored = payload.pop("checksum", None)
    if stored != payload_digest(payload):
        raise CheckpointError(
            f"{source} is damaged: its contents do not match the checksum saved with them (a changed bit "
            "in the file, from the disk, a copy or an edit).",
            "load an earlier checkpoint, or a copy of this one from elsewhere.",
        )
    return payload


def _validate(payload: Mapping[str, Any], objects: Mapping[str, list[Any]], loader: Any) -> None:
    """Everything load_checkpoint will load, checked against its target before anything is written."""
    # Models first: a dtype difference names the cause (another precision) of the differences after it.
    check_counts("model", objects["model"], payload["models"])
    for i, (obj, state) in enumerate(zip(objects["model"], payload["models"], strict=True)):
        check_model(i, obj, state)
    for kind, objs in objects.items():
        check_counts(kind, objs, payload[f"{kind}s"])
    classes = payload.get("classes", {})
    for kind, objs in objects.items():
        check_classes(kind, objs, classes.get(kind))
    for kind, check in (("optimizer", check_optimizer), ("scaler", check_scaler)):
        for i, (obj, state) in enumerate(zip(objects[kind], payload[f"{kind}s"], strict=True)):
            check(i, obj, state)
    check_can_save(objects["model"], objects["optimizer"], [])  # the inner optimizer of MasterWeights
    if loader is not None and payload["loader"] is None:
        raise CheckpointError(
            "The checkpoint has no data-loader position.",
            "save it with save_checkpoint(..., loader=...), or load without loader=.",
        )


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
    ``step``. Tensors are loaded to ``map_location`` first, then copied where the objects live.

    All or nothing: the checksum, and every object's class, tensor names, shapes, dtypes and param groups
    are checked first; a ``CheckpointError`` naming the difference leaves every object as it was."""
    payload = _read(Path(path), map_location)
    objects = _objects(model, optimizer, scaler, scheduler)
    if scaler is None:
        objects["scaler"] = _amp_scalers_to_load(objects["optimizer"], payload["scalers"], Path(path))
    _from_compiled_saves(payload, objects["model"])
    _validate(payload, objects, loader)
    # Optimizers after models: MasterWeights.load_state_dict copies the masters into the model weights.
    for kind, objs in objects.items():
        for obj, state in zip(objs, payload[f"{kind}s"], strict=True):
            obj.load_state_dict(state)
    if loader is not None:
        loader.load_state_dict(payload["loader"])
    if restore_rng:
        _warn_if_another_ranks_rng(payload.get("rank", 0), Path(path))
        set_rng_state(payload["rng"])
    return Resumed(payload["step"], payload["extra"])


def _warn_if_another_ranks_rng(saved_rank: int, source: Path) -> None:
    """One rank's RNG state restored on every rank gives them all the same dropout masks (each rank was
    seeded apart), and the run is no longer the one that was saved."""
    rank = process_rank()
    if rank != saved_rank:
        warnings.warn(
            f"{source} holds the RNG state of rank {saved_rank}, restored now on rank {rank}: every rank "
            "that loads it draws the same random numbers (dropout masks) from here on. To resume exactly, "
            "save one file per rank (each with its own RNG state); or pass restore_rng=False to keep each "
            "rank's own generator.", stacklevel=3)


def _amp_scalers_to_load(optimizers: Sequence[Any], saved: Sequence[Any], source: Path) -> list[Any]:
    """The loss scalers of ``initialize``'s optimizers, which save_checkpoint saved without being given
    them; a checkpoint from before it did (none saved) loads without them, and says the scale restarts."""
    scalers = loss_scalers_of(optimizers)
    if scalers and not saved:
        warnings.warn(
            f"{source} holds no loss scale (saved by an older mixprec, which kept initialize's loss scalers "
            f"only when passed as scaler=): the scale restarts at {scalers[0].get_scale():g}, and overflows "
            "skip a few steps to find its level again.", stacklevel=3)
        return []
    return scalers


def read_checkpoint(
    path: str | os.PathLike[str], map_location: str | torch.device | None = "cpu"
) -> dict[str, Any]:
    """The saved dict, verified (format, checksum), without loading it into anything: e.g. to see where
    a run stopped, or how it was set up, before building it."""
    return _read(Path(path), map_location)
