"""Fault injection (mixprec.faults), training through injected faults, NaN data detected by skip_limit,
and the errors misuse gets (wrong dtypes, mixed devices, a non-scalar loss, a double step)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import example
from torch import nn

import mixprec
from mixprec.errors import (
    ConfigError,
    DeviceMismatchError,
    Fp16GradientError,
    PersistentOverflowError,
    ScalerStateError,
)
from mixprec.faults import (
    FaultSchedule,
    inject_activation_faults,
    inject_grad_faults,
    nonfinite_optimizer_state,
)

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_amp_state")


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


# ---------------------------------------------------------------------------------------------- schedules
def test_schedule_depends_only_on_seed_and_index() -> None:
    s = FaultSchedule(frozenset({3}), rate=0.05, seed=7)
    forward = s.indices(2000)
    backward = [i for i in reversed(range(2000)) if s.fires(i)][::-1]
    assert forward == backward and 3 in forward
    # ~5% of 2000 = 100; binomial standard deviation ~9.7, so 60..140 is over 4 sigma either way
    assert 60 <= len(forward) <= 140
    assert FaultSchedule(rate=0.05, seed=8).indices(2000) != forward


@pytest.mark.parametrize("bad", [{"rate": 1.5}, {"rate": -0.1}, {"at": frozenset({-1})}])
def test_schedule_rejects_bad_settings(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        FaultSchedule(**bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- injection
@pytest.mark.parametrize("kind", ["inf", "-inf", "nan"])
def test_grad_fault_hits_one_element_at_chosen_backward_passes(kind: str) -> None:
    clean, poisoned = _net(), _net()
    x, y = _batch()
    injection = inject_grad_faults(poisoned[0].weight, at={1}, kind=kind, element=4)
    grads = []
    for _ in range(3):
        for net in (clean, poisoned):
            net.zero_grad()
            F.cross_entropy(net(x), y).backward()
        grads.append(poisoned[0].weight.grad.clone())
        ref = clean[0].weight.grad
        flat, ref_flat = grads[-1].view(-1), ref.view(-1)
        if len(grads) == 2:  # backward pass 1: element 4 poisoned, every other element untouched
            assert torch.equal(flat[4], torch.tensor(float(kind))) or (kind == "nan" and flat[4].isnan())
            assert torch.equal(torch.cat([flat[:4], flat[5:]]), torch.cat([ref_flat[:4], ref_flat[5:]]))
        else:
            assert torch.equal(grads[-1], ref)
    assert injection.fired == [1] and injection.calls == 3
    injection.remove()
    poisoned.zero_grad()
    F.cross_entropy(poisoned(x), y).backward()
    assert injection.calls == 3  # removed: no longer counting


def test_activation_fault_poisons_output_and_skips_eval_forwards() -> None:
    net = _net()
    x, _ = _batch()
    with inject_activation_faults(net[1], at={1}, kind="nan") as injection:
        first = net(x)
        net.eval()
        evaluated = net(x)  # not counted: validation does not shift the schedule
        net.train()
        second = net(x)
    assert bool(torch.isfinite(first).all()) and bool(torch.isfinite(evaluated).all())
    assert bool(second.isnan().any())  # the NaN flowed through the next layer
    assert injection.fired == [1] and injection.calls == 2
    assert bool(torch.isfinite(net(x)).all())  # the hook left with the `with` block


def test_nonfinite_optimizer_state_finds_what_an_unguarded_step_writes() -> None:
    """The reference: a plain Adam step on a NaN gradient writes NaN into the weights and the moments."""
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x, y = _batch()
    F.cross_entropy(net(x), y).backward()
    opt.step()
    assert nonfinite_optimizer_state(opt) == []
    net[2].bias.grad[0] = float("nan")
    opt.step()
    bad = nonfinite_optimizer_state(opt)
    assert "param_groups[0].params[3]" in bad and "state[param_groups[0].params[3]]['exp_avg']" in bad


# ---------------------------------------------------------------------------------------------- training
def test_training_survives_injected_faults() -> None:
    """Digits, fp16 model + fp32 masters: ~5% of steps get an inf gradient, ~2% a NaN activation."""
    recipe = example("fault_injection")
    clean = recipe.main(grad_rate=0.0, activation_rate=0.0, epochs=6)
    faulty = recipe.main(grad_rate=0.05, activation_rate=0.02, epochs=6)
    faults, skipped, scales = faulty["faults"], set(faulty["skipped"]), faulty["scales"]
    assert len(faults) >= 10
    assert faulty["corrupted"] == []  # never a non-finite master weight or Adam moment
    assert set(faults) <= skipped  # every poisoned step was skipped
    before = [2.0**16, *scales[:-1]]  # scales[i] is the scale after step i
    assert all(scales[s] == before[s] / 2 for s in faults)  # backed off at every fault...
    # ...and recovered: wherever more than growth_interval clean steps follow a fault, it grew again.
    windows = [(s, e) for s, e in zip(faults, [*faults[1:], len(scales)], strict=True)
               if e - s > recipe.GROWTH_INTERVAL]  # fmt: skip
    assert len(windows) >= 3
    assert all(max(scales[s + 1 : e]) > scales[s] for s, e in windows)
    assert abs(faulty["accuracy"] - clean["accuracy"]) <= 0.01  # within one point of the clean run
    assert clean["accuracy"] > 0.9


def test_nan_data_raises_persistent_overflow_after_k_skips() -> None:
    """A NaN in the data makes every step overflow whatever the scale: skip_limit turns the endless skipping
    into an error after exactly K consecutive skips. Intermittent overflow (backing off helps) does not."""
    k = 6
    x, y = _batch()
    x[2, 0] = float("nan")  # one bad sample in the batch
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = mixprec.GradScaler("cpu", skip_limit=k)
    steps = 0
    with pytest.raises(PersistentOverflowError, match="consecutive steps were skipped"):
        for steps in range(1, 100):  # noqa: B007 - `steps` is read after the raise
            opt.zero_grad()
            scaler.scale(F.cross_entropy(net(x), y)).backward()
            scaler.step(opt)
            scaler.update()
    assert steps == k
    assert net[0].weight.isfinite().all()  # nothing was written while it skipped

    net, scaler = _net(), mixprec.GradScaler("cpu", skip_limit=k)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    inject_grad_faults(net[0].weight, at={i for i in range(40) if i % 3 != 2})  # 2 of every 3 steps
    x, y = _batch()
    for _ in range(40):
        opt.zero_grad()
        scaler.scale(F.cross_entropy(net(x), y)).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.skipped_steps > k


# ---------------------------------------------------------------------------------------------- bad input
def test_fp16_gradients_without_masters_raise_like_torch() -> None:
    """Reference: torch.amp.GradScaler raises ValueError("Attempting to unscale FP16 gradients.")."""
    cases = ((torch.amp.GradScaler("cpu"), ValueError), (mixprec.GradScaler("cpu"), Fp16GradientError))
    for scaler, exc in cases:
        net = _net().half()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        x, y = _batch()
        scaler.scale(F.cross_entropy(net(x.half()).float(), y)).backward()
        with pytest.raises(exc, match="Attempting to unscale FP16 gradients"):
            scaler.step(opt)
    assert issubclass(Fp16GradientError, ValueError)  # code catching torch's error still catches ours


def test_scaler_on_a_foreign_device_raises() -> None:
    scaler = mixprec.GradScaler("cpu")
    with pytest.raises(DeviceMismatchError, match="made for device 'cpu'"):
        scaler.scale(torch.ones((), device="meta"))


def test_flat_masters_over_mixed_devices_raise() -> None:
    params = [nn.Parameter(torch.zeros(3, dtype=torch.float16, device=d)) for d in ("cpu", "meta")]
    with pytest.raises(ConfigError, match="one device per param group"):
        mixprec.MasterWeights(torch.optim.SGD(params, lr=0.1), flat=True)


def test_non_scalar_loss_gets_the_same_error_as_torch() -> None:
    """scaler.scale must accept non-scalar tensors (torch's API scales outputs for autograd.backward with
    grad_tensors), so the error comes from backward; it must be torch's, word for word."""
    x, y = _batch()
    messages = []
    for scaler in (torch.amp.GradScaler("cpu"), mixprec.GradScaler("cpu")):
        losses = F.cross_entropy(_net()(x), y, reduction="none")
        with pytest.raises(RuntimeError, match="only for scalar outputs") as info:
            scaler.scale(losses).backward()
        messages.append(str(info.value))
    assert messages[0] == messages[1]


