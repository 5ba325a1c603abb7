"""fp32 master weights: references are an fp32 run and the plain optimizer on fp32 copies."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import mixprec
from mixprec.errors import ConfigError, ParameterMismatchError
from mixprec.master import MasterWeights
from mixprec.scaler import GradScaler

HALF = [torch.float16, torch.bfloat16]
OPTS = {
    "sgd_momentum": lambda ps, **kw: torch.optim.SGD(ps, lr=0.05, momentum=0.9, **kw),
    "adam": lambda ps, **kw: torch.optim.Adam(ps, lr=1e-2, **kw),
    "adamw": lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
}


def _net(seed: int = 0, bn: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(6, 12)]
    if bn:
        layers.append(nn.BatchNorm1d(12))
    layers += [nn.ReLU(), nn.Linear(12, 3)]
    return nn.Sequential(*layers)


def _data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)


def test_update_below_fp16_resolution_stalls_without_masters() -> None:
    """weight 1.0, update 1e-4: fp16's spacing at 1.0 is 2**-10 ~ 9.8e-4, so 1 + 1e-4 rounds back to 1."""
    steps, lr = 100, 1e-4
    results = {}
    for name in ("fp32", "naive_fp16", "master_fp16"):
        dtype = torch.float32 if name == "fp32" else torch.float16
        w = nn.Parameter(torch.ones(1, dtype=dtype))
        opt: torch.optim.Optimizer = torch.optim.SGD([w], lr=lr)
        if name == "master_fp16":
            opt = MasterWeights(opt)
        for _ in range(steps):
            (-w.float()).sum().backward()  # gradient -1: each step adds lr
            opt.step()
            opt.zero_grad()
        results[name] = w
        if name == "master_fp16":
            results["master"] = next(iter(opt.master_views()))  # type: ignore[attr-defined]
    assert results["naive_fp16"].item() == 1.0  # stalled: not one update landed
    assert results["master"].item() == pytest.approx(results["fp32"].item(), rel=1e-6)  # fp32 accumulates
    # the fp16 model weight is the master rounded to nearest
    assert results["master_fp16"].item() == results["master"].half().item() != 1.0


@pytest.mark.parametrize("dtype", HALF)
def test_master_training_tracks_fp32_and_naive_half_falls_behind(dtype: torch.dtype) -> None:
    """Linear regression with small updates: masters follow fp32, half-only weights drift or stall."""
    torch.manual_seed(0)
    x = torch.randn(256, 32)
    w_true = torch.randn(32, 1)
    y = x @ w_true
    w0 = 4.0 + torch.randn(32, 1)  # weights of magnitude ~4: fp16 spacing 2**-8, bf16 spacing 2**-5

    def train(kind: str) -> torch.Tensor:
        w = nn.Parameter(w0.clone().to(torch.float32 if kind == "fp32" else dtype))
        opt: torch.optim.Optimizer = torch.optim.SGD([w], lr=2e-4)
        scaler = GradScaler("cpu", init_scale=1024.0, enabled=kind == "master")
        if kind == "master":
            opt = MasterWeights(opt)
        for _ in range(300):
            loss = ((x.to(w.dtype) @ w).float() - y).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return w.detach().float()

    ref, master, naive = train("fp32"), train("master"), train("naive")
    moved = (ref - w0).abs().mean()
    err_master = (master - ref).abs().mean()
    err_naive = (naive - ref).abs().mean()
    spacing = 2.0**-8 if dtype == torch.float16 else 2.0**-5
    assert err_master <= spacing  # within the rounding of storing the fp32 result in half precision
    assert err_naive > 0.3 * moved  # the half-only run lost a good part of the way fp32 went


