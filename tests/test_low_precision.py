"""Pure half-precision training (LowPrecisionOptimizer). References: an fp32 run of the same torch.optim
optimizer on the same gradients, exact IEEE-754 neighbours, fp32 master weights (MasterWeights)."""

from __future__ import annotations

import copy
import math
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec.data import digits
from mixprec.errors import ConfigError, UnsupportedParameterError
from mixprec.low_precision import LowPrecisionOptimizer, UpdateMode, footprint, stochastic_round
from mixprec.master import MasterWeights
from mixprec.scaler import GradScaler

BF16, FP16 = torch.bfloat16, torch.float16
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])]
MODES = [m.value for m in UpdateMode]
OPTS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd_momentum": lambda ps, lr=0.05: torch.optim.SGD(ps, lr=lr, momentum=0.9),
    "adamw": lambda ps, lr=1e-2: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1),
}


def _modes_for(dtype: torch.dtype) -> list[str]:
    return [m for m in MODES if not (m == "split" and dtype is FP16)]  # split is bf16 only (tested below)


def _spacing_below_one(dtype: torch.dtype) -> float:
    """The distance between neighbours of ``dtype`` on [0.5, 1): half its epsilon (the spacing above 1)."""
    return torch.finfo(dtype).eps / 2


# --------------------------------------------------------------------------------------------- the stall
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_classic_stall_naive_stalls_every_other_mode_tracks_fp32(dtype: torch.dtype, device: str) -> None:
    """Weight 1.0, SGD lr=1e-4 with gradient 1: 1 - 1e-4 is nearer to 1.0 than to the next value below
    (half the spacing below 1.0 is 2**-9 ~ 2e-3 in bf16, 2**-12 ~ 2.4e-4 in fp16): a plain update stalls."""
    steps, lr, m = 300, 1e-4, 4096  # m independent weights: stochastic rounding draws for each
    ref = torch.ones(m, device=device)
    for _ in range(steps):
        ref -= lr  # the fp32 run, same update order
    ulp = _spacing_below_one(dtype)  # the spacing on [0.5, 1), where the weights live after the first step
    result = {}
    for mode in _modes_for(dtype):
        w = nn.Parameter(torch.ones(m, dtype=dtype, device=device))
        opt = LowPrecisionOptimizer(torch.optim.SGD([w], lr=lr), mode)
        for _ in range(steps):
            w.grad = torch.ones_like(w)
            opt.step()
        result[mode] = (w.detach().float(), opt.master_values()[0])
    naive_w, _ = result["naive"]
    # 1 - 1e-4 is nearer to 1.0 than to the next value below (1 - ulp), whenever ulp/2 > 1e-4: it stalls.
    assert ulp / 2 > lr and torch.equal(naive_w, torch.ones_like(ref))
    if "split" in result:  # the fp32 master itself: bit for bit the fp32 run
        assert torch.equal(result["split"][1], ref)
    # kahan: each step rounds the compensation (|c| <= ulp/2) to the weight's dtype, an error of at most half
    # its ulp: (ulp/2) * (eps/2). Over `steps` steps that bounds the drift from fp32.
    kahan_bound = steps * (ulp / 2) * (torch.finfo(dtype).eps / 2)
    assert (result["kahan"][1] - ref).abs().max().item() <= kahan_bound < 0.1 * steps * lr
    # stochastic: each rounding is unbiased with variance <= ulp**2/4, so one weight's drift has std
    # <= sqrt(steps) * ulp/2 and the mean of m independent weights std <= that / sqrt(m); allow 4 sigma.
    sigma_mean = math.sqrt(steps) * ulp / 2 / math.sqrt(m)
    assert abs(result["stochastic"][0].mean().item() - ref[0].item()) <= 4 * sigma_mean < 0.1 * steps * lr


