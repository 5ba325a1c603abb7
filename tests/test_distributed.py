"""Distributed mixed precision on CPU (gloo, world size 2, 127.0.0.1 only).

* DDP through the documented torchrun line: both ranks end with identical weights, which match a
  single-process run over the same global batches; an overflow on one rank makes every rank skip.
* Sharded gradients (each rank checks only its own shard): with ``sync_found_inf`` every rank skips and
  the run matches the single-process one; without it the ranks' scales diverge and so does training.
* FSDP2 (``fully_shard`` + ``MixedPrecisionPolicy``) with the scaler: fp16 compute, fp32 sharded
  gradients, skips agree across ranks, close to an fp32 single-process run.

The last two share one spawned process group (one start-up, about 10 s on 2 cores, instead of two).
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import EXAMPLES, example

from mixprec import distributed
from mixprec.distributed import DistInfo, _port_taken, _rank_error, free_port, launch
from mixprec.errors import ConfigError, DistributedError

ROOT = Path(__file__).resolve().parents[1]
STEPS, FAULT_STEP = 12, 4

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is needed"
    ),
]


def single() -> DistInfo:
    return DistInfo(0, 1, 0, torch.device("cpu"), None)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# ------------------------------------------------------------------------------------------- DDP, torchrun
def test_torchrun_ddp_two_ranks_match_single_process(tmp_path: Path) -> None:
    script = EXAMPLES / "ddp_train.py"
    args = ["--steps", "20", "--fault-step", "5"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(script), *args, "--fault-rank", "1", "--out", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    # identical on both ranks, bit for bit; the inf on rank 1 made both skip step 5
    assert all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"])
    assert r0["skipped_steps"] == r1["skipped_steps"] == 1
    assert r0["scales"] == r1["scales"] and r0["scales"][6] == r0["scales"][5] / 2
    # a single process over the same global batches, skipping the same step (its only rank is rank 0)
    ref = example("ddp_train").main([*args, "--fault-rank", "0"])
    assert ref["scales"] == r0["scales"]
    # step 0, same weights: the mean of the ranks' losses is the global batch's loss
    assert (r0["losses"][0] + r1["losses"][0]) / 2 == pytest.approx(ref["losses"][0], rel=1e-3)
    assert max_diff(r0["weights"], ref["weights"]) < 1e-2  # fp16 rounding in different summation orders


# ------------------------------------------------------------------------------- sharded and FSDP2, spawned
def scenarios(info: DistInfo, steps: int, fault_step: int) -> dict[str, Any]:
    """Runs in each spawned rank: both sharded variants, then FSDP2 (if this torch has it)."""
    out: dict[str, Any] = {"sharded": example("sharded_grads").compare(info, steps, fault_step)}
    try:
        fsdp = example("fsdp2_train")
    except ImportError as exc:  # torch without torch.distributed.fsdp.fully_shard
        out["fsdp2"] = f"unavailable: {exc}"
        return out
    out["o2_ddp_masters"] = _o2_ddp_masters(info)
    out["fsdp2"] = fsdp.train(info, steps, half=True, fault_step=fault_step, fault_rank=1)
    out["o2_after_fully_shard"] = _o2_after_fully_shard(info)
    out["casts_refused"] = _casts_of_wrapped_models(info)
    out["rng_warned"] = _rng_of_another_rank(info)
    out["no_sync_accumulation"] = _o2_no_sync_accumulation(info)
    return out


def _o2_no_sync_accumulation(info: DistInfo) -> dict[str, Any]:
    """O2 under DDP, two micro-batches a step, the first inside ddp.no_sync() (a user trial's loop): this
    rank's masters after two steps and the warnings scale_loss gave, with and without delay_unscale on
    the no_sync micro-batch."""
    import mixprec

    out: dict[str, Any] = {}
    for delay in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = mixprec.initialize(model, opt, "O2", verbosity=0)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        g = torch.Generator().manual_seed(1 + info.rank)  # each rank its own micro-batches
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for _ in range(2):
                with ddp.no_sync():
                    loss = ddp(torch.randn(4, 8, generator=g)).float().square().mean()
                    with mixprec.scale_loss(loss, opt, delay_unscale=delay) as scaled:
                        scaled.backward()
                loss = ddp(torch.randn(4, 8, generator=g)).float().square().mean()
                with mixprec.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                opt.step()
                opt.zero_grad()
        masters = torch.cat([m.detach().reshape(-1) for m in opt.master_views()])
        out["delayed" if delay else "unscaled"] = {
            "masters": masters.tolist(),
            "warnings": [str(w.message) for w in said if "no_sync" in str(w.message)],
            "warned_at": [Path(w.filename).name for w in said if "no_sync" in str(w.message)],
        }
        mixprec.amp.reset()
    return out


def _rng_of_another_rank(info: DistInfo) -> dict[str, bool]:
    """Whether load_checkpoint warns when a rank restores another rank's RNG state (a file saved on rank 0
    and loaded everywhere gave every rank rank 0's dropout masks, silently: a user trial)."""
    import shutil
    import tempfile

    from mixprec.checkpoint import load_checkpoint, save_checkpoint

    folder = Path(tempfile.gettempdir()) / f"mixprec-rng-{os.getppid()}"  # the spawner's: one per run
    folder.mkdir(exist_ok=True)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(folder / f"rank{info.rank}.pt", model=model, optimizer=opt)
    torch.distributed.barrier()  # both files written
    out = {}
    for whose in ("own", "other"):
        rank = info.rank if whose == "own" else 1 - info.rank
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_checkpoint(folder / f"rank{rank}.pt", model=model, optimizer=opt)
        out[whose] = any("holds the RNG state of rank" in str(w.message) for w in caught)
    torch.distributed.barrier()  # both ranks done reading: the folder goes (it was left in /tmp per run)
    if info.rank == 0:
        shutil.rmtree(folder)
    return out


def _casts_of_wrapped_models(info: DistInfo) -> dict[str, str]:
    """What a cast of a model DDP or FSDP2 already holds says, through initialize and the Learner. Before,
    initialize(DDP(model), "O2") and Learner(data, DDP(model)).to_fp16() trained the ranks apart with no
    error, and the Learner under FSDP2 failed in torch ("_foreach_copy_ ... no sharding strategy")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import mixprec

    def net() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).to(info.device)

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    data = mixprec.synthetic(n=32, input_shape=(4,), n_classes=2, batch_size=8, seed=0)
    attempts = {
        "initialize ddp": lambda m: mixprec.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), "O2",
                                                       verbosity=0),
        "learner ddp": lambda m: mixprec.Learner(data, m, silent=True).to_fp16().fit(steps=1),
        "learner fsdp2": lambda m: mixprec.Learner(data, m, silent=True).to_bf16().fit(steps=1),
    }
    out = {}
    for name, attempt in attempts.items():
        model = fully_shard(net(), mesh=mesh) if "fsdp2" in name else DistributedDataParallel(net())
        try:
            attempt(model)
            out[name] = "accepted"
        except mixprec.ConfigError as exc:
            out[name] = str(exc)
        finally:
            mixprec.amp.reset()
    return out


def _o2_ddp_masters(info: DistInfo) -> dict[str, list[float]]:
    """O2 in apex's order (initialize, then DDP) with each rank seeded differently: DDP's broadcast makes
    the half weights rank 0's, broadcast_masters the fp32 masters too. Returns this rank's masters and
    weights after three steps, per variant."""
    import mixprec

    out = {}
    for split, sync in ((s, y) for s in (False, True) for y in (False, True)):
        torch.manual_seed(info.rank)  # other initial weights on each rank
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = mixprec.initialize(model, opt, "O2", dtype=torch.bfloat16, verbosity=0,
                                        split_masters=split)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        if sync:
            distributed.broadcast_masters(opt)
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            loss = ddp(torch.randn(4, 8, generator=g)).float().square().mean()
            with mixprec.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
        masters = opt.master_values() if split else list(opt.master_views())
        values = [*masters, *(p.float() for p in model.parameters())]
        key = ("split masters, " if split else "") + ("synced" if sync else "ddp only")
        out[key] = torch.cat([v.detach().reshape(-1) for v in values]).tolist()
        mixprec.amp.reset()
    return out


def _o2_after_fully_shard(info: DistInfo) -> str:
    """What initialize(..., "O2") says to a model fully_shard already sharded (it used to accept it and
    fail later with a dtype mismatch in the forward, or a scale_loss error naming scaler.step)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import mixprec

    mesh = init_device_mesh(info.device.type, (info.world_size,))  # the rank's device, as fsdp2_train's
    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).to(info.device),
                        mesh=mesh)
    try:
        mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", verbosity=0)
    except mixprec.ConfigError as exc:
        return str(exc)
    finally:
        mixprec.amp.reset()
    return "accepted"


