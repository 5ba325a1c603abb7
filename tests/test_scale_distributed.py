"""``sync_found_inf=True`` when one rank's shard has no gradients in a step (issue 14 item 7): that rank
still joins the all-reduce of the inf flags, so both ranks skip (or step) together. Checked fast in one
process (the collective recorded), and for real with gloo on 2 local ranks (slow: two spawned processes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mixprec.distributed import DistInfo, launch
from mixprec.scaler import GradScaler

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is needed"
    ),
]


def _collectives(monkeypatch: pytest.MonkeyPatch, has_grads: bool) -> list[tuple[Any, float]]:
    """The all-reduces one iteration of a rank issues (op, the flag it contributes), with or without
    gradients in its shard; the process group is stood in for."""
    calls: list[tuple[Any, float]] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: calls.append((op, float(t))))
    shard = nn.Linear(3, 1)
    opt = torch.optim.SGD(shard.parameters(), lr=0.1)
    scaler = GradScaler("cpu", sync_found_inf=True)
    loss = shard(torch.ones(2, 3)).sum() if has_grads else torch.ones((), requires_grad=True)
    scaler.scale(loss).backward()
    scaler.step(opt)  # the rank without gradients neither hangs its peer nor raises
    scaler.update()
    return calls


def test_a_rank_without_gradients_issues_the_same_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    with_grads, without = _collectives(monkeypatch, True), _collectives(monkeypatch, False)
    assert with_grads == without == [(dist.ReduceOp.MAX, 0.0)]


def _rank(info: DistInfo) -> list[tuple[bool, bool]]:
    """Rank 0 owns a shard with gradients (inf in the first step); rank 1's shard gets none."""
    torch.manual_seed(0)
    shard = nn.Linear(3, 1)
    opt = torch.optim.SGD(shard.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**8, sync_found_inf=True)
    out = []
    for step in range(2):
        before = shard.weight.detach().clone()
        loss = shard(torch.ones(2, 3)).sum() if info.rank == 0 else torch.ones((), requires_grad=True)
        scaler.scale(loss).backward()
        if info.rank == 0 and step == 0:
            shard.weight.grad[0, 0] = float("inf")  # type: ignore[index]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out.append((scaler.last_step_skipped, not torch.equal(before, shard.weight)))
    return out


@pytest.mark.slow
def test_a_rank_without_gradients_joins_the_inf_all_reduce() -> None:
    results: list[Any] = launch(_rank, 2, backend="gloo")  # CPU tensors, on a machine with GPUs too
    # both ranks skip the first step (rank 0's inf), both take the second; only rank 0 has weights to move
    assert results[0] == [(True, False), (False, True)]
    assert results[1] == [(True, False), (False, False)]


def _two_pass_unscale_of_shards(info: DistInfo) -> list[tuple[float, list[float]]]:
    """Where torch's fused unscale has no kernel (bf16 on CUDA; forced here for bf16 on the CPU), the
    scaler checks each rank's shard: rank 1's shard of a 1-element gradient is empty, and the inf sits in
    rank 1's shard of the other gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from mixprec import scaler as scaler_module

    scaler_module.NO_FUSED_UNSCALE = frozenset({("cpu", torch.bfloat16)})
    mesh = init_device_mesh("cpu", (2,))
    out = []
    for last in (2.0, float("inf")):
        plain = [torch.tensor([3.0]), torch.tensor([1.0, 2.0, 4.0, last])]
        grads = [distribute_tensor(g.bfloat16(), mesh, [Shard(0)]) for g in plain]
        found = torch.zeros(())
        scaler_module.unscale_and_check_(grads, found, torch.tensor(0.5))
        out.append((found.item(), grads[0].full_tensor().float().tolist()))
    return out


@pytest.mark.slow
def test_the_two_pass_unscale_of_sharded_gradients_agrees_across_ranks() -> None:
    results: list[Any] = launch(_two_pass_unscale_of_shards, 2, backend="gloo")
    # both ranks: no flag, then the flag raised by rank 1's inf; the empty shard is no error; unscaled
    assert results[0] == results[1] == [(0.0, [1.5]), (1.0, [1.5])]