# --------------------------------------------------------------------------------------------- rounding
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour(dtype: torch.dtype) -> None:
    """Values between two neighbours of ``dtype`` (normal, negative and fp16-subnormal): every draw is one of
    the two neighbours, and the mean of n draws is within 4 standard errors of the value, where the standard
    error is sqrt(p(1-p)/n) * (high - low) with p the value's position between its neighbours."""
    low = torch.tensor([1.0, -3.0, 0.7, 2.0**-20, 12345.0]).to(dtype)
    high = torch.nextafter(low, torch.full_like(low, math.inf))
    frac = torch.tensor([0.5, 0.1, 0.9, 0.3, 0.77])
    x = (low.float() + frac * (high.float() - low.float()))
    n = 20_000
    gen = torch.Generator().manual_seed(1)
    draws = stochastic_round(x.repeat(n), dtype, gen).view(n, -1)
    assert ((draws == low) | (draws == high)).all()
    gap = (high.float() - low.float()).abs()
    p = (x - low.float()) / (high.float() - low.float())
    stderr = torch.sqrt(p * (1 - p) / n) * gap
    assert ((draws.float().mean(0) - x).abs() <= 4 * stderr).all()
    exact = low.repeat(3)  # representable values are returned unchanged
    assert torch.equal(stochastic_round(exact.float(), dtype, gen), exact)


# --------------------------------------------------------------------------------------------- split is fp32
def _groups(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in [(16, 8), (8,), (3, 16), (3,)]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", OPTS)
def test_split_reconstructs_the_fp32_optimizer_bit_for_bit(opt_name: str, device: str) -> None:
    """Two param groups (different lr), a StepLR schedule, chunks smaller than a group: the 16+16 master is
    the fp32 optimizer's weight bit for bit, and the bf16 weight is that master rounded to nearest. The
    generic step (the native Adam step's own reference is tests/test_split_adam.py)."""
    init = [t.to(device) for t in _groups(BF16)]
    half = [nn.Parameter(t.clone()) for t in init]
    ref = [nn.Parameter(t.float()) for t in init]

    def build(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
        return OPTS[opt_name]([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.003}])

    opt = LowPrecisionOptimizer(build(half), "split", chunk_numel=100, kernel="generic")
    ref_opt = build(ref)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (opt, ref_opt)]
    ptrs = [p.data_ptr() for p in half]
    g = torch.Generator().manual_seed(2)
    for _ in range(10):
        for h, r in zip(half, ref, strict=True):
            h.grad = torch.randn(h.shape, generator=g).to(device, BF16)
            r.grad = h.grad.float()  # the same gradients, exactly
        opt.step()
        ref_opt.step()
        for s in scheds:
            s.step()
    masters = opt.master_values()
    for h, r, m in zip(half, ref, masters, strict=True):
        assert torch.equal(m.view(torch.int32), r.detach().view(torch.int32))
        nearest = r.detach().to(BF16)  # torch's round-to-nearest-even; ours rounds ties away from zero
        tie = (r.detach().view(torch.int32) & 0xFFFF) == 0x8000
        assert torch.equal(h.detach()[~tie], nearest[~tie])
    assert [p.data_ptr() for p in half] == ptrs  # the model's storage is written in place
    assert opt.param_groups[1]["lr"] == ref_opt.param_groups[1]["lr"] != 0.003  # the schedule reached it


EVERY_OPTIMIZER = {
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),  # makes its state at construction
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "adadelta": lambda ps: torch.optim.Adadelta(ps),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),  # factored state, not shaped like params
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
}


@pytest.mark.parametrize("name", EVERY_OPTIMIZER)
def test_split_is_bit_exact_for_every_torch_optim_optimizer(name: str) -> None:
    init = _groups(BF16)
    half = [nn.Parameter(t.clone()) for t in init]
    ref = [nn.Parameter(t.float()) for t in init]
    opt = LowPrecisionOptimizer(EVERY_OPTIMIZER[name](half), "split", chunk_numel=100, kernel="generic")
    ref_opt = EVERY_OPTIMIZER[name](ref)
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        for h, r in zip(half, ref, strict=True):
            h.grad = torch.randn(h.shape, generator=g).to(BF16)
            r.grad = h.grad.float()
        opt.step()
        ref_opt.step()
    for m, r in zip(opt.master_values(), ref, strict=True):
        assert torch.equal(m, r.detach())


