"""Mistakes around MasterWeights that used to drop the masters silently: casting the model after wrapping
it, and saving or loading the wrapped optimizer instead of the wrapper."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

from mixprec.errors import ConfigError, MasterStateWarning
from mixprec.master import MasterWeights
from mixprec.scaler import GradScaler


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))


def _loss(model: nn.Module, dtype: torch.dtype, i: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    return nn.functional.cross_entropy(model(x.to(dtype)).float(), y)


@pytest.mark.parametrize("cast", ["bfloat16", "half"])
@pytest.mark.parametrize("with_scaler", [False, True])
def test_cast_after_wrapping_is_refused_at_step(cast: str, with_scaler: bool) -> None:
    """Built over fp32 parameters, the wrapper kept no masters; stepping the model in half precision
    without them is what it exists to prevent. The error names the order that works; wrapping already
    warns (an all-fp32 wrapper was accepted silently)."""
    model = _net()
    with pytest.warns(UserWarning, match="keeps no fp32 masters and the model trains in fp32"):
        opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    getattr(model, cast)()
    dtype = next(model.parameters()).dtype
    before = [p.clone() for p in model.parameters()]
    scaler = GradScaler("cpu", enabled=with_scaler)
    with pytest.raises(ConfigError, match="cast the model first"):
        scaler.scale(_loss(model, dtype)).backward()
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_saving_the_wrapped_optimizer_warns_and_the_wrapper_does_not() -> None:
    model = _net().half()
    opt = MasterWeights(torch.optim.Adam(model.parameters(), lr=1e-3))
    _loss(model, torch.float16).backward()
    opt.step()
    with pytest.warns(MasterStateWarning, match=r"opt\.state_dict\(\)"):
        opt.optimizer.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sd = opt.state_dict()
        opt.load_state_dict(sd)


def test_loading_the_wrapped_optimizer_reseeds_masters_from_the_loaded_model() -> None:
    """Resume from the wrapped optimizer's state: the masters must not stay at their pre-load values
    (the first step would write those stale values over the loaded model)."""
    trained = _net().half()
    opt = MasterWeights(torch.optim.Adam(trained.parameters(), lr=1e-2))
    for i in range(3):
        _loss(trained, torch.float16, i).backward()
        opt.step()
        opt.zero_grad()
    with pytest.warns(MasterStateWarning):
        saved = (trained.state_dict(), opt.optimizer.state_dict())
    fresh = _net().half()
    resumed = MasterWeights(torch.optim.Adam(fresh.parameters(), lr=1e-2))
    fresh.load_state_dict(saved[0])
    with pytest.warns(MasterStateWarning, match="re-seeded"):
        resumed.optimizer.load_state_dict(saved[1])
    for m, p in zip(resumed.master_views(), fresh.parameters(), strict=True):
        assert torch.equal(m, p.float())


def test_a_plain_state_dict_loads_and_reseeds_the_masters_from_the_model() -> None:
    """apex O2 loaded an optimizer state saved before initialize; the masters then come from the model
    (an exact upcast of its half weights), never stale values of before the load, and a warning says so."""
    model = _net().half()
    opt = MasterWeights(torch.optim.Adam(model.parameters()))
    with torch.no_grad():
        for v in opt.master_views():
            v.add_(1.0)  # masters that differ from the model: stale if kept
    plain = torch.optim.Adam(_net().half().parameters())
    with pytest.warns(MasterStateWarning, match="re-seeded from the model"):
        opt.load_state_dict(plain.state_dict())
    for master, half in zip(opt.master_views(), opt.model_params(), strict=True):
        assert torch.equal(master, half.float())


# ---- from a contract run against torch.optim (2026-11-25) -------------------------------------------------


def _norms() -> nn.Module:
    """Three layer norms, the middle one fp32 among half ones (as O2 keeps some layers fp32)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(4), nn.LayerNorm(4), nn.LayerNorm(4))
    model[0].bfloat16()
    model[2].bfloat16()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.linspace(-1, 1, 4) * (i + 1))  # distinct per tensor, exact in bf16
    return model


