"""Rank-aware setup for distributed mixed-precision training, one code path for three ways to run:

* ``torchrun --nproc_per_node N script.py``: torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR`` and ``MASTER_PORT``; :func:`setup` reads them and joins the group.
* :func:`launch` (tests, notebooks, ``python script.py``): spawns N local processes that set the same
  variables (127.0.0.1 and a free port) and call the same :func:`setup`.
* a plain single process: no variables, :func:`setup` returns rank 0 of 1 and creates no group.

The backend follows the device (a table, not a branch per device): NCCL when each process has a GPU,
gloo on CPU. Mixed precision needs nothing distributed of its own: with DDP every rank all-reduces its
gradients before ``scaler.step``, so every rank sees the same inf/NaN and skips together. Only where
gradients are *not* all-reduced (sharded optimizers, model parallelism, ``no_sync``-style local
gradients) must the scaler all-reduce its inf flags: ``GradScaler(..., sync_found_inf=True)``.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mixprec.errors import ConfigError

__all__ = ["DistInfo", "BACKENDS", "setup", "teardown", "free_port", "launch"]

# device type -> the collective backend for it
BACKENDS: dict[str, str] = {"cuda": "nccl", "cpu": "gloo"}
LOCALHOST = "127.0.0.1"  # launch() binds to loopback only: a test must not open a port to the network
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistInfo:
    """Who this process is, and which device it trains on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: single process, no process group

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs and writes checkpoints."""
        return self.rank == 0


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def setup(backend: str | None = None) -> DistInfo:
    """Join the default process group when launched by torchrun or :func:`launch`, else do nothing.

    ``backend`` None picks from ``BACKENDS`` by device. On CUDA the current device is set to
    ``LOCAL_RANK`` so that NCCL and ``torch.cuda`` calls without an index use this process's GPU."""
    if not all(name in os.environ for name in _ENV):
        return DistInfo(0, 1, 0, _device(0), None)
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    device = _device(local_rank)
    backend = backend or BACKENDS[device.type]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def teardown() -> None:
    """Leave the process group (if any); call it once at the end of every process."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def free_port(host: str = LOCALHOST) -> int:
    """A TCP port nobody listens on now (the OS picks it). Another process could take it before the
    group binds it; on a test machine that race is rare enough."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _worker(
    local_rank: int,
    nprocs: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    backend: str | None,
    results: str,
) -> None:
    os.environ.update(
        RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs),
        MASTER_ADDR=LOCALHOST, MASTER_PORT=str(port),
    )  # fmt: skip
    if not torch.cuda.is_available():
        # As torchrun does: N processes sharing the CPU cores would oversubscribe them with N x threads.
        torch.set_num_threads(1)
    info = setup(backend)
    try:
        result = fn(info, *args)
        torch.save(result, Path(results) / f"rank{info.rank}.pt")
    finally:
        teardown()


def launch(
    fn: Callable[..., Any],
    nprocs: int = 2,
    args: tuple[Any, ...] = (),
    *,
    backend: str | None = None,
) -> list[Any]:
    """Run ``fn(info, *args)`` in ``nprocs`` new processes that form one process group on 127.0.0.1, and
    return what each rank returned, in rank order (results travel through ``torch.save`` files, so they
    must be picklable; move tensors to the CPU first).

    ``fn`` must be importable by name in a fresh interpreter (a module-level function of an importable
    module, or of the ``__main__`` script). An exception in any rank is re-raised here."""
    if nprocs < 1:
        raise ConfigError(f"nprocs must be >= 1, got {nprocs}.", "e.g. launch(fn, nprocs=2).")
    import torch.multiprocessing as mp  # local: only launchers need it

    with tempfile.TemporaryDirectory(prefix="mixprec-launch-") as results:
        mp.spawn(_worker, args=(nprocs, free_port(), fn, args, backend, results), nprocs=nprocs, join=True)
        return [torch.load(Path(results) / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]