# --------------------------------------------------------------------------------------------- resume
def _train(opt: torch.optim.Optimizer, params: list[nn.Parameter], seeds: range) -> None:
    for i in seeds:
        g = torch.Generator().manual_seed(i)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


@pytest.mark.parametrize("state_dtype", [None, BF16])
@pytest.mark.parametrize("opt_name", OPTS)
@pytest.mark.parametrize("mode", MODES)
def test_state_dict_resume_is_bit_identical(
    mode: str, opt_name: str, state_dtype: torch.dtype | None
) -> None:
    """Train 6 steps; or train 3, save model + optimizer, load both into fresh objects, train 3 more."""
    def fresh() -> tuple[list[nn.Parameter], LowPrecisionOptimizer]:
        ps = [nn.Parameter(t) for t in _groups(BF16)]
        return ps, LowPrecisionOptimizer(OPTS[opt_name](ps), mode, state_dtype=state_dtype, seed=5)

    straight, opt = fresh()
    _train(opt, straight, range(6))
    first, opt1 = fresh()
    _train(opt1, first, range(3))
    saved = copy.deepcopy((opt1.state_dict(), [p.detach() for p in first]))
    _train(opt1, first, range(3, 5))  # the original goes on: the saved copy must not move with it
    resumed, opt2 = fresh()
    opt2.load_state_dict(saved[0])
    with torch.no_grad():
        for p, w in zip(resumed, saved[1], strict=True):
            p.copy_(w)
    _train(opt2, resumed, range(3, 6))
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(opt.master_values(), opt2.master_values(), strict=True):
        assert torch.equal(a, b)
    if state_dtype is not None:  # the moments are kept in bf16 between steps
        assert {v.dtype for s in opt2.state.values() for k, v in s.items() if k != "step"} == {BF16}


def test_deepcopy_steps_like_the_original() -> None:
    params = [nn.Parameter(t) for t in _groups(BF16)]
    opt = LowPrecisionOptimizer(OPTS["adamw"](params), "stochastic", state_dtype=BF16)
    _train(opt, params, range(2))
    twin = copy.deepcopy(opt)
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    assert all(a is not b for a, b in zip(params, twin_params, strict=True))
    _train(opt, params, range(2, 4))
    _train(twin, twin_params, range(2, 4))
    for a, b in zip(params, twin_params, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["split", "kahan", "stochastic"])
def test_a_second_wrapper_of_the_same_optimizer_continues_from_the_firsts_buffers(mode: str) -> None:
    """A notebook cell run again wraps the same optimizer twice: the second wrapper must carry on with the
    first's low halves (compensations; stochastic rounding's generator), as one wrapper stepped throughout
    would."""
    straight = [nn.Parameter(t) for t in _groups(BF16)]
    _train(LowPrecisionOptimizer(OPTS["adamw"](straight), mode), straight, range(6))
    params = [nn.Parameter(t) for t in _groups(BF16)]
    inner = OPTS["adamw"](params)
    first = LowPrecisionOptimizer(inner, mode)
    _train(first, params, range(3))
    with pytest.raises(ConfigError, match="seed=0; its buffers and generators cannot serve"):
        LowPrecisionOptimizer(inner, mode, seed=1)
    second = LowPrecisionOptimizer(inner, mode)
    _train(second, params, range(3, 6))
    for a, b in zip(straight, params, strict=True):
        assert torch.equal(a, b)
    one = LowPrecisionOptimizer(OPTS["adamw"]([nn.Parameter(t) for t in _groups(BF16)]), mode)
    _train(one, [p for g in one.param_groups for p in g["params"]], range(6))
    for a, b in zip(one.master_values(), second.master_values(), strict=True):
        assert torch.equal(a, b)