@pytest.mark.parametrize("opt_name", sorted(OPTS))
@pytest.mark.parametrize("dtype", HALF)
def test_master_step_equals_fp32_optimizer_on_upcast_weights(opt_name: str, dtype: torch.dtype) -> None:
    """One step: masters must equal the same optimizer stepping fp32 copies with the same (upcast) grads."""
    half = _net().to(dtype)
    ref = copy.deepcopy(half).float()
    wrapped = MasterWeights(OPTS[opt_name](half.parameters(), foreach=True), fused=False)
    plain = OPTS[opt_name](ref.parameters(), foreach=True)
    for i in range(3):
        x, y = _data(i)
        nn.functional.cross_entropy(half(x.to(dtype)).float(), y).backward()
        for p, q in zip(half.parameters(), ref.parameters(), strict=True):
            q.grad = p.grad.float()
        wrapped.step()
        plain.step()
        for m, q in zip(wrapped.master_views(), ref.parameters(), strict=True):
            assert torch.equal(m, q)
        # the model holds the masters rounded to its dtype; the reference keeps full fp32 (we re-sync it to
        # the model's starting point so the next step compares like with like)
        for p, m in zip(half.parameters(), wrapped.master_views(), strict=True):
            assert torch.equal(p, m.to(dtype))
        wrapped.zero_grad()
        plain.zero_grad()