@pytest.fixture(scope="module")
def spawned() -> list[dict[str, Any]]:
    example("sharded_grads")  # puts examples/ on sys.path before the processes are spawned
    return launch(scenarios, 2, (STEPS, FAULT_STEP))


def test_sharded_gradients_need_sync_found_inf(spawned: list[dict[str, Any]]) -> None:
    ref = example("sharded_grads").train(single(), STEPS, sync=False, fault_step=FAULT_STEP)
    synced = [r["sharded"][True] for r in spawned]
    unsynced = [r["sharded"][False] for r in spawned]
    # with sync_found_inf: the overflow in rank 1's shard made both ranks skip; scales agree; the run
    # matches the single process that saw the whole gradient
    assert [r["skipped_steps"] for r in synced] == [1, 1]
    assert synced[0]["scales"] == synced[1]["scales"] == ref["scales"]
    assert all(max_diff(r["weights"], ref["weights"]) < 1e-3 for r in synced)
    # without it: rank 0 stepped, rank 1 skipped, the scales diverged, and training with them
    assert [r["skipped_steps"] for r in unsynced] == [0, 1]
    assert unsynced[0]["scales"][-1] != unsynced[1]["scales"][-1]
    assert all(max_diff(r["weights"], ref["weights"]) > 1e-2 for r in unsynced)