def test_wrapping_one_optimizer_in_two_modes_is_refused_and_a_failed_wrap_holds_nothing() -> None:
    params = [nn.Parameter(torch.ones(2, dtype=FP16))]
    inner = torch.optim.SGD(params, lr=0.1)
    with pytest.raises(UnsupportedParameterError):
        LowPrecisionOptimizer(inner, "split")  # fp16: refused, and nothing is kept for this optimizer
    kahan = LowPrecisionOptimizer(inner, "kahan")
    with pytest.raises(ConfigError, match="already wrapped by a LowPrecisionOptimizer with mode='kahan'"):
        LowPrecisionOptimizer(inner, "stochastic")
    del kahan


# --------------------------------------------------------------------------------------------- GradScaler
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_grad_scaler_unscales_in_fp32_and_skips_on_inf(dtype: torch.dtype) -> None:
    """scaler.step(wrapper) with gradients times the scale (exact: a power of two, no overflow) updates as an
    unscaled step does; an inf gradient skips the step (weights, compensations, state untouched) and backs
    the scale off. fp16 gradients need no allow_fp16_grads."""
    scale = 2.0**10
    runs = {}
    for name in ("plain", "scaled"):
        ps = [nn.Parameter(t) for t in _groups(dtype)]
        opt = LowPrecisionOptimizer(OPTS["sgd_momentum"](ps), "kahan")
        scaler = GradScaler("cpu", init_scale=scale, enabled=name == "scaled")
        for i in range(3):
            g = torch.Generator().manual_seed(i)
            for p in ps:
                p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(dtype)  # below fp16's 2**-14 often
                if name == "scaled":
                    p.grad.mul_(scale)
            scaler.scale(torch.zeros(()))  # starts the scaler's device state, as scaling a loss does
            scaler.step(opt)
            scaler.update()
        runs[name] = (ps, opt, scaler)
    for a, b in zip(runs["plain"][0], runs["scaled"][0], strict=True):
        assert torch.equal(a, b)
    ps, opt, scaler = runs["scaled"]
    before = (copy.deepcopy(ps), copy.deepcopy(opt.state_dict()))
    for p in ps:
        p.grad = torch.ones_like(p)
    ps[0].grad[0, 0] = math.inf
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(ps, before[0], strict=True))
    after = opt.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(after["extras"], before[1]["extras"], strict=True))
    momenta = [(s["momentum_buffer"], before[1]["optimizer"]["state"][i]["momentum_buffer"])
               for i, s in after["optimizer"]["state"].items()]
    assert len(momenta) == len(ps) and all(torch.equal(a, b) for a, b in momenta)


def test_unscale_then_clip_then_step_with_bf16() -> None:
    """Clipping needs unscaled grads: scaler.unscale_(wrapper) unscales the bf16 grads in place (exact for a
    power-of-two scale), clip_grad_norm_ sees the true norm, and scaler.step does not unscale again: the
    result equals clipping and stepping the unscaled grads without a scaler."""
    scale, max_norm = 2.0**12, 0.5
    runs = []
    for scaled in (False, True):
        ps = [nn.Parameter(t) for t in _groups(BF16)]
        opt = LowPrecisionOptimizer(OPTS["adamw"](ps), "split")
        scaler = GradScaler("cpu", init_scale=scale, enabled=scaled)
        scaler.scale(torch.zeros(()))
        g = torch.Generator().manual_seed(0)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(BF16) * (scale if scaled else 1.0)
        scaler.unscale_(opt)
        norm = nn.utils.clip_grad_norm_(ps, max_norm)
        scaler.step(opt)
        scaler.update()
        runs.append((ps, norm))
    assert runs[0][1] == runs[1][1] > max_norm
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0], strict=True))