def _o1_grads_of_per_sample_losses(
    backward: Callable[[torch.Tensor, torch.Tensor], None],
) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = mixprec.initialize(net, opt, opt_level="O1", verbosity=0)
    mixprec.amp.reset()  # the next call's initialize is a new run, not a second initialize of this one
    x, y = _batch()
    losses = F.cross_entropy(net(x), y, reduction="none")
    with mixprec.scale_loss(losses, opt) as scaled:
        backward(losses, scaled)
    return [p.grad.clone() for p in net.parameters()]


def test_scale_loss_takes_a_non_scalar_loss_as_apex_does() -> None:
    """apex's scale_loss docstring: the loss "could have more than one element, as long as you call
    backward() on scaled_loss appropriately". backward(gradient) gives the mean's gradients; a plain
    backward() gets torch's own error, as under apex (mixprec refused such a loss before)."""
    by_gradient = _o1_grads_of_per_sample_losses(
        lambda losses, scaled: scaled.backward(torch.full_like(scaled, 1 / len(scaled))))
    by_mean = _o1_grads_of_per_sample_losses(lambda losses, scaled: (scaled.sum() / len(scaled)).backward())
    for a, b in zip(by_gradient, by_mean, strict=True):
        torch.testing.assert_close(a, b)
    with pytest.raises(RuntimeError, match="only for scalar outputs"):
        _o1_grads_of_per_sample_losses(lambda losses, scaled: scaled.backward())


