"""mixprec.GradScaler against torch.amp.GradScaler (the reference) and against the rules it adds."""

from __future__ import annotations

import copy
import pickle
import re
import types
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from mixprec import scaler as scaler_module
from mixprec.autocast import autocast as mixprec_autocast
from mixprec.errors import (
    ConfigError,
    DeviceMismatchError,
    Fp16GradientError,
    PersistentOverflowError,
    ScalerStateError,
)
from mixprec.scaler import GradScaler, OptState

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]  # cuda: in `pytest -m cuda` (tools/gpu_check.sh)
INF_AT = {2, 3, 9, 10, 11, 17}  # iterations whose gradients we poison


def _model(device: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).to(device)


def _batch(device: str, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 8, generator=g).to(device), torch.randint(0, 3, (16,), generator=g).to(device)


def _run(
    scaler: object,
    device: str,
    steps: int,
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
    inf_at: set[int] = INF_AT,
) -> tuple[list[float], nn.Module]:
    """A training loop with the scaler API; poisons one gradient at the iterations in ``inf_at``."""
    model = _model(device)
    opt = make_opt(model)
    scales = []
    for i in range(steps):
        x, y = _batch(device, i)
        loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()  # type: ignore[attr-defined]
        if i in inf_at:
            model[0].weight.grad[0, 0] = float("inf") if i % 2 else float("nan")
        scaler.step(opt)  # type: ignore[attr-defined]
        scaler.update()  # type: ignore[attr-defined]
        opt.zero_grad()
        scales.append(scaler.get_scale())  # type: ignore[attr-defined]
    return scales, model


OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "adam_foreach": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, foreach=True),
    "adamw_fused": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_same_scales_and_weights_as_torch(device: str, opt_name: str) -> None:
    kwargs = dict(init_scale=2.0**10, growth_interval=3)
    ours, model_ours = _run(GradScaler(device, **kwargs), device, 24, OPTIMIZERS[opt_name])
    ref, model_ref = _run(torch.amp.GradScaler(device, **kwargs), device, 24, OPTIMIZERS[opt_name])
    assert ours == ref
    assert len(set(ours)) > 3  # the run really backed off and grew
    for p, q in zip(model_ours.parameters(), model_ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_scale_multiplies_exactly() -> None:
    scaler = GradScaler("cpu", init_scale=512.0)
    t = torch.randn(5)
    assert torch.equal(scaler.scale(t), t * 512.0)
    a, (b, c) = scaler.scale([t, (t, t)])
    assert torch.equal(c, t * 512.0)


class _Spectral(nn.Module):
    """A real layer and a complex weight, as an FNO's spectral layer holds (torch.cfloat)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.w = nn.Parameter(0.3 * torch.randn(4, 4, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.lin(x).to(torch.cfloat) @ self.w
        return (z.real + z.imag).square().mean()


def test_complex_gradients_are_unscaled_and_checked_as_their_real_pairs() -> None:
    """torch's unscale op has no complex kernel (pytorch#58228): torch.amp's scaler raises
    NotImplementedError on an FNO's complex weights, and ours did. The step now equals the unscaled one
    (scale 2**10: unscaling is exact), and an inf in an imaginary part alone skips it."""
    torch.manual_seed(0)
    model, x = _Spectral(), torch.randn(8, 4)
    with pytest.raises(NotImplementedError, match="ComplexFloat"):  # the peer's bug, while torch has it
        reference = torch.amp.GradScaler("cpu", init_scale=1024.0)
        reference.scale(model(x)).backward()
        reference.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))
    model.zero_grad()
    plain, scaled = copy.deepcopy(model), copy.deepcopy(model)
    plain(x).backward()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    opt, scaler = torch.optim.SGD(scaled.parameters(), lr=0.1), GradScaler("cpu", init_scale=1024.0)
    scaler.scale(scaled(x)).backward()
    scaler.step(opt)
    scaler.update()
    for a, b in zip(plain.parameters(), scaled.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    before = copy.deepcopy(scaled.state_dict())
    opt.zero_grad()
    scaler.scale(scaled(x)).backward()
    scaled.w.grad[1, 2] = complex(1.0, float("inf"))
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 512.0
    assert all(torch.equal(before[k], v) for k, v in scaled.state_dict().items())


def test_static_scale_never_moves_but_still_skips() -> None:
    scaler = GradScaler("cpu", init_scale=512.0, dynamic=False, growth_interval=1)
    scales, _ = _run(scaler, "cpu", 20, OPTIMIZERS["sgd"])
    assert scales == [512.0] * 20
    assert scaler.skipped_steps == len(INF_AT)
    assert not scaler.is_dynamic


def _hysteresis_reference(found: list[bool], hysteresis: int, init: float) -> list[float]:
    """The rule in words: back off only after `hysteresis` consecutive overflows; a clean step restores."""
    scale, left, out = init, hysteresis, []
    for overflow in found:
        if overflow:
            left -= 1
            if left == 0:
                scale, left = scale / 2, hysteresis
        else:
            left = hysteresis
        out.append(scale)
    return out


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_hysteresis(hysteresis: int) -> None:
    # mixprec 0.x's rule, kept under a keyword (the default is DeepSpeed's: test_scale_hysteresis.py)
    scaler = GradScaler(
        "cpu",
        init_scale=2.0**10,
        growth_interval=10_000,
        hysteresis=hysteresis,
        hysteresis_rule="consecutive",
    )
    scales, _ = _run(scaler, "cpu", 20, OPTIMIZERS["sgd"])
    expected = _hysteresis_reference([i in INF_AT for i in range(20)], hysteresis, 2.0**10)
    assert scales == expected


def test_hysteresis_resets_growth_tracker_on_every_overflow() -> None:
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=2, hysteresis=5)
    scales, _ = _run(scaler, "cpu", 6, OPTIMIZERS["sgd"], inf_at={1, 3})
    # overflow at 1 and 3 never backs off (hysteresis 5) but resets the growth count: growth after 4, 5
    assert scales == [8.0, 8.0, 8.0, 8.0, 8.0, 16.0]


def test_min_and_max_scale() -> None:
    low = GradScaler("cpu", init_scale=4.0, growth_interval=10_000, min_scale=2.0)
    assert min(_run(low, "cpu", 20, OPTIMIZERS["sgd"])[0]) == 2.0
    high = GradScaler("cpu", init_scale=4.0, growth_interval=1, max_scale=32.0)
    assert max(_run(high, "cpu", 20, OPTIMIZERS["sgd"], inf_at=set())[0]) == 32.0


def test_observability() -> None:
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=3, history_size=8)
    scales, _ = _run(scaler, "cpu", 12, OPTIMIZERS["sgd"])
    assert scaler.skipped_steps == len([i for i in INF_AT if i < 12])
    assert scaler.last_step_skipped == (11 in INF_AT)
    # history: the scale each iteration *used*, i.e. the previous iteration's scale after update
    used = [2.0**10] + scales[:-1]
    assert scaler.scale_history() == used[-8:]


def test_state_dict_round_trip_mid_run_continues_identically() -> None:
    def fresh() -> tuple[nn.Module, torch.optim.Optimizer, GradScaler]:
        model = _model("cpu")
        return (
            model,
            torch.optim.Adam(model.parameters(), lr=1e-2),
            GradScaler("cpu", init_scale=2.0**10, growth_interval=3, hysteresis=2),
        )

    def iterate(model: nn.Module, opt: torch.optim.Optimizer, scaler: GradScaler, its: range) -> None:
        for i in its:
            x, y = _batch("cpu", i)
            scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
            if i in INF_AT:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

    m1, o1, s1 = fresh()
    iterate(m1, o1, s1, range(20))
    m2, o2, s2 = fresh()
    iterate(m2, o2, s2, range(10))
    saved = copy.deepcopy((m2.state_dict(), o2.state_dict(), s2.state_dict()))
    m3, o3, s3 = fresh()
    m3.load_state_dict(saved[0])
    o3.load_state_dict(saved[1])
    s3.load_state_dict(saved[2])
    iterate(m3, o3, s3, range(10, 20))
    assert s3.state_dict() == s1.state_dict()
    for p, q in zip(m1.parameters(), m3.parameters(), strict=True):
        assert torch.equal(p, q)


def test_loads_torch_state_dict_and_torch_loads_ours() -> None:
    ref = torch.amp.GradScaler("cpu", init_scale=128.0, growth_interval=7)
    ours = GradScaler("cpu")
    ours.load_state_dict(ref.state_dict())
    assert (ours.get_scale(), ours.get_growth_interval()) == (128.0, 7)
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(ours.state_dict())
    assert back.get_scale() == 128.0


@pytest.mark.parametrize(("min_scale", "floor"), [(None, 1.0), (2.0**-8, 2.0**-8)])
def test_state_dict_names_the_floor_in_force(min_scale: float | None, floor: float) -> None:
    """The default floor was saved as min_scale None, which a reader takes for "no floor"."""
    state = GradScaler("cpu", min_scale=min_scale).state_dict()
    assert state["min_scale"] == floor
    loaded = GradScaler("cpu")
    loaded.load_state_dict(state)
    assert loaded.scale_floor == floor and loaded.state_dict() == state


def test_pickle_only_between_iterations() -> None:
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    _run(scaler, "cpu", 12, OPTIMIZERS["sgd"])
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == scaler.state_dict()
    model = _model("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.randn(2, 8)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(ScalerStateError, match="pickled"):
        pickle.dumps(scaler)


def _one_backward(scaler: GradScaler) -> torch.optim.Optimizer:
    model = _model("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.randn(2, 8)).sum()).backward()
    return opt


def test_protocol_errors_match_torch() -> None:
    for cls in (GradScaler, torch.amp.GradScaler):
        scaler = cls("cpu")
        opt = _one_backward(scaler)  # type: ignore[arg-type]
        scaler.unscale_(opt)
        with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
            scaler.unscale_(opt)
        scaler.step(opt)
        with pytest.raises(RuntimeError, match="unscale_\\(\\) is being called after step"):
            scaler.unscale_(opt)
        with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
            scaler.step(opt)
        scaler.update()
        with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
            scaler.update()
    with pytest.raises(AssertionError, match="_scale is None"):
        GradScaler("cpu").update()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(init_scale=0.0),
        dict(init_scale=-1.0),
        dict(init_scale=float("inf")),
        dict(init_scale=float("nan")),
        dict(growth_factor=1.0),
        dict(backoff_factor=1.0),
        dict(backoff_factor=0.0),
        dict(growth_interval=0),
        dict(hysteresis=0),
        dict(min_scale=8.0, max_scale=4.0),
        dict(min_scale=-1.0),
    ],
)
def test_bad_configuration_is_named(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError) as err:
        GradScaler("cpu", **kwargs)  # type: ignore[arg-type]
    assert "fix:" in str(err.value)
    assert isinstance(err.value, AssertionError | ValueError)  # what torch raised for the same input


def test_fp16_gradients_explain_the_fix() -> None:
    model = _model("cpu").half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 8).half()).float().sum()).backward()
    with pytest.raises(Fp16GradientError, match="Attempting to unscale FP16 gradients") as err:
        scaler.unscale_(opt)
    assert "MasterWeights" in str(err.value) and "allow_fp16_grads" in str(err.value)
    allowed = GradScaler("cpu", allow_fp16_grads=True)
    opt.zero_grad()
    allowed.scale(model(torch.randn(2, 8).half()).float().sum()).backward()
    allowed.step(opt)
    allowed.update()


def test_scaler_used_across_devices() -> None:
    scaler = GradScaler("cpu")
    with pytest.raises(DeviceMismatchError, match="GradScaler\\('meta'"):
        scaler.scale(torch.ones((), device="meta"))


def test_disabled_is_a_pass_through() -> None:
    scaler = GradScaler("cpu", enabled=False)
    t = torch.randn(3)
    assert scaler.scale(t) is t
    opt = _one_backward(scaler)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert (scaler.get_scale(), scaler.state_dict(), scaler.skipped_steps) == (1.0, {}, 0)


def test_a_disabled_scaler_reports_the_settings_it_was_given_and_set() -> None:
    """torch's disabled scaler raises AttributeError from these getters; ours returned the defaults
    (2.0, 0.5, 2000), not what was passed. Unchecked, as a disabled scaler checks nothing."""
    scaler = GradScaler("cpu", growth_factor=4.0, backoff_factor=0.25, growth_interval=7, enabled=False)
    settings = (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval())
    assert settings == (4.0, 0.25, 7)
    scaler.set_growth_factor(-1.0)
    scaler.set_growth_interval(0)
    assert (scaler.get_growth_factor(), scaler.get_growth_interval()) == (-1.0, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the no-CUDA fallback")
def test_cuda_default_without_cuda_disables_like_torch() -> None:
    with pytest.warns(UserWarning, match="CUDA is not available"):
        ours = GradScaler()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = torch.amp.GradScaler()
    assert ours.is_enabled() == ref.is_enabled() is False


class _NoSync:
    """Makes every device->host read raise, to prove a code path never syncs (a CPU stand-in for
    torch.cuda.set_sync_debug_mode, which the cuda test below uses)."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")

    def __enter__(self) -> None:
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def boom(*_: object, **__: object) -> None:
            raise AssertionError("host sync")

        for n in self.NAMES:
            setattr(torch.Tensor, n, boom)

    def __exit__(self, *exc: object) -> None:
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("hysteresis", [1, 3])
def test_unscale_and_update_never_sync(hysteresis: int) -> None:
    scaler = GradScaler("cpu", hysteresis=hysteresis, min_scale=1.0, max_scale=2.0**20)
    model = _model("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # fused: step needs no sync either
    loss = model(torch.randn(4, 8)).sum()
    with _NoSync():
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    assert scaler.skipped_steps == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_sync_on_cuda() -> None:
    scaler = GradScaler("cuda")
    model = _model("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    loss = model(torch.randn(4, 8, device="cuda")).sum()
    torch.cuda.set_sync_debug_mode("error")
    try:
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_skipped_first_step_does_not_make_scheduler_warn() -> None:
    """pytorch#44511: an overflow in iteration 0 made schedulers warn
    'lr_scheduler.step() before optimizer.step()'."""
    lrs = {}
    for name, cls in (("ours", GradScaler), ("fp32", None)):
        model = _model("cpu")
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        scaler = cls("cpu") if cls else GradScaler("cpu", enabled=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for i in range(3):
                scaler.scale(model(torch.randn(2, 8)).sum()).backward()
                if i == 0 and cls:
                    model[0].weight.grad[0, 0] = float("inf")
                scaler.step(opt)
                scaler.update()
                sched.step()
                opt.zero_grad()
        lrs[name] = sched.get_last_lr()
        if cls:
            assert scaler.skipped_steps == 1
    assert lrs["ours"] == lrs["fp32"]  # the schedule advances with the iteration, as in torch


def test_skip_limit_reports_persistent_nan_instead_of_skipping_forever() -> None:
    scaler = GradScaler("cpu", init_scale=2.0**10, skip_limit=5)
    with pytest.raises(PersistentOverflowError, match="5 consecutive steps were skipped"):
        _run(scaler, "cpu", 30, OPTIMIZERS["sgd"], inf_at=set(range(3, 30)))
    assert scaler.skipped_steps == 5
    # isolated overflows (never 5 in a row) do not trip it
    _run(GradScaler("cpu", init_scale=2.0**10, skip_limit=5), "cpu", 20, OPTIMIZERS["sgd"])


def test_skip_limit_says_overflow_is_ruled_out_only_at_the_floor() -> None:
    """A user trial: logits times 1e4 tripped the limit at scale 64 with "the inf/NaN does not come from
    overflow", though the run found a clean step once the scale reached 4."""
    early = GradScaler("cpu", init_scale=2.0**10, skip_limit=5)  # 5 halvings: 32, far above the floor
    with pytest.raises(PersistentOverflowError, match=r"(?s)still backing off \(now 32, floor 1\).*raise "
                                                      "skip_limit"):
        _run(early, "cpu", 30, OPTIMIZERS["sgd"], inf_at=set(range(30)))
    floored = GradScaler("cpu", init_scale=4.0, skip_limit=5)  # 4, 2, 1, 1, 1
    floor_said = r"At its floor \(1\) a lower scale cannot help unless the loss itself is too large"
    with pytest.raises(PersistentOverflowError, match=floor_said) as raised:
        _run(floored, "cpu", 30, OPTIMIZERS["sgd"], inf_at=set(range(30)))
    assert "raise skip_limit" not in str(raised.value)
    # A Mamba trial: at the floor a hand-written RMSNorm's backward still overflowed fp16; the message had
    # ruled gradient overflow out. It names that cause now, and where to keep the part in fp32.
    said = str(raised.value)
    assert "does not come from gradient overflow" not in said
    assert "a backward that overflows the half dtype at any scale" in said and "mixprec.keep_fp32" in said


def test_a_static_scale_above_the_floor_is_named_as_a_cause_and_fp32_floors_are_reached() -> None:
    """A review: at a static 512 the error said the inf/NaN "does not come from gradient overflow", the
    likeliest cause there; and a floor of 0.001 (not an fp32 value) was never "reached" by the fp32 scale."""
    static = GradScaler("cpu", init_scale=512.0, dynamic=False, skip_limit=5)
    with pytest.raises(PersistentOverflowError, match=r"(?s)A static scale of 512 may itself overflow.*lower "
                                                      "the static scale"):
        _run(static, "cpu", 20, OPTIMIZERS["sgd"], inf_at=set(range(20)))
    odd_floor = GradScaler("cpu", init_scale=0.004, min_scale=0.001, skip_limit=5)  # 0.002, 0.001, ...
    with pytest.raises(PersistentOverflowError, match=r"At its floor \(0\.001\) a lower scale cannot help"):
        _run(odd_floor, "cpu", 20, OPTIMIZERS["sgd"], inf_at=set(range(20)))


def test_fused_sgd_momentum_survives_a_skipped_first_step() -> None:
    """torch 2.13's fused SGD leaves its momentum buffer uninitialized when found_inf skips the first step;
    the scaler must not hand that step to the device-side skip."""
    for trial in range(5):
        torch.manual_seed(trial)
        scales, model = _run(
            GradScaler("cpu", init_scale=2.0**10),
            "cpu",
            4,
            lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, fused=True),
            inf_at={0},
        )
        ref_scales, ref = _run(
            GradScaler("cpu", init_scale=2.0**10),
            "cpu",
            4,
            lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=True),
            inf_at={0},
        )
        assert scales == ref_scales
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q)