@pytest.mark.parametrize("opt_name", sorted(OPTS))
def test_flat_equals_per_parameter(opt_name: str) -> None:
    models, opts = [], []
    for flat in (False, True):
        m = _net().to(torch.bfloat16)
        models.append(m)
        opts.append(MasterWeights(OPTS[opt_name](m.parameters()), flat=flat))
    for i in range(5):
        x, y = _data(i)
        for m, o in zip(models, opts, strict=True):
            nn.functional.cross_entropy(m(x.bfloat16()).float(), y).backward()
            o.step()
            o.zero_grad()
    for a, b in zip(opts[0].master_views(), opts[1].master_views(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert len(opts[1].param_groups[0]["params"]) == 1  # one flat buffer


def test_fused_matches_foreach() -> None:
    runs = []
    for fused in (None, False):
        m = _net().to(torch.bfloat16)
        opt = MasterWeights(torch.optim.AdamW(m.parameters(), lr=1e-2), fused=fused)
        assert opt.param_groups[0]["fused"] is (True if fused is None else None)  # AdamW: auto-fused
        for i in range(5):
            x, y = _data(i)
            nn.functional.cross_entropy(m(x.bfloat16()).float(), y).backward()
            opt.step()
            opt.zero_grad()
        runs.append(list(opt.master_views()))
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_complex_parameter_keeps_the_optimizers_own_update() -> None:
    """torch's fused Adam takes real parameters only: MasterWeights picked it for an FNO's complex weight
    and the first step raised "`fused=True` requires all the params to be floating point". The step now
    equals torch's Adam on the same parameters; asking for the fused kernel is refused by name."""
    torch.manual_seed(0)
    lin, w = nn.Linear(4, 4), nn.Parameter(0.3 * torch.randn(4, 4, dtype=torch.cfloat))
    ref_lin, ref_w, start = copy.deepcopy(lin), copy.deepcopy(w), w.detach().clone()
    lin.to(torch.bfloat16)
    opt = MasterWeights(torch.optim.Adam([*lin.parameters(), w], lr=1e-2))
    ref = torch.optim.Adam([*ref_lin.parameters(), ref_w], lr=1e-2)
    x = torch.randn(8, 4)
    for model_lin, weight, o in ((lin, w, opt), (ref_lin, ref_w, ref)):
        z = model_lin(x.to(model_lin.weight.dtype)).to(torch.cfloat) @ weight
        (z.real + z.imag).square().mean().backward()
        o.step()
    assert not opt.param_groups[0].get("fused")
    torch.testing.assert_close(w, ref_w, rtol=1e-2, atol=1e-4)  # the bf16 layer's rounding reaches w's grad
    assert not torch.equal(w.detach(), start)  # it moved
    with pytest.raises(ConfigError, match="1 parameter.s. are complex"):
        MasterWeights(torch.optim.Adam([*nn.Linear(4, 4).bfloat16().parameters(), w]), fused=True)
    fused = MasterWeights(torch.optim.Adam(nn.Linear(4, 4).bfloat16().parameters()))  # real: fused picked
    with pytest.raises(ConfigError, match="fused=False"):  # torch refused its step later (a review)
        fused.add_param_group({"params": [nn.Parameter(torch.randn(2, dtype=torch.cfloat))]})


def test_batchnorm_fp32_params_are_their_own_masters() -> None:
    model = _net(bn=True).to(torch.float16)
    model[1].float()  # BatchNorm kept in fp32, as O2 does
    opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    params = opt.param_groups[0]["params"]
    assert any(p is model[1].weight for p in params) and any(p is model[1].bias for p in params)
    assert all(p.dtype == torch.float32 for p in params)
    assert len(list(opt.master_views())) == 4  # the two Linear layers' weights and biases


def test_zero_grad_clears_model_and_master_grads() -> None:
    model = _net().half()
    opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(4, 6).half()).float().sum().backward()
    opt.copy_grads_to_master()
    assert all(m.grad is not None for m in opt.master_views())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert all(m.grad is None for m in opt.master_views())


@pytest.mark.parametrize("flat", [False, True])
def test_with_scaler_param_groups_and_scheduler(flat: bool) -> None:
    model = _net().half()
    groups = [
        {"params": model[0].parameters(), "lr": 0.1},
        {"params": model[2].parameters(), "lr": 0.01},
    ]
    opt = MasterWeights(torch.optim.SGD(groups, momentum=0.9), flat=flat, model=model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = GradScaler("cpu", init_scale=2.0**20)  # overflows at first: fp16 grads become inf
    before = [p.clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(12):
            x, y = _data(i)
            with mixprec.half_compute("cpu", torch.float16):  # bare, the first step warns: slow fp16 here
                loss = nn.functional.cross_entropy(model(x.half()), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad()
    assert scaler.skipped_steps >= 1
    assert [g["lr"] for g in opt.param_groups] == [0.1 * 0.5**12, 0.01 * 0.5**12]
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(torch.isfinite(m).all() for m in opt.master_params())


@pytest.mark.filterwarnings("ignore::mixprec.errors.MasterStateWarning")  # reads the inner state
def test_overflow_leaves_masters_and_state_untouched() -> None:
    model = _net().half()
    opt = MasterWeights(torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True))
    scaler = GradScaler("cpu", init_scale=256.0)
    x, y = _data(0)
    for poison in (False, True):
        scaler.scale(nn.functional.cross_entropy(model(x.half()).float(), y)).backward()
        if poison:
            masters = [m.clone() for m in opt.master_views()]
            state = copy.deepcopy(opt.optimizer.state_dict())
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(masters, opt.master_views(), strict=True))
    assert str(opt.optimizer.state_dict()) == str(state)


@pytest.mark.parametrize("flat", [False, True])
def test_state_dict_resumes_without_rounding_through_half(flat: bool) -> None:
    def fresh() -> tuple[nn.Module, MasterWeights]:
        m = _net().half()
        return m, MasterWeights(torch.optim.Adam(m.parameters(), lr=1e-3), flat=flat)

    def train(m: nn.Module, o: MasterWeights, its: range) -> None:
        for i in its:
            x, y = _data(i)
            nn.functional.cross_entropy(m(x.half()).float(), y).backward()
            o.step()
            o.zero_grad()

    m1, o1 = fresh()
    train(m1, o1, range(8))
    m2, o2 = fresh()
    train(m2, o2, range(4))
    saved = copy.deepcopy((m2.state_dict(), o2.state_dict()))
    m3, o3 = fresh()
    m3.load_state_dict(saved[0])
    o3.load_state_dict(saved[1])
    loaded, saved_masters = list(o3.master_views()), list(o2.master_views())
    assert all(torch.equal(a, b) for a, b in zip(loaded, saved_masters, strict=True))
    assert any(not torch.equal(b, b.half().float()) for b in saved_masters)  # more bits than fp16 holds
    train(m3, o3, range(4, 8))
    for a, b in zip(o1.master_views(), o3.master_views(), strict=True):
        assert torch.equal(a, b)
    # load_state_dict replaced the wrapped optimizer's lists; the wrapper (what schedulers hold) shows the new
    assert o3.param_groups is o3.optimizer.param_groups and o3.state is o3.optimizer.state


def test_optimizer_of_another_model_is_named() -> None:
    model, other = _net().half(), _net(1).half()
    with pytest.raises(ParameterMismatchError, match="not parameters of the given model"):
        MasterWeights(torch.optim.SGD(other.parameters(), lr=0.1), model=model)


def test_wrapping_twice_or_after_stepping_is_an_error() -> None:
    model = _net().half()
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(ConfigError, match="twice"):
        MasterWeights(MasterWeights(opt))  # type: ignore[arg-type]
    model2 = _net().half()
    opt2 = torch.optim.Adam(model2.parameters())
    model2(torch.randn(2, 6).half()).float().sum().backward()
    opt2.step()
    with pytest.raises(ConfigError, match="before its first step"):
        MasterWeights(opt2)


def test_load_state_dict_keeps_the_implementation_the_wrapper_chose() -> None:
    """A checkpoint from a non-fused run loaded into an auto-fused wrapper must still step under a scaler."""
    saved_model = _net().half()
    saved = MasterWeights(torch.optim.Adam(saved_model.parameters(), lr=1e-3), fused=False)
    saved_model(torch.randn(2, 6).half()).float().sum().backward()
    saved.step()
    model = _net().half()
    opt = MasterWeights(torch.optim.Adam(model.parameters(), lr=1e-3))  # auto-fused
    opt.load_state_dict(saved.state_dict())
    assert opt.param_groups[0]["fused"] is True
    scaler = GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 6).half()).float().sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert all(torch.isfinite(m).all() for m in opt.master_views())