def test_clip_grad_norm_takes_the_norm_in_fp32_and_rounds_each_gradient_once() -> None:
    """Reference: torch's clip of the fp32 upcasts, each result rounded to bf16 once. torch's clip of the
    bf16 gradients themselves sums and rounds in bf16 (its norm is off by ~0.3%)."""
    ps = [nn.Parameter(t) for t in _groups(BF16)]
    opt = LowPrecisionOptimizer(OPTS["adamw"](ps), "split")
    g = torch.Generator().manual_seed(0)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(BF16)
    ref = [nn.Parameter(p.detach().float()) for p in ps]
    for r, p in zip(ref, ps, strict=True):
        r.grad = p.grad.float()
    want = nn.utils.clip_grad_norm_(ref, 0.5)
    plain = [nn.Parameter(p.detach().clone()) for p in ps]
    for q, p in zip(plain, ps, strict=True):
        q.grad = p.grad.clone()
    in_bf16 = nn.utils.clip_grad_norm_(plain, math.inf)
    got = opt.clip_grad_norm_(0.5)
    assert got.dtype == torch.float32 and float(got) == pytest.approx(float(want), rel=1e-6)
    assert float(in_bf16) != pytest.approx(float(want), rel=1e-4)  # what the fp32 norm avoids
    for p, r in zip(ps, ref, strict=True):
        assert torch.equal(p.grad, r.grad.to(BF16))


def test_closure_is_evaluated_and_its_gradients_used() -> None:
    w = nn.Parameter(torch.ones(3, dtype=BF16))
    opt = LowPrecisionOptimizer(torch.optim.SGD([w], lr=0.5), "split")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (w.float() * torch.tensor([1.0, 2.0, 4.0])).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 7.0
    assert w.tolist() == [0.5, 0.0, -1.0]  # 1 - 0.5 * grad, exact in bf16


# --------------------------------------------------------------------------------------------- memory
def _adam_footprint(kind: str) -> float:
    model = nn.Linear(256, 256)
    if kind != "fp32":
        model.to(BF16)
    opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt = {
        "fp32": lambda o: o,
        "masters": MasterWeights,
        "split": lambda o: LowPrecisionOptimizer(o, "split"),
        "kahan_bf16_state": lambda o: LowPrecisionOptimizer(o, "kahan", state_dtype=BF16),
        "stochastic_bf16_state": lambda o: LowPrecisionOptimizer(o, "stochastic", state_dtype=BF16),
    }[kind](opt)
    model(torch.randn(4, 256).to(next(model.parameters()).dtype)).float().sum().backward()
    opt.step()
    return footprint(opt).per_param


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        # bytes per element of each tensor the role holds, from the dtypes: weight + grad + extra + state
        ("fp32", 4 + 4 + 0 + 8),
        ("masters", 2 + 2 + (4 + 4) + 8),  # fp32 masters and their fp32 grads
        ("split", 2 + 2 + 2 + 8),  # int16 low halves, fp32 Adam moments
        ("kahan_bf16_state", 2 + 2 + 2 + 4),  # bf16 compensation, bf16 moments
        ("stochastic_bf16_state", 2 + 2 + 0 + 4),
    ],
)
def test_bytes_per_param_from_live_tensors_with_adam(kind: str, expected: int) -> None:
    assert _adam_footprint(kind) == expected
    limits = {"split": 14, "kahan_bf16_state": 10, "masters": 20}
    assert _adam_footprint(kind) <= limits.get(kind, math.inf)


def _o2_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], flat: bool) -> MasterWeights:
    """One O2 step: mixprec.initialize's, or by hand with one flat master buffer (initialize has no flat)."""
    import mixprec

    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if flat:
        for m in model:
            if not isinstance(m, nn.BatchNorm2d):
                m.half()
        opt = MasterWeights(opt, flat=True)
        nn.functional.cross_entropy(model(batch[0].half()).float(), batch[1]).backward()
    else:
        model, opt = mixprec.initialize(model, opt, opt_level="O2", verbosity=0)
        with mixprec.scale_loss(nn.functional.cross_entropy(model(batch[0]), batch[1]), opt) as scaled:
            scaled.backward()
    opt.step()
    return opt


