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

import datetime
import os
import socket
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mixprec.errors import ConfigError, DistributedError

__all__ = [
    "DistInfo", "BACKENDS", "setup", "teardown", "free_port", "launch", "LAUNCH_TIMEOUT", "broadcast_masters",
    "process_rank", "forward_skips_grad_sync", "is_sharded",
]

# device type -> the collective backend for it
BACKENDS: dict[str, str] = {"cuda": "nccl", "cpu": "gloo"}
LOCALHOST = "127.0.0.1"  # launch() binds to loopback only: a test must not open a port to the network
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# launch()'s collective timeout, in seconds. Its processes share one machine and start together: a rank
# that has not joined a collective after 5 minutes has stalled (or died), it is not slow. torch's default
# (30 minutes for gloo) would leave the other ranks blocked, silent, for half an hour.
LAUNCH_TIMEOUT = 300.0


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


def process_rank() -> int:
    """This process's rank in the default process group; 0 where there is none (one process)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (an FSDP2 shard, a tensor-parallel piece). Duck-typed: the DTensor
    class moved between torch releases (torch.distributed._tensor, then torch.distributed.tensor)."""
    return hasattr(tensor, "to_local") and hasattr(tensor, "device_mesh")


def forward_skips_grad_sync() -> bool:
    """Whether the forward running now runs inside a ``DistributedDataParallel`` whose ``no_sync()`` is on:
    its backward leaves each rank's gradients local. False outside a DDP forward, and where this torch no
    longer names the active DDP module (a private attribute, read defensively)."""
    ddp = getattr(torch.nn.parallel.DistributedDataParallel, "_active_ddp_module", None)
    return ddp is not None and not getattr(ddp, "require_backward_grad_sync", True)