def test_a_state_dict_numbers_tensors_as_the_plain_optimizer_of_the_fp32_model() -> None:
    """The wrapper put the half parameters' masters first and the fp32 ones after: a plain Adam of the fp32
    model then loaded the third layer's moments into the second (same shape, silently)."""
    half = _norms()
    opt = MasterWeights(torch.optim.Adam(half.parameters(), lr=0.1))
    fp32 = _norms().float()
    ref = torch.optim.Adam(fp32.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    for model in (half, fp32):
        h = x
        for layer in model:
            h = layer(h.to(next(layer.parameters()).dtype)).float()
        (h * torch.arange(4.0)).sum().backward()
    with torch.no_grad():  # the reference's gradients: the half model's, upcast
        for r, p in zip(fp32.parameters(), half.parameters(), strict=True):
            r.grad = p.grad.float()
    opt.step()
    ref.step()
    plain = torch.optim.Adam(_norms().float().parameters(), lr=0.1)
    plain.load_state_dict(opt.state_dict())
    for got, want in zip(plain.state.values(), ref.state.values(), strict=True):
        assert torch.equal(got["exp_avg"], want["exp_avg"])


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("impl", [{}, {"foreach": False}, {"fused": True}])
def test_adagrad_is_wrapped_and_steps_as_on_fp32_parameters(flat: bool, impl: dict[str, bool]) -> None:
    """Adagrad makes its state when built, which the "already stepped" check took for a step: it could not
    be wrapped at all. Its accumulator now starts at initial_accumulator_value in fp32 (0.1 is not a bf16)."""
    half = _net().bfloat16()
    fp32 = _net()
    fp32.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    settings = {"lr": 0.1, "initial_accumulator_value": 0.1, **impl}
    opt = MasterWeights(torch.optim.Adagrad(half.parameters(), **settings), flat=flat)
    # Where no kernel was chosen the wrapper picks torch's fused one: the reference runs it too (fused and
    # single-tensor Adagrad round differently on some CPUs: an AVX2 EPYC, not an AMX Xeon)
    ref = torch.optim.Adagrad(fp32.parameters(), **(settings if impl else {**settings, "fused": True}))
    _assert_steps_like_fp32(half, fp32, opt, ref)


def _assert_steps_like_fp32(
    half: nn.Module, fp32: nn.Module, opt: MasterWeights, ref: torch.optim.Optimizer, no_grad_first: str = ""
) -> None:
    """Three steps of ``opt`` on the half model and of ``ref`` on the fp32 copy, given the half gradients
    upcast (the parameter named ``no_grad_first`` gets none in the first): the masters equal the copy."""
    for i in range(3):
        _loss(half, torch.bfloat16, i).backward()
        for (name, r), p in zip(fp32.named_parameters(), half.parameters(), strict=True):
            r.grad = None if (i == 0 and name == no_grad_first) else p.grad.float()
            p.grad = None if r.grad is None else p.grad
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    for master, want in zip(opt.master_views(), fp32.parameters(), strict=True):
        assert torch.equal(master, want)


def test_an_adagrad_that_stepped_is_still_refused() -> None:
    model = _net().bfloat16()
    inner = torch.optim.Adagrad(model.parameters(), lr=0.1)
    _loss(model, torch.bfloat16).backward()
    inner.step()
    with pytest.raises(ConfigError, match="already stepped"):
        MasterWeights(inner)


@pytest.mark.parametrize("flat", [False, True])
def test_a_plainly_pickled_wrapper_trains_like_a_deep_copy(flat: bool) -> None:
    """Plain pickle stored the flat buffer's views as copies of their own: the unpickled wrapper stepped the
    buffer and rounded the model from the stale copies, so the model never changed."""
    model = _net().bfloat16()
    opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.5), flat=flat)
    pickled = pickle.loads(pickle.dumps((model, opt)))
    copied = copy.deepcopy((model, opt))
    for m, o in (pickled, copied):
        _loss(m, torch.bfloat16).backward()
        o.step()
    for p, c, before in zip(pickled[0].parameters(), copied[0].parameters(), model.parameters(), strict=True):
        assert torch.equal(p, c) and not torch.equal(p, before)