@pytest.mark.parametrize("flat", [False, True])
def test_footprint_counts_the_fp32_batchnorm_that_o2_keeps(flat: bool) -> None:
    """O2 keeps BatchNorm in fp32 with no master: its parameters sit in the groups as themselves. Their bytes
    were counted but their elements were not (12.043 B/param here, against 11.979 from live tensors)."""
    from mixprec.diagnostics.memory import memory_breakdown

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, bias=False), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 10))
    batch = (torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,)))
    reference = memory_breakdown(model, lambda ps: torch.optim.SGD(ps, lr=0.1), batch, "O2", estimate=True)
    opt = _o2_step(model, batch, flat)
    # live tensors: the model's parameters and grads, plus the masters and their grads (each storage once)
    params = list(model.parameters())
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for p in [*params, *opt.param_groups[0]["params"]] for t in (p, p.grad) if t is not None}
    n = sum(p.numel() for p in params)
    assert n == 36 + 8 + 1450  # conv, BatchNorm (fp32), linear
    held = footprint(opt)
    assert held.numel == n and held.per_param == sum(storages.values()) / n
    assert held.per_param == pytest.approx(reference.bytes_per_param, rel=1e-12)


# --------------------------------------------------------------------------------------------- training
def _digits_accuracy(opt_name: str, wrap: Callable[[torch.optim.Optimizer], torch.optim.Optimizer]) -> float:
    data = digits(batch_size=64, flatten=True, seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(BF16)
    lr = {"sgd_momentum": 0.05, "adamw": 3e-3}[opt_name]
    opt = wrap(OPTS[opt_name](model.parameters(), lr=lr))
    torch.manual_seed(0)  # the shuffle order
    for _ in range(4):
        for x, y in data.train:
            nn.functional.cross_entropy(model(x.to(BF16)).float(), y).backward()
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        correct = sum((model(x.to(BF16)).argmax(1) == y).sum().item() for x, y in data.valid)
    return 100.0 * correct / len(data.valid.dataset)  # type: ignore[arg-type]


@pytest.mark.parametrize("opt_name", OPTS)
def test_each_mode_trains_digits_within_one_point_of_fp32_masters(opt_name: str, one_thread: None) -> None:
    """A 64-64-10 MLP in bf16 on the bundled digits, 4 epochs, fixed seeds (init and shuffle): 1 point is
    ~3.6 of the 360 validation images, so the seeds are fixed rather than the comparison averaged."""
    reference = _digits_accuracy(opt_name, MasterWeights)
    assert reference > 90.0  # the model did learn: the comparison means something
    for mode in ("stochastic", "kahan", "split"):  # naive is the ladder's baseline: no promise made for it
        accuracy = _digits_accuracy(opt_name, lambda o, m=mode: LowPrecisionOptimizer(o, m))
        assert abs(accuracy - reference) <= 1.0, (mode, accuracy, reference)


# --------------------------------------------------------------------------------------------- errors
def test_fp32_parameters_are_refused_with_the_fix() -> None:
    with pytest.raises(UnsupportedParameterError, match="MasterWeights"):
        LowPrecisionOptimizer(torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1), "kahan")


def test_split_refuses_fp16_and_names_the_modes_that_work() -> None:
    with pytest.raises(UnsupportedParameterError, match="kahan"):
        LowPrecisionOptimizer(torch.optim.SGD([nn.Parameter(torch.ones(2, dtype=FP16))], lr=0.1), "split")


def test_unsupported_dtype_is_refused() -> None:
    p = torch.zeros(2, dtype=torch.float8_e4m3fn)
    with pytest.raises(UnsupportedParameterError, match="bfloat16"):
        LowPrecisionOptimizer(torch.optim.SGD([p], lr=0.1), "stochastic")