def _device(local_rank: int, local_world: int | None, backend: str | None) -> torch.device:
    """This process's GPU (``local_rank`` modulo the GPUs it sees), or the CPU.

    ``local_world`` is set by torchrun and :func:`launch`, whose processes on one machine all see the same
    GPUs: more processes than GPUs would put two ranks on one GPU, which NCCL refuses ("invalid usage").
    There the ranks train on the CPU with gloo (a warning says so unless gloo was asked for); asked for
    NCCL, they get the GPUs as asked.
    Without it (srun, mpirun: often one GPU made visible per process) every process takes a GPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus:
        return torch.device("cpu")
    shared = local_world is not None and local_world > gpus
    if shared and backend == "gloo":  # the CPU's backend asked for where GPUs would be shared: as asked
        return torch.device("cpu")
    if shared and backend is None:
        warnings.warn(
            f"{local_world} processes on this machine share {gpus} GPU(s), and NCCL needs a GPU per "
            f"process: the ranks train on the CPU with gloo. Fix: launch no more processes per machine than "
            f"it has GPUs ({gpus}: torchrun --nproc_per_node {gpus}) to train on the GPUs.",
            stacklevel=3,
        )
        return torch.device("cpu")
    return torch.device("cuda", local_rank % gpus)


def _timedelta(timeout: float | datetime.timedelta | None) -> datetime.timedelta | None:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        seconds = None if timeout is None else timeout.total_seconds()
    else:
        seconds = float(timeout)
    if seconds is not None and not seconds > 0:
        raise ConfigError(f"timeout must be > 0 seconds, got {seconds:g}.",
                          "pass the seconds a collective may wait for the slowest rank, e.g. timeout=300.")
    return None if seconds is None else datetime.timedelta(seconds=seconds)


def setup(backend: str | None = None, timeout: float | datetime.timedelta | None = None) -> DistInfo:
    """Join the default process group when launched by torchrun or :func:`launch`, else do nothing.

    ``backend`` None picks from ``BACKENDS`` by device. On CUDA the current device is set to
    ``LOCAL_RANK`` so that NCCL and ``torch.cuda`` calls without an index use this process's GPU.
    ``timeout`` (seconds or a timedelta): how long a collective waits for the other ranks before it
    raises, passed to ``init_process_group``; None keeps torch's default (30 minutes for gloo)."""
    wait = _timedelta(timeout)
    if not all(name in os.environ for name in _ENV):
        return DistInfo(0, 1, 0, _device(0, None, backend), None)
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    local_world = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
    device = _device(local_rank, local_world, backend)
    backend = backend or BACKENDS[device.type]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, **({} if wait is None else {"timeout": wait}))
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def teardown() -> None:
    """Leave the process group (if any); call it once at the end of every process."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@torch.no_grad()
def broadcast_masters(optimizer: Any, src: int = 0) -> None:
    """Give every rank ``src``'s fp32 master weights (and the half weights they round to).

    DistributedDataParallel broadcasts rank 0's model when it is built, i.e. the half weights under O2;
    each rank's masters take those values at the next step, but their fp32 bits below the half value are
    each rank's own (from its own initialisation), so replicas seeded differently drift apart. Call this
    after wrapping the model in DDP (``initialize``, then DDP, then this), or seed every rank alike. For
    a :class:`~mixprec.low_precision.LowPrecisionOptimizer` (``initialize(..., split_masters=True)``) it
    broadcasts the weights and the low halves that complete them. A no-op for an optimizer without
    masters."""
    from mixprec.amp import _inner
    from mixprec.low_precision import LowPrecisionOptimizer
    from mixprec.master import MasterWeights

    if isinstance(optimizer, (list, tuple)):
        raise ConfigError(f"broadcast_masters takes one optimizer, got a {type(optimizer).__name__}.",
                          "call it once per optimizer: for opt in optimizers: broadcast_masters(opt).")
    optimizer = _inner(optimizer)  # a LARC-style wrapper holds initialize's optimizer as .optim
    if isinstance(optimizer, LowPrecisionOptimizer):  # split masters (initialize's split_masters=True)
        _broadcast_bytes([p.data for g in optimizer.param_groups for p in g["params"]]
                         + optimizer.extra_tensors(), src)
        return
    if not isinstance(optimizer, MasterWeights):
        if getattr(optimizer, "_mixprec_replaced_at", None) is not None:  # initialize wrapped it
            raise ConfigError(
                "this optimizer was replaced by the one mixprec.initialize returned, which holds the fp32 "
                "masters.",
                "pass the optimizer initialize returned: model, opt = mixprec.initialize(model, opt, ...).",
            )
        return
    _broadcast_bytes(list(optimizer.master_views()), src)
    optimizer.copy_master_to_model()


def _broadcast_bytes(tensors: list[torch.Tensor], src: int) -> None:
    """``src``'s bytes of every tensor, in place, in one collective (not one per parameter): fp32 masters,
    or a LowPrecisionOptimizer's weights and per-parameter buffers (split: the masters' low halves, int16),
    whatever their dtypes. Bytes, not values: a broadcast moves them unchanged, and one uint8 buffer takes
    any mix of dtypes."""
    if not tensors:
        return
    # row-major bytes of each (a channels_last weight and its low half are copied into that order here)
    flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])
    dist.broadcast(flat, src=src)
    pieces = flat.split([t.numel() * t.element_size() for t in tensors])
    torch._foreach_copy_(tensors, [piece.view(t.dtype).view(t.shape) for t, piece in zip(tensors, pieces,
                                                                                        strict=True)])


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
    timeout: float,
    results: str,
) -> None:
    os.environ.update(
        RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR=LOCALHOST, MASTER_PORT=str(port),
    )  # fmt: skip
    if torch.cuda.device_count() < nprocs:  # the ranks train on the CPU (see _device)
        # As torchrun does: N processes sharing the CPU cores would oversubscribe them with N x threads.
        torch.set_num_threads(1)
    info = setup(backend, timeout)
    try:
        result = fn(info, *args)
        # written whole, then renamed: a rank killed while writing leaves no file that reads as saved
        partial = Path(results) / f"rank{info.rank}.pt.partial"
        torch.save(result, partial)
        os.replace(partial, Path(results) / f"rank{info.rank}.pt")
        if info.distributed:
            # Leave together: a rank that destroys the group while another still talks to it can abort
            # in gloo's C++. And once one rank is past here, every rank has saved its result, which is
            # how launch() tells a rank that died shutting down from one that died working (see
            # _ended_without_traceback). Not on an error path: launch() stops the other ranks then.
            dist.barrier()
    finally:
        teardown()


def launch(
    fn: Callable[..., Any],
    nprocs: int = 2,
    args: tuple[Any, ...] = (),
    *,
    backend: str | None = None,
    timeout: float | datetime.timedelta = LAUNCH_TIMEOUT,
) -> list[Any]:
    """Run ``fn(info, *args)`` in ``nprocs`` new processes that form one process group on 127.0.0.1, and
    return what each rank returned, in rank order (results travel through ``torch.save`` files, so they
    must be picklable; move tensors to the CPU first).

    ``fn`` must be importable by name in a fresh interpreter (a module-level function of an importable
    module, or of the ``__main__`` script). ``timeout``: seconds a collective waits for the other ranks
    (``LAUNCH_TIMEOUT`` by default). An exception in any rank -- a timeout included -- stops every rank
    and raises ``DistributedError`` naming the rank that failed, the ranks that had not finished then
    (the stalled ones, for a timeout), and the rank's own error (or the signal that ended it; a signal
    after every rank saved its result only warns: the results are complete). Where the port
    :func:`free_port` found was taken before rank 0 bound it, the ranks start again on another (three tries
    in all)."""
    if nprocs < 1:
        raise ConfigError(f"nprocs must be >= 1, got {nprocs}.", "e.g. launch(fn, nprocs=2).")
    wait = _timedelta(timeout)
    assert wait is not None  # a default is always given
    import torch.multiprocessing as mp  # local: only launchers need it

    tries_left = _PORT_ATTEMPTS
    while True:
        tries_left -= 1
        with tempfile.TemporaryDirectory(prefix="mixprec-launch-") as results:
            port = free_port()
            saved = [Path(results) / f"rank{r}.pt" for r in range(nprocs)]
            try:
                mp.spawn(_worker, args=(nprocs, port, fn, args, backend, wait.total_seconds(), results),
                         nprocs=nprocs, join=True)
            except mp.ProcessRaisedException as err:
                if tries_left and _port_taken(_exception_text(str(err)), port):
                    continue  # the free port was taken before rank 0 bound it: again, on another port
                unfinished = [r for r in range(nprocs) if r != err.error_index and not saved[r].exists()]
                raise _rank_error(err.error_index, unfinished, wait, str(err)) from err
            except mp.ProcessExitedException as err:  # killed by a signal, or exited without a traceback
                _ended_without_traceback(err, [r for r in range(nprocs) if not saved[r].exists()])
            return [torch.load(path, weights_only=False) for path in saved]


# free_port's race: between its answer and rank 0's bind, another process (a parallel test's gloo
# connections take ephemeral ports from the same range) can take the port; the store then fails to listen.
_PORT_ATTEMPTS = 3


def _port_taken(exception: str, port: int) -> bool:
    """Whether a rank's exception is the store failing to listen on ``port`` (not a user's own socket)."""
    return "failed to listen" in exception and "EADDRINUSE" in exception and f"port: {port}," in exception


_TIMEOUT_WORDS = ("timed out", "timeout")  # how gloo and NCCL word an expired collective


def _exception_text(message: str) -> str:
    """The exception at the end of a rank's traceback, every line of it: a mixprec error's problem and its
    "- fix:" line (the last line alone dropped the problem). The exception's first line is the traceback's
    last line that starts at column 0 (the frames above it are indented)."""
    lines = message.strip().splitlines()
    starts = [i for i, line in enumerate(lines) if line[:1].isalpha() and not line.startswith("Traceback")]
    return "\n".join(lines[starts[-1]:]) if starts else (lines[-1] if lines else "no message")


def _ended_without_traceback(err: Any, unfinished: list[int]) -> None:
    """A rank that died without a Python traceback: a signal (SIGKILL from the OOM killer, SIGSEGV) or
    ``os._exit``. Where every rank had saved its result, the run is complete: the ranks save theirs and
    then wait for each other before they leave the group, so one that dies after that died while its
    process shut down, where torch's gloo backend can abort in C++ ("terminate called without an active
    exception", SIGABRT, after the Python code has ended: 4 launches in 190 of the test suite's
    scenarios on 2 cores). That is said, and the results are returned. Else: a DistributedError."""
    how = f"signal {err.signal_name}" if err.signal_name else f"exit code {err.exit_code}"
    if not unfinished:
        warnings.warn(f"rank {err.error_index} ended by {how} after every rank had finished and saved its "
                      "result (torch's gloo backend can abort while a process shuts down); the results are "
                      "complete and returned.", RuntimeWarning, stacklevel=3)
        return
    stopped = ", ".join(str(r) for r in unfinished if r != err.error_index) or "none"
    raise DistributedError(
        f"rank {err.error_index} ended by {how} before it had finished, without a Python traceback; "
        f"the other ranks that had not finished were stopped: {stopped}.",
        "SIGKILL is often the out-of-memory killer (fewer ranks or a smaller batch); SIGSEGV or SIGABRT: a "
        "crash in native code (see the rank's stderr above); an exit code: the function called os._exit "
        "or sys.exit.",
    ) from err


def _rank_error(rank: int, unfinished: list[int], wait: datetime.timedelta, message: str) -> DistributedError:
    cause = _exception_text(message)
    # the exception's own words: the traceback's source lines name `timeout` too (setup(backend, timeout)),
    # which made a port already in use read as a stalled rank
    if any(word in cause.lower() for word in _TIMEOUT_WORDS):
        stalled = ", ".join(map(str, unfinished)) or "none still running (one may have died)"
        return DistributedError(
            f"rank {rank} waited {wait.total_seconds():g} s in a collective that the other ranks did not "
            f"join; rank(s) that had not finished then: {stalled}. ({cause})",
            "look at what those ranks were doing (a data loader that hangs, a rank that skipped a "
            "collective, an uneven number of batches); raise timeout= if they are only slow.",
        )
    return DistributedError(f"rank {rank} failed: {cause}",
                            f"see rank {rank}'s traceback above this error; the other ranks were stopped.")