def test_fsdp2_mixed_precision_with_scaler(spawned: list[dict[str, Any]]) -> None:
    results = [r["fsdp2"] for r in spawned]
    if isinstance(results[0], str):
        pytest.skip(results[0])
    fsdp = example("fsdp2_train")
    ref = fsdp.train(single(), STEPS, half=False, fault_step=FAULT_STEP, fault_rank=0)
    for r in results:
        assert r["grad_types"] == ["DTensor[torch.float32]"]  # sharded fp32 gradients (reduce_dtype)
        assert r["skipped_steps"] == 1  # rank 1's local inf reached rank 0 through DTensor's found-inf reduce
        assert r["scales"] == ref["scales"]
        assert max_diff(r["weights"], ref["weights"]) < 2e-2  # fp16 params in compute vs fp32
    assert all(torch.equal(results[0]["weights"][k], results[1]["weights"][k]) for k in results[0]["weights"])


def test_o2_refuses_a_model_fsdp2_sharded_and_names_its_mixed_precision_policy(
    spawned: list[dict[str, Any]],
) -> None:
    if isinstance(spawned[0]["fsdp2"], str):
        pytest.skip(spawned[0]["fsdp2"])
    for r in spawned:
        assert "FSDP2 shards" in r["o2_after_fully_shard"]
        assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16" in r["o2_after_fully_shard"]


def test_restoring_another_ranks_rng_state_warns(spawned: list[dict[str, Any]]) -> None:
    if isinstance(spawned[0]["fsdp2"], str):
        pytest.skip(spawned[0]["fsdp2"])
    assert [r["rng_warned"] for r in spawned] == [{"own": False, "other": True}] * 2


def test_a_cast_of_a_model_ddp_or_fsdp2_holds_is_refused_through_every_interface(
    spawned: list[dict[str, Any]]
) -> None:
    if isinstance(spawned[0]["fsdp2"], str):
        pytest.skip(spawned[0]["fsdp2"])
    for r in spawned:
        said = r["casts_refused"]
        assert "already wrapped in DistributedDataParallel" in said["initialize ddp"]  # apex refused it too
        assert "then DistributedDataParallel(model)" in said["initialize ddp"]
        assert "already wrapped in DistributedDataParallel" in said["learner ddp"]
        assert "to_recipe('O1')" in said["learner ddp"]
        assert "FSDP2 shards" in said["learner fsdp2"]


def test_scale_loss_inside_no_sync_warns_that_the_ranks_drift(spawned: list[dict[str, Any]]) -> None:
    """Unscaling a no_sync micro-batch moves its gradients out of .grad before DDP's synchronising backward:
    the ranks' masters drift, and scale_loss says so once, at the user's line. delay_unscale keeps them
    in .grad: the ranks stay bit-identical, no warning."""
    if isinstance(spawned[0]["fsdp2"], str):
        pytest.skip(spawned[0]["fsdp2"])
    rank0, rank1 = (r["no_sync_accumulation"] for r in spawned)
    assert rank0["unscaled"]["masters"] != rank1["unscaled"]["masters"]  # the drift
    for r in (rank0, rank1):
        assert len(r["unscaled"]["warnings"]) == 1 and "delay_unscale=True" in r["unscaled"]["warnings"][0]
        assert r["unscaled"]["warned_at"] == ["test_distributed.py"]
        assert r["delayed"]["warnings"] == []
    assert rank0["delayed"]["masters"] == rank1["delayed"]["masters"]