def test_sparse_gradients_are_refused_at_step() -> None:
    emb = nn.Embedding(10, 4, sparse=True).to(BF16)
    opt = LowPrecisionOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), "kahan")
    emb(torch.tensor([1, 2])).float().sum().backward()
    with pytest.raises(UnsupportedParameterError, match="sparse=False"):
        opt.step()


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda ps: LowPrecisionOptimizer(_sgd(ps), "exact"), "pick one of"),
        (lambda ps: LowPrecisionOptimizer(_sgd(ps), "kahan", state_dtype=FP16), "bfloat16"),
        (lambda ps: LowPrecisionOptimizer(MasterWeights(_sgd(ps)), "kahan"), "MasterWeights"),
        (lambda ps: LowPrecisionOptimizer(torch.optim.LBFGS(ps), "kahan"), "first-order"),
        (lambda ps: LowPrecisionOptimizer(_sgd(ps), "kahan", chunk_numel=0), "chunk_numel"),
    ],
)
def test_configuration_errors_name_the_fix(build: Callable[[list[nn.Parameter]], object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build([nn.Parameter(torch.ones(2, dtype=BF16))])


def test_the_docs_loop_runs() -> None:
    """docs/low-precision.md's first code block, run as written."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "low-precision.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, object] = {}
    exec(compile(code, "docs/low-precision.md", "exec"), namespace)
    model = namespace["model"]
    assert isinstance(model, nn.Module) and next(model.parameters()).dtype is BF16


# ---- from a contract run against torch.optim (2026-11-25) -------------------------------------------------


def _tiny_step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(16, 8, generator=g).bfloat16()
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("make", [torch.optim.NAdam, torch.optim.Adafactor])
def test_a_resume_keeps_fp32_state_of_any_shape(make: Callable[..., torch.optim.Optimizer]) -> None:
    """torch's load casts floating state to the half parameter's dtype; only state shaped like the parameter
    got its fp32 back: NAdam's mu_product came back bf16 (the resume drifted by 5e-5) and Adafactor's row and
    column variances made the next step fail. Reference: the run never interrupted."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4).bfloat16()
    opt = LowPrecisionOptimizer(make(model.parameters(), lr=1e-2), mode="split")
    for i in range(2):
        _tiny_step(model, opt, i)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    for i in range(2, 5):
        _tiny_step(model, opt, i)
    resumed = nn.Linear(8, 4).bfloat16()
    resumed.load_state_dict(saved_model)
    again = LowPrecisionOptimizer(make(resumed.parameters(), lr=1e-2), mode="split")
    again.load_state_dict(saved_opt)
    for i in range(2, 5):
        _tiny_step(resumed, again, i)
    for a, b in zip(again.master_values(), opt.master_values(), strict=True):
        assert torch.equal(a, b)


def test_a_refused_param_group_leaves_the_low_halves_as_they_were() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 4).bfloat16()
    opt = LowPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), mode="split")
    for i in range(3):
        _tiny_step(model, opt, i)
    before = [m.clone() for m in opt.master_values()]
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [model.weight]})
    assert all(torch.equal(a, b) for a, b in zip(opt.master_values(), before, strict=True))


def test_a_wrapper_with_an_lr_scheduler_pickles_as_a_plain_optimizer_does() -> None:
    model = nn.Linear(8, 4).bfloat16()
    opt = LowPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), mode="kahan")
    torch.optim.lr_scheduler.StepLR(opt, 1)
    pickled = pickle.loads(pickle.dumps(opt))
    assert pickled.mode is opt.mode and len(pickled.extra_tensors()) == len(opt.extra_tensors())