def test_scale_loss_refuses_what_is_not_a_loss() -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = mixprec.initialize(net, opt, opt_level="O1", verbosity=0)
    for not_a_loss in (1.5, torch.tensor([1, 2])):
        with pytest.raises(ConfigError, match="scales a floating-point tensor"):
            with mixprec.scale_loss(not_a_loss, opt):
                pass


def test_double_step_and_double_unscale_raise() -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = mixprec.GradScaler("cpu")
    x, y = _batch()
    scaler.scale(F.cross_entropy(net(x), y)).backward()
    scaler.unscale_(opt)
    with pytest.raises(ScalerStateError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(ScalerStateError, match="step\\(\\) has already been called"):
        scaler.step(opt)


def test_amp_double_step_after_overflow_does_not_write_inf() -> None:
    """scale_loss found an inf, so the next step() is skipped; a second step() without a new backward must
    not step on those same inf gradients."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = mixprec.initialize(net, opt, opt_level="O1", verbosity=0)
    inject_grad_faults(net[0].weight, at={0})
    x, y = _batch()
    with mixprec.scale_loss(F.cross_entropy(net(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    with pytest.raises(ScalerStateError, match="twice"):
        opt.step()
    assert bool(net[0].weight.isfinite().all())


def test_nonfinite_optimizer_state_agrees_with_a_per_tensor_check() -> None:
    net = _net()
    opt = torch.optim.SGD([{"params": net[0].parameters()}, {"params": net[2].parameters(), "lr": 0.5}],
                          lr=0.1, momentum=0.9)
    x, y = _batch()
    F.cross_entropy(net(x), y).backward()
    opt.step()
    with torch.no_grad():
        opt.state[net[2].weight]["momentum_buffer"][0, 0] = float("inf")  # state only, the weight is fine
        net[0].bias[1] = float("nan")
    # Reference: torch's own check of each tensor, one at a time.
    expected = []
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            if not torch.isfinite(p).all():
                expected.append(f"param_groups[{g}].params[{i}]")
            buf = opt.state[p]["momentum_buffer"]
            if not torch.isfinite(buf).all():
                expected.append(f"state[param_groups[{g}].params[{i}]]['momentum_buffer']")
    assert nonfinite_optimizer_state(opt) == expected
    assert expected == ["param_groups[0].params[1]", "state[param_groups[1].params[0]]['momentum_buffer']"]
