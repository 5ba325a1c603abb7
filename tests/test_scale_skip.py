"""The one skip decision (issue 13 item 3): ``step_unless_inf`` and the combined inf flag, against plain
fp32 torch.optim runs that step or do not."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_scaler import _NoSync
from torch import nn

from mixprec.errors import ScalerStateError
from mixprec.scaler import GradScaler, combined_found_inf, skips_on_device, step_unless_inf

OPTS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "host": lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=True),
    "device": lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True),
}


def _param_with_grad(value: float) -> nn.Parameter:
    p = nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), value)
    return p


@pytest.mark.parametrize("kind", sorted(OPTS))
@pytest.mark.parametrize("found", [0.0, 1.0])
def test_step_unless_inf_steps_exactly_when_the_flag_is_clear(kind: str, found: float) -> None:
    p, ref = _param_with_grad(0.5), _param_with_grad(0.5)
    opt, ref_opt = OPTS[kind]([p]), torch.optim.Adam([ref], lr=0.1)
    assert skips_on_device(opt) is (kind == "device")
    calls = []

    def step() -> str:
        calls.append(1)
        return opt.step() or "stepped"

    result = step_unless_inf(opt, torch.tensor(found), step)
    if not found:
        ref_opt.step()
    torch.testing.assert_close(p, ref, rtol=0, atol=0)
    assert not hasattr(opt, "found_inf")  # the fused path cleans up after itself
    if kind == "host":  # the host path never calls step on a skip; the device path always does
        assert (result, len(calls)) == ((None, 0) if found else ("stepped", 1))
        assert getattr(opt, "_opt_called", False) is bool(found)


def test_device_path_never_syncs() -> None:
    p = _param_with_grad(0.5)
    opt = OPTS["device"]([p])
    with _NoSync():
        step_unless_inf(opt, torch.tensor(1.0), opt.step)
    assert torch.equal(p, torch.ones(4))


def test_combined_flag_skips_every_optimizer_when_one_overflowed() -> None:
    """apex's rule: one overflowing loss skips every optimizer passed to its scale_loss."""
    scaler = GradScaler("cpu", init_scale=2.0**8)
    a, b = nn.Linear(3, 1), nn.Linear(3, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    before = [p.detach().clone() for p in (*a.parameters(), *b.parameters())]
    scaler.scale(a(torch.ones(2, 3)).sum() + b(torch.ones(2, 3)).sum()).backward()
    b.weight.grad[0, 0] = float("nan")
    scaler.unscale_(opt_a)
    scaler.unscale_(opt_b)
    with _NoSync():
        only_a, both = scaler.found_inf_async(opt_a), scaler.found_inf_async(opt_a, opt_b)
    assert float(only_a) == 0 and float(both) > 0
    for opt in (opt_a, opt_b):
        step_unless_inf(opt, both, opt.step)
    after = [p.detach() for p in (*a.parameters(), *b.parameters())]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))


def test_two_overflowing_flags_still_skip_a_fused_step() -> None:
    """torch's fused optimizers skip only when found_inf == 1: a summed flag (2.0) would step on inf."""
    p = _param_with_grad(float("inf"))
    opt = OPTS["device"]([p])
    two = [torch.tensor(1.0), torch.tensor([1.0])]  # two devices, or two ranks, or two losses
    step_unless_inf(opt, combined_found_inf(two), opt.step)
    assert torch.equal(p, torch.ones(4))
    summed = _param_with_grad(float("inf"))
    opt = OPTS["device"]([summed])
    step_unless_inf(opt, torch.tensor(2.0), opt.step)  # what a sum hands the kernel: it steps
    assert not torch.isfinite(summed).all()


def test_found_inf_async_without_checks_says_what_to_do() -> None:
    scaler = GradScaler("cpu")
    scaler.scale(torch.ones(()))
    with pytest.raises(ScalerStateError, match="before update"):
        scaler.found_inf_async()