def test_broadcast_masters_makes_o2_replicas_identical_under_ddp(spawned: list[dict[str, Any]]) -> None:
    """DDP broadcasts the half weights only: ranks seeded differently kept their own fp32 masters' low
    bits and their models drifted apart. With broadcast_masters the ranks stay identical."""
    rank0, rank1 = (r["o2_ddp_masters"] for r in spawned)
    for layout in ("", "split masters, "):  # the split layout: weights and low halves together
        assert rank0[layout + "ddp only"] != rank1[layout + "ddp only"]  # the drift the function removes
        assert rank0[layout + "synced"] == rank1[layout + "synced"]


def test_a_ranks_mixprec_error_keeps_its_problem_and_its_fix() -> None:
    """The summary kept a traceback's last line only: of a mixprec error, the "- fix:" line without the
    problem. The message is built as torch.multiprocessing builds it, from a real traceback."""
    try:
        raise ConfigError("THE PROBLEM: a bad setting.", "THE FIX: do this.")
    except ConfigError as exc:
        trace = "".join(traceback.format_exception(exc))
    message = f"\n\n-- Process 1 terminated with the following error:\n{trace}"
    error = _rank_error(1, [], datetime.timedelta(seconds=60), message)
    want = "rank 1 failed: mixprec.errors.ConfigError: THE PROBLEM: a bad setting.\n  - fix: THE FIX"
    assert want in str(error)


def test_only_the_store_failing_on_its_own_port_is_tried_again() -> None:
    """A review's case: any "address already in use" anywhere in a rank's traceback started the ranks
    again, so a user's function that failed binding its own socket ran three times."""
    store = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
             "network address. port: 41234, useIpv6: false, code: -98, name: EADDRINUSE, "
             "message: address already in use")
    assert _port_taken(store, 41234)
    assert not _port_taken(store, 41235)
    assert not _port_taken("OSError: [Errno 98] Address already in use", 41234)


def test_a_rank_whose_traceback_mentions_timeout_is_not_called_stalled() -> None:
    """The stall verdict read "timeout" anywhere in the traceback, whose source lines name setup(backend,
    timeout): a port already in use was reported as rank 0 waiting the whole timeout in a collective."""
    def setup(timeout: float) -> None:
        raise RuntimeError("The server socket has failed to listen: EADDRINUSE, address already in use")

    try:
        setup(timeout=300.0)
    except RuntimeError as exc:
        trace = "".join(traceback.format_exception(exc))
    assert "timeout" in trace
    error = _rank_error(0, [1], datetime.timedelta(seconds=300), trace)
    assert str(error).startswith("rank 0 failed: RuntimeError: The server socket")
    assert "waited" not in str(error)


# ------------------------------------------------------------------------------ a stalled rank (issue 14, 7)
def stall_on_rank_1(info: DistInfo, seconds: float) -> None:
    if info.rank == 1:
        time.sleep(seconds)  # a hung data loader, say: rank 0 is already waiting in the all-reduce
    dist.all_reduce(torch.ones(1))


def test_a_stalled_rank_is_named_once_the_timeout_expires() -> None:
    """Before, launch() had no timeout: rank 0 waited torch's default 30 minutes, silently."""
    start = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 0 waited 3 s .* had not finished then: 1\b") as err:
        launch(stall_on_rank_1, 2, (600.0,), timeout=3)
    assert "raise timeout=" in str(err.value.fix)
    assert time.monotonic() - start < 120  # process start-up on a loaded machine, plus 3 s; not 600 s


def test_a_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="timeout must be > 0"):
        launch(stall_on_rank_1, 2, (0.0,), timeout=0)


def killed_at_exit(info: DistInfo) -> int:
    """Finishes, then dies of a signal as its process shuts down (where gloo's C++ aborted in CI)."""
    import atexit
    import signal

    atexit.register(os.kill, os.getpid(), signal.SIGKILL)  # SIGKILL: no core file, unlike SIGABRT
    return info.rank