def test_stage_and_skipped_async_follow_the_protocol_without_syncing() -> None:
    scaler = GradScaler("cpu", init_scale=2.0**10)
    model = _model("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert scaler.skipped_async() is None and scaler.stage(opt) is OptState.READY
    for poison in (True, False):
        scaler.scale(model(torch.randn(4, 8)).sum()).backward()
        if poison:
            model[0].weight.grad[0, 0] = float("inf")
        with _NoSync():
            scaler.unscale_(opt)
            assert scaler.stage(opt) is OptState.UNSCALED
            flag = scaler.skipped_async()
        assert flag is not None and bool(flag) is poison
        scaler.step(opt)
        assert scaler.stage(opt) is OptState.STEPPED
        scaler.update()
        assert scaler.stage(opt) is OptState.READY
        assert bool(scaler.skipped_async()) is poison == scaler.last_step_skipped
        opt.zero_grad()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("poison", [None, float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("scale", [2.0**13, 3.0])
def test_unscale_where_torch_has_no_fused_kernel_matches_its_arithmetic(
    device: str, dtype: torch.dtype, poison: float | None, scale: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The two-pass unscale (torch's fused op has no bf16 CUDA kernel) against what the fused op computes:
    each gradient times 1/scale in fp32, rounded once to its dtype, and the flag set by any inf/NaN. Bit
    for bit at a power-of-two scale (dynamic scaling's); elsewhere CUDA's foreach kernel rounds 1/scale
    to the gradient's dtype first: within one rounding of that dtype."""
    monkeypatch.setattr(scaler_module, "NO_FUSED_UNSCALE", frozenset({(device, dtype)}))
    gen = torch.Generator().manual_seed(0)
    grads = [(torch.randn(n, generator=gen) * 1e3).to(device, dtype) for n in (7, 300, 4096)]
    if poison is not None:
        grads[1][123] = poison
    inv_scale = torch.tensor(1 / scale, device=device)
    # the reference: torch's op on fp32 copies (exact upcasts), then one rounding to the gradient's dtype
    expected = [g.float() for g in grads]
    expected_found = torch.zeros((), device=device)
    torch._amp_foreach_non_finite_check_and_unscale_(expected, expected_found, inv_scale)
    found = torch.zeros((), device=device)
    scaler_module.unscale_and_check_(grads, found, inv_scale)
    assert found.item() == expected_found.item() == (poison is not None)
    one_rounding = 0.0 if scale == 2.0**13 else torch.finfo(dtype).eps
    for got, ref in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, ref.to(dtype), rtol=one_rounding, atol=0, equal_nan=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_bf16_model_on_cuda_steps_and_skips() -> None:
    """torch's fused unscale has no bf16 CUDA kernel (NotImplementedError in torch.amp.GradScaler); ours
    steps a bf16 model and skips the step whose gradient is inf."""
    model = _model("cuda").to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cuda", init_scale=2.0**8)
    for poisoned in (False, True):
        before = [p.detach().clone() for p in model.parameters()]
        x = torch.randn(4, 8, device="cuda", dtype=torch.bfloat16)
        scaler.scale(model(x).float().sum()).backward()
        if poisoned:
            next(model.parameters()).grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        assert moved is not poisoned
    assert scaler.get_scale() == 2.0**7  # halved once, for the inf


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_two_pass_unscale_launches_a_fixed_number_of_kernels_not_one_per_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host-bound GPU step pays per launch: torch's multi-tensor multiply takes a bf16 list only with a
    bf16 scalar, and with the fp32 one it fell back to a kernel per tensor (52 for the benchmark's GPT).
    The bits are those of 1/scale read as bf16, as before (a scale that is no power of two shows it)."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(scaler_module, "NO_FUSED_UNSCALE", frozenset({("cuda", torch.bfloat16)}))
    g = torch.Generator(device="cuda").manual_seed(0)
    grads = [torch.randn(100 + i, device="cuda", dtype=torch.bfloat16, generator=g) for i in range(40)]
    inv = torch.tensor(1 / 1000, device="cuda")
    want = [(t.float() * inv.bfloat16().float()).bfloat16() for t in grads]
    found = torch.zeros((), device="cuda")
    scaler_module.unscale_and_check_([t.clone() for t in grads], found, inv)  # warm-up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        scaler_module.unscale_and_check_(grads, found, inv)
        torch.cuda.synchronize()
    kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
    assert kernels < len(grads) // 2, f"{kernels} CUDA kernels for {len(grads)} gradients"
    assert all(torch.equal(a, b) for a, b in zip(grads, want, strict=True)) and found.item() == 0.0


@pytest.mark.parametrize(("dtype", "scale"), [(torch.bfloat16, 3.0), (torch.bfloat16, 1000.0),
                                              (torch.float16, 3.0), (torch.float16, 2.0**26)])
def test_the_two_pass_unscale_on_the_cpu_gives_the_fused_ops_bits(
    dtype: torch.dtype, scale: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU reads the fp32 1/scale exactly, as torch's fused op does: bit for bit, also where 1/scale
    has no exact bf16 value or underflows fp16 (2**-26)."""
    monkeypatch.setattr(scaler_module, "NO_FUSED_UNSCALE", frozenset({("cpu", dtype)}))
    g = torch.Generator().manual_seed(1)
    grads = [(torch.randn(n, generator=g) * 1e3).to(dtype) for n in (5, 64, 1000)]
    inv = torch.tensor(scale, dtype=torch.float64).reciprocal().float()
    ours, theirs = [t.clone() for t in grads], [t.clone() for t in grads]
    found, found_torch = torch.zeros(()), torch.zeros(())
    scaler_module.unscale_and_check_(ours, found, inv)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_torch, inv)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert any(t.abs().max() > 0 for t in ours)  # not flushed to zero
    assert found.item() == found_torch.item() == 0.0


def test_the_two_pass_unscale_skips_empty_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's fused op takes empty tensors (a zero-size parameter); the inf-norm of one raises."""
    monkeypatch.setattr(scaler_module, "NO_FUSED_UNSCALE", frozenset({("cpu", torch.bfloat16)}))
    for grads in ([torch.zeros(0, dtype=torch.bfloat16)],
                  [torch.zeros(0, dtype=torch.bfloat16), torch.tensor([4.0, float("inf")]).bfloat16()]):
        found = torch.zeros(())
        scaler_module.unscale_and_check_(grads, found, torch.tensor(0.5))
        assert found.item() == (len(grads) == 2)
        assert grads[-1].numel() == 0 or grads[-1][0].item() == 2.0


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="torch.distributed with gloo is needed")
def test_the_two_pass_unscale_takes_sharded_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP2's bf16 gradients are DTensors: the flag must come out a plain tensor, as torch's op makes it
    (it raised mixing a DTensor flag with the plain one). A one-rank gloo group in this process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from mixprec.distributed import free_port

    monkeypatch.setattr(scaler_module, "NO_FUSED_UNSCALE", frozenset({("cpu", torch.bfloat16)}))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain = [torch.tensor([4.0, 8.0, float("nan"), 2.0]).bfloat16(), torch.ones(3, 2).bfloat16()]
        sharded = [distribute_tensor(g.clone(), mesh, [Shard(0)]) for g in plain]
        found, expected = torch.zeros(()), torch.zeros(())
        scaler_module.unscale_and_check_(sharded, found, torch.tensor(0.25))
        scaler_module.unscale_and_check_(plain, expected, torch.tensor(0.25))
        assert type(found) is torch.Tensor and found.item() == expected.item() == 1.0
        for got, want in zip(sharded, plain, strict=True):
            torch.testing.assert_close(got.full_tensor(), want, rtol=0, atol=0, equal_nan=True)
    finally:
        torch.distributed.destroy_process_group()


# ---- cases a differential run against torch.amp.GradScaler found (2026-11-25) ---------------------------


def _both() -> list[tuple[str, Callable[..., object]]]:
    return [("torch", torch.amp.GradScaler), ("mixprec", GradScaler)]


@pytest.mark.parametrize("device", [torch.device("cpu"), "cpu:0"])
def test_a_device_object_or_indexed_name_works_as_in_torch(device: str | torch.device) -> None:
    """Before, only the bare type string passed: torch.device("cpu") raised DeviceMismatchError ("made for
    device 'cpu' but is scaling a tensor on 'cpu'")."""
    results = {}
    for name, make in _both():
        scaler = make(device, init_scale=8.0)
        results[name] = scaler.scale(torch.ones(())).item()  # type: ignore[attr-defined]
    assert results["mixprec"] == results["torch"] == 8.0


def _fused_without_gradients(make: Callable[..., object]) -> tuple[list[torch.Tensor], float]:
    """Two models, one scaler; the fused optimizer's model gets no gradient this iteration (a GAN step,
    a frozen branch)."""
    torch.manual_seed(0)
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.1, fused=True)
    scaler = make("cpu", init_scale=4.0)
    scaler.scale(a(torch.ones(2, 3)).sum()).backward()  # type: ignore[attr-defined]
    scaler.step(opt_a)  # type: ignore[attr-defined]
    scaler.step(opt_b)  # type: ignore[attr-defined]
    scaler.update()  # type: ignore[attr-defined]
    return [p.detach().clone() for p in (*a.parameters(), *b.parameters())], scaler.get_scale()  # type: ignore[attr-defined]


def test_a_fused_optimizer_without_gradients_steps_as_in_torch() -> None:
    """torch calls a fused optimizer's step even when none of its parameters has a gradient (nothing
    changes); mixprec raised "No inf checks were recorded for this optimizer"."""
    ref_params, ref_scale = _fused_without_gradients(torch.amp.GradScaler)
    params, scale = _fused_without_gradients(GradScaler)
    assert scale == ref_scale
    for p, r in zip(params, ref_params, strict=True):
        assert torch.equal(p, r)


def _own_grad_scale_after_unscale(make: Callable[..., object]) -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)  # SGD: the update is linear in the grad
    opt.grad_scale = torch.tensor(2.0)  # type: ignore[attr-defined]  # the user's own factor in the grads
    scaler = make("cpu", init_scale=4.0)
    scaler.scale(model(torch.ones(2, 3)).pow(2).sum()).backward()  # type: ignore[attr-defined]
    scaler.unscale_(opt)  # type: ignore[attr-defined]
    scaler.step(opt)  # type: ignore[attr-defined]
    scaler.update()  # type: ignore[attr-defined]
    return model.weight.detach().clone()


def test_an_optimizers_own_grad_scale_reaches_its_kernel_after_unscale_as_in_torch() -> None:
    """torch hands a fused optimizer its own ``grad_scale`` when the scaler already unscaled; mixprec
    passed None, and the update differed."""
    assert torch.equal(_own_grad_scale_after_unscale(GradScaler),
                       _own_grad_scale_after_unscale(torch.amp.GradScaler))


def _fused_sgd_momentum_fp16(make: Callable[..., object], init_scale: float) -> torch.Tensor:
    w = nn.Parameter(torch.linspace(0.5, 2.0, 6, dtype=torch.float16))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9, fused=True)
    scaler = make("cpu", init_scale=init_scale)
    for _ in range(3):
        opt.zero_grad()
        scaler.scale((w.float() ** 2).sum()).backward()  # type: ignore[attr-defined]
        scaler.step(opt)  # type: ignore[attr-defined]
        scaler.update()  # type: ignore[attr-defined]
    return w.detach().clone()


@pytest.mark.parametrize("init_scale", [1024.0, 1000.0])
def test_fused_sgd_momentum_over_fp16_parameters_steps_as_in_torch(init_scale: float) -> None:
    """The first step of a fused SGD with momentum is decided on the host (its device-side skip would leave
    the buffer garbage); that path unscaled the fp16 gradients itself and refused them (Fp16GradientError)
    where torch's fused kernel unscales them. Now the kernel unscales: torch's weights bit for bit, at a
    scale that is no power of two too."""
    assert torch.equal(_fused_sgd_momentum_fp16(GradScaler, init_scale),
                       _fused_sgd_momentum_fp16(torch.amp.GradScaler, init_scale))


class _RecordingSGD(torch.optim.SGD):
    """A user's optimizer that unscales by itself: it reads the flags torch.amp's GradScaler sets."""

    _step_supports_amp_scaling = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[float, float | None]] = []

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        found_inf, grad_scale = self.found_inf, self.grad_scale  # type: ignore[attr-defined]
        self.seen.append((float(found_inf), None if grad_scale is None else float(grad_scale)))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("with_grad", [True, False])
def test_an_optimizer_that_unscales_itself_gets_found_inf_and_grad_scale_as_in_torch(
    momentum: float, with_grad: bool
) -> None:
    """torch sets ``found_inf`` and ``grad_scale`` on an optimizer with ``_step_supports_amp_scaling`` for
    every step it calls: also with no gradients at all, and for an SGD subclass with momentum on its first
    (clean) step, which mixprec decides on the host. mixprec called those steps without them."""
    seen = {}
    for name, make in _both():
        w = nn.Parameter(torch.ones(3))
        opt = _RecordingSGD([w], lr=0.1, momentum=momentum)
        scaler = make("cpu", init_scale=8.0)
        loss = scaler.scale((w * 2).sum())  # type: ignore[attr-defined]
        if with_grad:
            loss.backward()
        scaler.step(opt)  # type: ignore[attr-defined]
        seen[name] = opt.seen  # (no update: with no gradient anywhere, both refuse it)
    assert seen["mixprec"] == seen["torch"] == [(0.0, 8.0)]


class _AskingSGD(torch.optim.SGD):
    """A custom optimizer of torch's older protocol: ``step(grad_scaler=...)`` asks the scaler itself."""

    _step_supports_amp_scaling = True

    def step(self, closure: Any = None, grad_scaler: Any = None) -> str:  # type: ignore[override]
        return "asked" if grad_scaler is not None else "not asked"


def test_the_grad_scaler_protocol_is_asked_as_torch_asks_it_every_step() -> None:
    """torch passes itself to a step that takes ``grad_scaler`` (with a FutureWarning), every step; the
    signature is now looked up once per step function: a step replaced by one without the argument is
    asked anew."""
    results = {}
    for name, make in _both():
        w = nn.Parameter(torch.ones(3))
        opt = _AskingSGD([w], lr=0.1)
        runs = []
        for replaced in (False, False, True):
            if replaced:
                opt.step = types.MethodType(lambda self, closure=None: "plain", opt)  # type: ignore
            scaler = make("cpu", init_scale=8.0)  # a new one each time: the asking step records no check
            scaler.scale((w * 2).sum()).backward()  # type: ignore[attr-defined]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                stepped = scaler.step(opt)  # type: ignore[attr-defined]
            runs.append((stepped, any(w.category is FutureWarning for w in caught)))
        results[name] = runs
    assert results["mixprec"] == results["torch"]
    assert results["torch"][:2] == [("asked", True), ("asked", True)]


def test_a_run_that_skips_every_step_at_the_floor_says_so_once() -> None:
    """A user trial: NaN data, lr=50 or logits times 1e4 skipped 67 of 69 steps at scale 1, silently;
    skip_limit (the only stop) is opt-in."""
    stuck = r"(?s)steps were all skipped .*At its floor \(1\).*skip_limit"
    with pytest.warns(RuntimeWarning, match=stuck) as said:
        _run(GradScaler("cpu", init_scale=4.0), "cpu", 30, OPTIMIZERS["sgd"], inf_at=set(range(30)))
    assert len([w for w in said if "all skipped" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # still backing off, isolated overflows, or an explicit skip_limit
        _run(GradScaler("cpu", init_scale=2.0**16), "cpu", 12, OPTIMIZERS["sgd"], inf_at=set(range(12)))
        _run(GradScaler("cpu", init_scale=4.0), "cpu", 20, OPTIMIZERS["sgd"], inf_at={3, 9, 15})
        with pytest.raises(PersistentOverflowError):
            limited = GradScaler("cpu", init_scale=1.0, skip_limit=8)
            _run(limited, "cpu", 20, OPTIMIZERS["sgd"], inf_at=set(range(20)))


def _steps_on_a_loss_of(value: float, scaler: GradScaler, opt: torch.optim.Optimizer, w: torch.Tensor,
                        steps: int) -> None:  # fmt: skip
    """``steps`` iterations of the torch.amp loop on the loss ``(w * value).sum()`` (inf or NaN: skipped)."""
    for _ in range(steps):
        scaler.scale((w * value).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def test_a_stuck_run_with_a_nan_loss_says_the_forward_made_it() -> None:
    """A user trial (a float mask of fp32's finfo.min cast to bf16: -inf, a fully masked softmax row NaN):
    the message listed gradient causes only, and not the mask; the loss itself was NaN."""
    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = GradScaler("cpu", init_scale=1.0, skip_limit=3)
    with pytest.raises(PersistentOverflowError, match=r"(?s)last loss scaled was nan.*before backward.*mask"):
        _steps_on_a_loss_of(float("nan"), scaler, opt, w, 3)
    finite_loss = GradScaler("cpu", init_scale=1.0, skip_limit=3)  # inf only in the gradients
    with pytest.raises(PersistentOverflowError) as raised:
        for _ in range(3):
            finite_loss.scale((w * 2).sum()).backward()
            w.grad[0] = float("inf")
            finite_loss.step(opt)
            finite_loss.update()
            opt.zero_grad()
    assert "last loss scaled" not in str(raised.value)


def test_a_stuck_run_with_an_inf_loss_is_told_of_the_loss_not_the_gradients() -> None:
    """A trial's hand-written NT-Xent (exp, sum, log in fp16 under CPU autocast: inf every step) was told
    of gradient causes in 20 lines. A non-finite loss is named as such, with the hand-written loss in half
    and .float() first; still only at the floor, since a loss built from scaled gradients (a gradient
    penalty) does recover as the scale backs off."""
    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    for init, warned in ((2.0**16, False), (4.0, True)):  # 5 skips: 2**11, still backing off; 4: the floor
        scaler = GradScaler("cpu", init_scale=init)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            _steps_on_a_loss_of(float("inf"), scaler, opt, w, 5)
        stuck = [str(x.message) for x in said if "all skipped" in str(x.message)]
        assert len(stuck) == int(warned)
    assert re.search(r"(?s)last loss scaled was inf.*written by hand.*\.float\(\)", stuck[0])
    assert "a norm or a scan written by hand" not in stuck[0]  # the gradient causes are not listed
    # at a static scale above 1 a penalty's scaled gradients may make the loss inf: a lower scale helps
    static = GradScaler("cpu", init_scale=2.0**20, growth_interval=1, dynamic=False, skip_limit=2)
    with pytest.raises(PersistentOverflowError, match=r"gradient penalty.*lower one helps \(loss_scale="):
        _steps_on_a_loss_of(float("nan"), static, opt, w, 2)


@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_a_closure_is_refused_with_torchs_words_whichever_way_it_comes(how: str) -> None:
    """torch refuses step(opt, closure=...) only; LBFGS's step(closure) passed positionally then failed at the
    inf check ("No inf checks were recorded"), which says nothing of the closure (a PINN trial)."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.LBFGS(model.parameters())
    scaler = GradScaler("cpu")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = scaler.scale(model(torch.ones(1, 2)).sum())
        loss.backward()
        return loss

    closure()
    with pytest.raises(RuntimeError, match="Closure use is not currently supported if GradScaler is enabled"):
        scaler.step(opt, closure=closure) if how == "keyword" else scaler.step(opt, closure)


def test_at_the_floor_a_large_finite_loss_is_named_with_the_way_below_1() -> None:
    """A forecaster's MSE on unnormalized targets (~1e5) made a loss of 4e10 whose gradients overflow fp16
    at a scale of 1: torch.amp's scaler (no floor) trained at 5e-7, mixprec's skipped every step and said "a
    lower scale cannot help", without naming min_scale."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-15)
    x, y = torch.full((8, 4), 300.0), torch.full((8, 1), 1.0e6)

    def steps(scaler: GradScaler, n: int) -> None:
        for _ in range(n):
            opt.zero_grad()
            with mixprec_autocast("cpu", torch.float16):
                pred = model(x)  # fp16: the loss's gradient reaches it as fp16, ~2.5e5 > 65504
            scaler.scale(torch.nn.functional.mse_loss(pred.float(), y)).backward()
            scaler.step(opt)
            scaler.update()

    named = r"(?s)the last loss was 1\.\d+e\+12.*min_scale="
    with pytest.raises(PersistentOverflowError, match=named) as err:
        steps(GradScaler("cpu", init_scale=2.0, skip_limit=3), 5)
    assert "unless the loss itself is too large" in str(err.value)
    before = model.weight.detach().clone()
    below = GradScaler("cpu", init_scale=2.0, min_scale=2.0**-30)  # the way out it names
    steps(below, 30)
    assert below.get_scale() < 1 and not torch.equal(model.weight, before)


def test_a_conjugate_view_gradient_is_unscaled_as_its_values() -> None:
    """A forward through w.conj() leaves w.grad a conjugate view, which has no real view ("view_as_real
    doesn't work on unresolved conjugated tensors", a review): the step equals the unscaled one."""
    torch.manual_seed(0)
    w = nn.Parameter(0.3 * torch.randn(4, 4, dtype=torch.cfloat))
    x = torch.randn(8, 4).to(torch.cfloat)
    plain = w.detach().clone().requires_grad_(True)
    (x @ plain.conj()).abs().square().mean().backward()
    opt, scaler = torch.optim.SGD([w], lr=0.1), GradScaler("cpu", init_scale=1024.0)
    scaler.scale((x @ w.conj()).abs().square().mean()).backward()
    assert w.grad is not None and w.grad.is_conj()  # the case: autograd's conjugate view
    scaler.step(opt)
    torch.optim.SGD([plain], lr=0.1).step()
    torch.testing.assert_close(w, plain, rtol=0, atol=0)