_LAYOUTS = {"per parameter": {}, "flat": {"flat": True}, "fused, no master grads": {"master_grads": False}}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weights_loaded_after_wrapping_reach_the_masters(layout: str, dtype: torch.dtype) -> None:
    """``model.load_state_dict`` after the masters were made (apex's order: initialize, then load; loading
    pretrained weights into a wrapped model) left the masters stale: the next step wrote the old weights
    back. apex makes its masters from the model at the first step: an lr=0 step keeps the loaded ones."""
    loaded_from = _net(seed=1)
    model = _net(seed=0).to(dtype)
    opt = MasterWeights(torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0), **_LAYOUTS[layout])
    model.load_state_dict(loaded_from.state_dict())
    want = [p.detach().clone() for p in model.parameters()]
    assert not all(torch.equal(w, p.to(dtype)) for w, p in zip(want, _net(seed=0).parameters(), strict=True))
    x, y = _data(0)
    nn.functional.cross_entropy(model(x.to(dtype)).float(), y).backward()
    opt.step()
    for p, w in zip(model.parameters(), want, strict=True):
        assert torch.equal(p, w)
    for m, w in zip(opt.master_views(), want, strict=True):
        assert torch.equal(m, w.float())  # the exact upcast, as apex's masters


class _ActNorm(nn.Module):
    """Glow's data-dependent init as rosinality's glow-pytorch writes it: through .data, in the first
    training forward (a .data write moves no version counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(6))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.initialized:
            self.loc.data.copy_(-x.mean(0))
            self.initialized.fill_(1)
        return x + self.loc


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_a_data_dependent_init_through_data_reaches_the_masters(layout: str) -> None:
    """A trial's Glow: the first forward's init through .data was undone by the first step (the masters
    held the values from before it): every value is compared at the first step."""
    torch.manual_seed(0)
    model = nn.Sequential(_ActNorm(), nn.Linear(6, 3)).to(torch.bfloat16)
    opt = MasterWeights(torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0), **_LAYOUTS[layout])
    x = torch.randn(8, 6).add(5).to(torch.bfloat16)
    model(x).float().sum().backward()
    initialized = model[0].loc.detach().clone()
    assert initialized.abs().min() > 3
    opt.step()
    assert torch.equal(model[0].loc, initialized)
    assert torch.equal(next(opt.master_views()), initialized.float())


def test_a_write_that_keeps_the_half_value_keeps_the_masters_fp32_bits() -> None:
    """A parameter written with the value it had (a broadcast from an identical rank) is not an edit: its
    master keeps the bits below half precision that the next steps build on."""
    model = _net(seed=0).to(torch.float16)
    opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1), initial=None)
    fp32 = dict(zip([id(p) for p in model.parameters()], _net(seed=0).parameters(), strict=True))
    with torch.no_grad():
        for p, m in zip(opt.model_params(), opt.master_views(), strict=True):
            m.copy_(fp32[id(p)])  # the masters as initialize seeds them: the fp32 weights
            p.copy_(p.clone())  # a write of the same value: the version moves
    before = [m.clone() for m in opt.master_views()]
    assert any(not torch.equal(b, b.half().float()) for b in before)  # bits below fp16 to lose
    opt.zero_grad()
    opt.step()  # no gradients: nothing moves, the masters must stay exactly
    for m, b in zip(opt.master_views(), before, strict=True):
        assert torch.equal(m, b)


def test_a_write_of_some_elements_keeps_the_others_fp32_bits() -> None:
    """Writing a few elements (an Embedding's max_norm renormalises rows in its forward; a clamp) took the
    whole tensor's upcast into its master: every other element lost its fp32 bits at every step, and the
    weight trained as if it had no master. Only the changed elements take the model's value."""
    model = nn.Linear(4, 3).to(torch.bfloat16)
    opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    master = next(opt.master_views())
    with torch.no_grad():
        master.mul_(1 + 2.0**-12)  # bits below bf16 (its half ulp is 2**-9 relative): still the same rounding
        model.weight[0].mul_(2.0)  # an edit of row 0 only
    before = master.clone()
    opt.zero_grad()
    opt.step()  # no gradients: the masters only take the edit
    assert torch.equal(master[0], model.weight[0].float())  # the edited row: the model's value
    assert torch.equal(master[1:], before[1:])  # the others keep their fp32 bits


def test_torchs_grad_scaler_is_refused_with_the_fix() -> None:
    """torch.amp.GradScaler checks the optimizer's parameters (the masters, gradient-less until step) and
    hands a fused step found_inf=0, an int: it crashed inside torch's kernel ('int' object has no
    attribute 'device'). Refused, naming mixprec.GradScaler, with which the same calls step."""
    for scaler_cls in (torch.amp.GradScaler, GradScaler):
        torch.manual_seed(0)
        model = nn.Linear(8, 4).half()
        opt = MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-3), fused=True)
        scaler = scaler_cls("cpu", init_scale=16.0)  # no overflow in the first step
        loss = model(torch.randn(2, 8).half()).float().sum()
        scaler.scale(loss).backward()
        before = model.weight.detach().clone()
        if scaler_cls is GradScaler:
            scaler.step(opt)
            assert not torch.equal(model.weight, before)
            continue
        with pytest.raises(ConfigError, match="mixprec.GradScaler"):
            scaler.step(opt)
        assert torch.equal(model.weight, before)