def _stepped_norms() -> tuple[nn.Module, MasterWeights]:
    half = _norms()
    opt = MasterWeights(torch.optim.Adam(half.parameters(), lr=0.1))
    x = torch.randn(5, 4)
    h = x
    for layer in half:
        h = layer(h.to(next(layer.parameters()).dtype)).float()
    (h * torch.arange(4.0)).sum().backward()
    opt.step()
    return half, opt


def _masters_first(sd: dict, half: nn.Module) -> dict:
    """The state_dict a MasterWeights saved before 02bb826: each group numbered the masters first, then the
    fp32 parameters, and had no "order" key."""
    is_half = [p.dtype is torch.bfloat16 for p in half.parameters()]
    ids = sd["param_groups"][0]["params"]
    pairs = list(zip(ids, is_half, strict=True))
    old_order = [i for i, h in pairs if h] + [i for i, h in pairs if not h]
    state = {k: sd["state"][i] for k, i in enumerate(old_order) if i in sd["state"]}
    groups = [{**sd["param_groups"][0], "params": list(range(len(ids)))}]
    return {**{k: v for k, v in sd.items() if k != "order"}, "state": state, "param_groups": groups}


def test_a_checkpoint_saved_with_the_masters_first_is_renumbered_on_load() -> None:
    """Before, loading it put one layer's moments on another (same shapes: silently; other shapes: the fused
    kernel wrote past the tensor)."""
    half, opt = _stepped_norms()
    old = _masters_first(opt.state_dict(), half)
    fresh = MasterWeights(torch.optim.Adam(_norms().parameters(), lr=0.1))
    fresh.load_state_dict(old)
    pairs = zip(fresh.param_groups[0]["params"], opt.param_groups[0]["params"], strict=True)
    for got, want in pairs:
        assert torch.equal(fresh.state[got]["exp_avg"], opt.state[want]["exp_avg"])


def test_state_that_would_land_on_a_tensor_of_another_shape_is_refused() -> None:
    model = nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.Linear(12, 3))
    model[0].bfloat16()
    model[2].bfloat16()
    opt = MasterWeights(torch.optim.Adam(model.parameters(), lr=0.1))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    sd["state"][2], sd["state"][4] = sd["state"][4], sd["state"][2]  # BatchNorm's weight gets a Linear's
    with pytest.raises(ConfigError, match=r"of shape \(3, 12\) would load onto a tensor of shape \(12,\)"):
        MasterWeights(torch.optim.Adam(model.parameters(), lr=0.1)).load_state_dict(sd)


def test_a_copy_of_a_copied_flat_wrapper_is_made() -> None:
    """relink made the flat members views of the buffer with autograd history: deepcopy refused a copy."""
    model = _net().bfloat16()
    opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.5), flat=True)
    twice = copy.deepcopy(copy.deepcopy((model, opt)))
    assert all(v.is_leaf and not v.requires_grad for v in twice[1].master_views())


def test_adagrad_takes_the_constructors_initial_value_for_every_group_as_torch() -> None:
    half, fp32 = _net().bfloat16(), _net()
    groups = lambda m: [{"params": m[0].parameters(), "initial_accumulator_value": 0.5},  # noqa: E731
                        {"params": m[2].parameters()}]  # fmt: skip
    opt = MasterWeights(torch.optim.Adagrad(groups(half), lr=0.1, initial_accumulator_value=0.25))
    ref = torch.optim.Adagrad(groups(fp32), lr=0.1, initial_accumulator_value=0.25)
    assert [float(s["sum"].flatten()[0]) for s in opt.state.values()] == [
        float(s["sum"].flatten()[0]) for s in ref.state.values()]


def _torch_adagrad_steps_an_added_group() -> bool:
    """torch 2.11's Adagrad made its state in __init__ only: a group added later failed its first step
    (KeyError 'sum'); 2.13 makes it lazily. The test below compares with torch's own run of it."""
    net = nn.Linear(2, 2)
    opt = torch.optim.Adagrad([nn.Parameter(torch.zeros(1))])
    opt.add_param_group({"params": net.parameters()})
    net(torch.ones(2)).sum().backward()
    try:
        opt.step()
    except KeyError:
        return False
    return True