def test_taking_over_a_stepped_adafactor_holds_all_its_state_in_fp32() -> None:
    """Wrapping an optimizer that stepped on the half parameters (the load error's suggested route) upcast
    only parameter-shaped state: Adafactor's row/column variances stayed bf16 and the next step failed."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4).bfloat16()
    inner = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    _tiny_step(model, inner, 0)
    opt = LowPrecisionOptimizer(inner, mode="split")
    _tiny_step(model, opt, 1)
    floats = [v for s in opt.state.values() for k, v in s.items() if k != "step" and v.is_floating_point()]
    assert floats and all(v.dtype == torch.float32 for v in floats)


def test_split_seeded_with_the_fp32_weights_steps_as_fp32_masters_do(exact_sqrt: None) -> None:
    """``initial=``: the split masters start at the fp32 values a model was cast from (the benchmark's O2
    split configuration started at their bf16 rounding and so trained another trajectory than every fp32
    master configuration). Then its generic step is torch's AdamW on those masters: MasterWeights' masters,
    bit for bit, given the same gradients (with torch's sqrt correctly rounded: its CPU sqrt is one ulp off
    in some elements, depending on where they fall in a vector, and the two lay the masters out apart)."""
    torch.manual_seed(0)
    fp32 = [torch.randn(64, 33), torch.randn(33) * 1e-3]
    split_params = [nn.Parameter(t.to(BF16)) for t in fp32]
    split = LowPrecisionOptimizer(torch.optim.AdamW(split_params, lr=1e-3), "split", kernel="generic",
                                  initial=dict(zip(split_params, fp32, strict=True)))
    assert all(torch.equal(m, t) for m, t in zip(split.master_values(), fp32, strict=True))
    master_params = [nn.Parameter(t.to(BF16)) for t in fp32]
    masters = MasterWeights(torch.optim.AdamW(master_params, lr=1e-3),
                            initial=dict(zip(master_params, fp32, strict=True)))
    for i in range(5):
        g = torch.Generator().manual_seed(i)
        grads = [torch.randn(t.shape, generator=g).to(BF16) for t in fp32]
        for params, opt in ((split_params, split), (master_params, masters)):
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad.clone()
            opt.step()
    for a, b in zip(split.master_values(), masters.master_views(), strict=True):
        assert torch.equal(a, b)


def test_initial_is_refused_outside_split_and_for_tensors_the_optimizer_does_not_hold() -> None:
    p = nn.Parameter(torch.ones(3, dtype=BF16))
    with pytest.raises(ConfigError, match="mode='kahan' keeps no exact master"):
        LowPrecisionOptimizer(torch.optim.SGD([p], lr=0.1), "kahan", initial={p: torch.ones(3)})
    with pytest.raises(ConfigError, match="not a parameter of this optimizer"):
        LowPrecisionOptimizer(torch.optim.SGD([p], lr=0.1), "split", initial={torch.ones(3): torch.ones(3)})


def test_a_refused_initial_changes_no_weight_and_no_first_wrappers_low_halves() -> None:
    """initial= is checked whole before anything is written: a bad second entry had already rewritten the
    first parameter's weight (and, for a second wrapper, the first wrapper's masters)."""
    torch.manual_seed(0)
    fp32 = [torch.randn(5), torch.randn(3)]
    params = [nn.Parameter(t.to(BF16)) for t in fp32]
    inner = torch.optim.AdamW(params)
    first = LowPrecisionOptimizer(inner, "split", initial=dict(zip(params, fp32, strict=True)))
    masters, weights = first.master_values(), [p.detach().clone() for p in params]
    with pytest.raises(ConfigError, match="not a floating tensor of that shape"):
        LowPrecisionOptimizer(inner, "split", initial={params[0]: fp32[0] + 0.3, params[1]: torch.zeros(2)})
    assert all(torch.equal(a, b) for a, b in zip(first.master_values(), masters, strict=True))
    assert all(torch.equal(p, w) for p, w in zip(params, weights, strict=True))


def test_a_copy_of_a_wrapper_shares_its_buffers_with_a_new_wrapper_of_its_optimizer() -> None:
    """deepcopy/pickle do not run __init__: the copy's optimizer was unknown, so wrapping it again started
    from zero low halves (and took another mode)."""
    params = [nn.Parameter(t) for t in _groups(BF16)]
    opt = LowPrecisionOptimizer(OPTS["adamw"](params), "split")
    _train(opt, params, range(2))
    twin = copy.deepcopy(opt)
    again = LowPrecisionOptimizer(twin.inner, "split")
    assert all(torch.equal(a, b) for a, b in zip(again.master_values(), opt.master_values(), strict=True))
    with pytest.raises(ConfigError, match="already wrapped"):
        LowPrecisionOptimizer(twin.inner, "kahan")


def test_the_buffers_go_with_the_last_wrapper() -> None:
    """Kept per optimizer only while a wrapper of it lives: afterwards another mode may wrap it, and the
    low halves are not held for nothing."""
    import gc

    params = [nn.Parameter(t) for t in _groups(BF16)]
    inner = OPTS["adamw"](params)
    opt = LowPrecisionOptimizer(inner, "split")
    _train(opt, params, range(1))
    del opt
    gc.collect()
    LowPrecisionOptimizer(inner, "kahan")  # no longer refused
