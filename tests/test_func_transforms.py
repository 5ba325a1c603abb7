"""mixprec.func_transforms: inside torch.func's transforms mixprec computes with plain ops, as torch.autocast
does. Each test is a failure a user trial (DP-SGD, a PINN, MAML) met on a CPU where mixprec emulates half
GEMMs; the suite's fp16 is emulated."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, hessian, jvp, vmap

import mixprec
from mixprec.func_transforms import inside_transform


def test_inside_transform_is_true_in_each_transform_and_dual_level_only() -> None:
    seen: list[bool] = []

    def note(x: torch.Tensor) -> torch.Tensor:
        seen.append(inside_transform())
        return x.sum()

    note(torch.ones(2))
    grad(note)(torch.ones(2))
    vmap(note)(torch.ones(2, 2))
    jvp(note, (torch.ones(2),), (torch.ones(2),))
    with torch.autograd.forward_ad.dual_level():
        seen.append(inside_transform())
    assert seen == [False, True, True, True, True] and not inside_transform()


def _pinn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))


def _second_derivative(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """u''(x) by nested forward mode (a PINN's residual), per point."""
    params = dict(model.named_parameters())

    def u(xi: torch.Tensor) -> torch.Tensor:
        return functional_call(model, params, (xi[None],)).squeeze()

    def du(xi: torch.Tensor) -> torch.Tensor:
        return jvp(u, (xi,), (torch.ones(1),))[1]

    return vmap(lambda xi: jvp(du, (xi,), (torch.ones(1),))[1])(x)


def test_a_second_derivative_by_nested_jvp_is_fp32s_and_trains_the_parameters() -> None:
    """It came out exactly 0, with no link to the parameters (O1/O2: a PINN trained on a zero residual)."""
    x = torch.linspace(0.1, 0.9, 5)[:, None]
    model = _pinn()
    reference = _second_derivative(model, x)
    reference.square().sum().backward()
    # fp32's gradients (the output bias has none: u'' does not depend on it)
    wanted = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with mixprec.autocast("cpu", torch.float16):
        d2 = _second_derivative(model, x)
    torch.testing.assert_close(d2.float(), reference, rtol=0, atol=16 * 2**-10 * reference.abs().max().item())
    d2.float().square().sum().backward()
    for p, want in zip(model.parameters(), wanted, strict=True):
        got = torch.zeros_like(p) if p.grad is None else p.grad
        torch.testing.assert_close(got, want, rtol=0, atol=32 * 2**-10 * want.abs().max().item() + 1e-6)
    assert sum(p.grad.abs().sum() for p in model.parameters() if p.grad is not None) > 0


def test_a_forward_after_a_hessian_in_the_same_region_keeps_its_gradients() -> None:
    """The region's cast cache kept the parameters' roundings made inside vmap(hessian): a later plain
    forward in the region reused them, with no autograd link to the parameters (a PINN diverged)."""
    x = torch.linspace(0.1, 0.9, 5)[:, None]
    model = _pinn()
    with mixprec.autocast("cpu", torch.float16):
        vmap(hessian(lambda xi: model(xi[None]).squeeze()))(x)
        out = model(x)
    assert out.requires_grad
    out.float().sum().backward()
    reference = _pinn()
    with mixprec.autocast("cpu", torch.float16):
        reference(x).float().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_second_order_maml_vmapped_over_tasks_runs_as_under_torch_autocast() -> None:
    """vmap over tasks of an inner grad step, then backward of the outer loss, raised a TypeError from
    functorch's _add_batch_dim (torch.autocast and a Python loop over tasks ran)."""
    model = nn.Linear(4, 1)
    params = dict(model.named_parameters())
    xs, ys = torch.randn(3, 8, 4, generator=torch.Generator().manual_seed(0)), torch.randn(3, 8, 1)

    def task_loss(xt: torch.Tensor, yt: torch.Tensor) -> torch.Tensor:
        def inner(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return F.mse_loss(functional_call(model, p, (xt,)).float(), yt)

        step = grad(inner)(params)
        adapted = {k: v - 0.1 * step[k] for k, v in params.items()}
        return F.mse_loss(functional_call(model, adapted, (xt,)).float(), yt)

    grads = []
    for region in (torch.autocast("cpu", torch.float16), mixprec.autocast("cpu", torch.float16)):
        model.zero_grad()
        with region:
            vmap(task_loss)(xs, ys).mean().backward()
        grads.append(model.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=4 * 2**-10 * grads[0].abs().max().item())


def test_an_o2_model_first_called_inside_vmap_runs() -> None:
    """The one-time input check read values inside vmap: "data-dependent control flow" on the first call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.initialize(model, opt, "O2", verbosity=0)
    out = vmap(lambda xi: model(xi[None]))(torch.randn(5, 2))
    assert out.shape == (5, 1, 1) and out.dtype is torch.float32
    mixprec.amp.reset()


@pytest.mark.parametrize("make", [lambda: torch.amp.GradScaler("cpu"), lambda: mixprec.GradScaler("cpu")],
                         ids=["torch", "mixprec"])
def test_a_scaler_first_used_inside_vmap_grad_updates_after_it(make: object) -> None:
    """scale(loss) first called on a per-sample loss made the scaler's state tensors inside the transform,
    and update() then failed ("Cannot access data pointer of Tensor that doesn't have storage")."""
    scaler = make()  # type: ignore[operator]
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def scaled(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return scaler.scale(F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None]))

    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    per_sample = vmap(grad(scaled), in_dims=(None, 0, 0))(params, x, y)
    for name, p in model.named_parameters():
        p.grad = per_sample[name].sum(0)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**16


def test_a_scaler_stuck_after_per_sample_losses_says_so_instead_of_failing() -> None:
    """The scaler kept the last loss scaled for its stuck message: one made inside vmap(grad) was a wrapped
    tensor, and reading it at the floor raised torch's "your tensor may have escaped" instead."""
    scaler = mixprec.GradScaler("cpu", init_scale=1.0, skip_limit=1)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def scaled(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return scaler.scale(F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None]))

    vmap(grad(scaled), in_dims=(None, 0, 0))(params, torch.randn(8, 4), torch.randint(0, 3, (8,)))
    for p in model.parameters():
        p.grad = torch.full_like(p, float("inf"))
    scaler.step(opt)
    with pytest.raises(mixprec.errors.PersistentOverflowError, match="At its floor"):
        scaler.update()