def test_a_disabled_torch_grad_scaler_steps_as_before() -> None:
    """GradScaler(enabled=use_fp16), as bf16 runs write it: a disabled torch scaler only calls step()."""
    model = nn.Linear(8, 4).bfloat16()
    opt = MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-3), fused=True)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    scaler.scale(model(torch.randn(2, 8).bfloat16()).float().sum()).backward()
    before = model.weight.detach().clone()
    scaler.step(opt)
    assert not torch.equal(model.weight, before)


def test_frozen_half_parameters_in_the_optimizer_are_warned_of_with_their_cost() -> None:
    """torch's optimizer spends nothing on a parameter that never gets a gradient; MasterWeights makes it
    an fp32 master (so unfreezing it later trains it): a LoRA's frozen base passed as model.parameters()
    costs 4 bytes an element more than fp32 training. Said once, with the bytes and the fix; an optimizer
    of the trainable parameters alone is not warned about."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2)).to(torch.bfloat16)
    model[0].requires_grad_(False)
    said = r"holds 2 frozen parameters \(requires_grad=False, 144 elements\)"
    with pytest.warns(UserWarning, match=said) as rec:
        opt = MasterWeights(torch.optim.AdamW(model.parameters()))
    message = str(next(w.message for w in rec if "frozen" in str(w.message)))
    assert "576 bytes" in message and "if p.requires_grad" in message
    assert sum(m.numel() for m in opt.master_views()) == sum(p.numel() for p in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainable = MasterWeights(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    assert sum(m.numel() for m in trainable.master_views()) == 16 * 2 + 2