def killed_on_rank_1(info: DistInfo) -> int:
    if info.rank == 1:
        os.kill(os.getpid(), 9)  # SIGKILL, as the out-of-memory killer sends it
    dist.barrier()  # rank 0 waits here until launch stops it
    return info.rank


class _DiesWhileSaved:
    """A result whose pickling kills its process: a rank that dies while torch.save writes its file."""

    def __reduce__(self) -> Any:
        os.kill(os.getpid(), 9)
        return (int, ())  # not reached


def killed_while_saving_on_rank_1(info: DistInfo) -> Any:
    return _DiesWhileSaved() if info.rank == 1 else info.rank


def test_a_rank_killed_after_every_rank_saved_its_result_is_said_and_the_results_returned() -> None:
    """CI failed on a finished run: a rank aborted in gloo's C++ at interpreter shutdown, after its Python
    had ended, and launch passed on torch's bare ProcessExitedException."""
    said = r"rank [01] ended by signal SIGKILL after every rank had finished"
    with pytest.warns(RuntimeWarning, match=said):
        assert launch(killed_at_exit, 2) == [0, 1]


def test_a_rank_killed_before_it_finished_is_named_with_its_signal() -> None:
    with pytest.raises(DistributedError, match=r"rank 1 ended by signal SIGKILL before it had finished.* "
                                               r"stopped: 0\.") as err:
        launch(killed_on_rank_1, 2)
    assert "out-of-memory killer" in str(err.value.fix)


def test_a_rank_killed_while_writing_its_result_has_not_saved_it() -> None:
    """A result file is written whole, then renamed: a rank killed halfway left a file launch read as its
    saved result (it warned and returned, and then torch.load failed on the torn file)."""
    with pytest.raises(DistributedError, match=r"rank 1 ended by signal SIGKILL before it had finished"):
        launch(killed_while_saving_on_rank_1, 2)


def world_size(info: DistInfo) -> int:
    dist.barrier()
    return info.world_size


def test_a_port_taken_before_rank_0_binds_it_is_tried_on_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """free_port's race (another process takes the port before the group binds it): launch failed with the
    store's EADDRINUSE; it now starts again on a new port. Here the first port is held by a listener."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        ports = [held.getsockname()[1]]
        fresh = distributed.free_port
        monkeypatch.setattr(distributed, "free_port", lambda: ports.pop() if ports else fresh())
        assert launch(world_size, 2) == [2, 2]
        assert not ports  # the held port was tried first


@pytest.mark.parametrize(
    ("gpus", "local_world", "backend", "expected", "warns"),
    [
        (0, 2, None, ["cpu", "cpu"], False),  # no GPU: gloo on the CPU, as always
        (2, 2, None, ["cuda:0", "cuda:1"], False),  # a GPU per process: NCCL
        (1, 2, None, ["cpu", "cpu"], True),  # NCCL refuses two ranks on one GPU ("invalid usage"): CPU, said
        (1, 2, "nccl", ["cuda:0", "cuda:0"], False),  # asked for: as asked (NCCL then says what it says)
        (1, 2, "gloo", ["cpu", "cpu"], False),  # gloo asked for where GPUs would be shared: the CPU, quietly
        (1, None, None, ["cuda:0", "cuda:0"], False),  # srun-style, one GPU visible per process
        (8, None, None, ["cuda:0", "cuda:1"], False),  # 2 nodes x 8 GPUs without LOCAL_WORLD_SIZE
    ],
)
def test_each_process_gets_a_gpu_of_its_own_or_the_cpu(
    gpus: int, local_world: int | None, backend: str | None, expected: list[str], warns: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        devices = [str(distributed._device(rank, local_world, backend)) for rank in (0, 1)]
    assert devices == expected
    assert bool(caught) is warns
    assert all("--nproc_per_node 1" in str(w.message) for w in caught)


def test_broadcast_masters_refuses_the_optimizer_initialize_replaced_or_a_list() -> None:
    """Given the optimizer built before initialize (O2 returns a new one) or a list, it did nothing, and
    the ranks drifted apart unnoticed."""
    import mixprec

    model = torch.nn.Linear(4, 4)
    built = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.initialize(model, built, "O2", verbosity=0)
    with pytest.raises(ConfigError, match="initialize returned"):
        distributed.broadcast_masters(built)
    with pytest.raises(ConfigError, match="once per optimizer"):
        distributed.broadcast_masters([opt])
    mixprec.amp.reset()