@pytest.mark.skipif(not _torch_adagrad_steps_an_added_group(), reason="this torch's Adagrad cannot step a "
                    "group added later (KeyError 'sum'): there is no torch run to compare with")  # fmt: skip
def test_an_adagrad_group_added_later_starts_from_its_initial_value_in_a_flat_buffer() -> None:
    """A member without a gradient in the new group's first step: the flat layout's hole guard zeroed the
    state torch makes lazily, so that member's accumulator started from 0 instead of 0.1."""
    half, fp32 = _net().bfloat16(), _net()
    fp32.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    opt = MasterWeights(torch.optim.Adagrad(half[0].parameters(), lr=0.1, initial_accumulator_value=0.1),
                        flat=True)  # fmt: skip
    # the fused kernel, as the wrapper picked (see test_adagrad_is_wrapped_and_steps_as_on_fp32_parameters)
    ref = torch.optim.Adagrad(fp32[0].parameters(), lr=0.1, initial_accumulator_value=0.1, fused=True)
    opt.add_param_group({"params": half[2].parameters()})
    ref.add_param_group({"params": fp32[2].parameters()})
    _assert_steps_like_fp32(half, fp32, opt, ref, no_grad_first="2.bias")  # the new group's bias


def test_a_wrapper_with_an_lr_scheduler_pickles() -> None:
    model = _net().bfloat16()
    opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    torch.optim.lr_scheduler.StepLR(opt, 1)
    assert len(list(pickle.loads(pickle.dumps(opt)).master_views())) == len(list(opt.master_views()))


class _LowRank(torch.optim.SGD):
    """A third-party optimizer (GaLore-style) whose "exp_avg" is not shaped like its parameter."""

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["exp_avg"] = p.grad.sum(0, keepdim=True)


def test_state_of_another_shape_loads_for_an_optimizer_outside_torch_optim() -> None:
    model = _net().bfloat16()
    opt = MasterWeights(_LowRank(model.parameters(), lr=0.1))
    _loss(model, torch.bfloat16).backward()
    opt.step()
    MasterWeights(_LowRank(model.parameters(), lr=0.1)).load_state_dict(opt.state_dict())


class _MyAdamW(torch.optim.AdamW):
    """A user's subclass that keeps torch's step: its state names mean what AdamW's do."""


def test_state_of_another_shape_is_refused_for_a_subclass_that_keeps_torchs_step() -> None:
    """The check ran only for classes defined in torch.optim: a subclass elsewhere loaded a (4, 8) moment
    onto a (16, 16) master, and the fused step then wrote past it (a segfault)."""
    small = torch.optim.AdamW(nn.Linear(8, 4).parameters(), lr=0.1)
    for p in small.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    small.step()
    big = nn.Linear(16, 16).bfloat16()
    with pytest.raises(ConfigError, match=r"of shape \(4, 8\) would load onto a tensor of shape \(16, 16\)"):
        MasterWeights(_MyAdamW(big.parameters(), lr=0.1), fused=True).load_state_dict(small.state_dict())


@pytest.mark.parametrize("fused", [False, True])
def test_adagrads_remade_step_count_has_torchs_dtype(fused: bool) -> None:
    """The remade step count was always fp32; torch makes it fp64 under an fp64 default dtype (unfused)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        half, fp32 = _net().bfloat16(), _net().float()
        opt = MasterWeights(torch.optim.Adagrad(half.parameters(), lr=0.1), fused=fused)
        ref = torch.optim.Adagrad(fp32.parameters(), lr=0.1, fused=fused or None)
    finally:
        torch.set_default_dtype(previous)
    steps = [s["step"] for s in opt.optimizer.state.values()]
    want = next(iter(ref.state.values()))["step"]
    assert steps and all(s.dtype == want.dtype and s.device == want.device for s in steps)
