"""apex-style opt levels: parameter dtypes, skipping, training parity with fp32, errors."""

from __future__ import annotations

import contextlib
import copy
import io
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_scaler import _NoSync as NoHostReads
from torch import nn

import mixprec
from mixprec import amp
from mixprec.errors import ConfigError, ParameterMismatchError, ScalerStateError
from mixprec.master import MasterWeights

pytestmark = pytest.mark.usefixtures("fresh_amp_state")


LEVELS = ["O0", "O1", "O2", "O3"]


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def _batches(n: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(10, 4, generator=g)
    for _ in range(n):
        x = torch.randn(64, 10, generator=g)
        yield x, (x @ teacher).argmax(1)


def test_opt_levels_are_apex_table() -> None:
    """apex.amp's documented table (cast_model_type, patch, keep_bn_fp32, master_weights, loss_scale)."""
    apex = {
        "O0": (torch.float32, False, None, False, 1.0),
        "O1": (None, True, None, None, "dynamic"),
        "O2": (torch.float16, False, True, True, "dynamic"),
        "O3": (torch.float16, False, False, False, 1.0),
    }
    for level, row in apex.items():
        p = amp.OPT_LEVELS[level]
        assert (p.cast_model_type, p.patch_torch_functions, p.keep_batchnorm_fp32, p.master_weights,
                p.loss_scale) == row  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("level", LEVELS)
def test_parameter_dtypes_after_initialize(level: str, dtype: torch.dtype) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.initialize(model, opt, opt_level=level, dtype=dtype, verbosity=0)
    lin, bn = model[0], model[1]
    half_model = level in ("O2", "O3")
    assert lin.weight.dtype == (dtype if half_model else torch.float32)
    assert bn.weight.dtype == (dtype if level == "O3" else torch.float32)
    assert bn.running_mean.dtype == bn.weight.dtype
    if level == "O2":
        assert isinstance(opt, MasterWeights)
        assert all(p.dtype == torch.float32 for p in mixprec.master_params(opt))
    else:
        assert not isinstance(opt, MasterWeights)
    seen = {}
    lin.register_forward_hook(lambda m, i, o: seen.update(linear=o.dtype))
    out = model(torch.randn(8, 10))
    assert out.dtype == torch.float32  # outputs leave the model in fp32 (loss in fp32)
    assert seen["linear"] == (torch.float32 if level == "O0" else dtype)


def test_o3_keep_batchnorm_fp32_without_batchnorm_is_fine() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    mixprec.initialize(model, opt_level="O3", keep_batchnorm_fp32=True, verbosity=0)
    assert model[0].weight.dtype == torch.float16


def _train(level: str | None, dtype: torch.dtype = torch.float16, steps: int = 60) -> tuple[float, nn.Module]:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if level is not None:
        model, opt = mixprec.initialize(model, opt, opt_level=level, dtype=dtype, verbosity=0)
    losses = []
    for x, y in _batches(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        if level is None:
            loss.backward()
        else:
            with mixprec.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return sum(losses[-10:]) / 10, model


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("level", LEVELS)
def test_short_run_reaches_fp32_loss(level: str, dtype: torch.dtype) -> None:
    ref, _ = _train(None)
    got, _ = _train(level, dtype)
    tolerance = 0.15 if level == "O3" else 0.05  # pure half (and bf16's 8-bit mantissa) drifts more
    assert got == pytest.approx(ref, abs=tolerance + (0.05 if dtype == torch.bfloat16 else 0.0))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_overflow_skips_step_and_leaves_weights_and_state(level: str) -> None:
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = mixprec.initialize(model, opt, opt_level=level, verbosity=0)
    batches = _batches(2)
    x, y = next(batches)
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()
    weights = [p.detach().clone() for p in mixprec.master_params(opt)]
    state = copy.deepcopy(opt.state_dict())
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    x, y = next(batches)
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
        model[0].weight.grad.view(-1)[0] = float("inf")  # an overflow in this iteration's gradients
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(weights, mixprec.master_params(opt), strict=True))
    assert str(opt.state_dict()) == str(state)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == scale / 2


def test_two_losses_feeding_one_optimizer_match_fp32() -> None:
    """Gradients unscaled for loss 0 are set aside while loss 1 backpropagates, then added back."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model, opt = mixprec.initialize(
        model, opt, opt_level="O0", loss_scale="dynamic", num_losses=2, verbosity=0
    )
    x = torch.randn(5, 6)
    for i, net in enumerate((model, ref)):
        loss0, loss1 = net(x).pow(2).mean(), net(x).sin().sum()
        if i == 0:
            with mixprec.scale_loss(loss0, opt, loss_id=0) as s:
                s.backward()
            with mixprec.scale_loss(loss1, opt, loss_id=1) as s:
                s.backward()
            opt.step()
        else:
            (loss0 + loss1).backward()
            ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)  # powers of two scale exactly: only summation order differs


@pytest.mark.parametrize("options", [{"dtype": torch.float16, "loss_scale": 128.0},
                                     {"dtype": torch.bfloat16},
                                     {"dtype": torch.bfloat16, "master_grads": False}],
                         ids=["O2 fp16", "O2 bf16 (a scale of 1)", "O2 bf16 without master grads"])
def test_two_losses_into_one_o2_optimizer_train_as_one_loss_of_their_sum(options: dict) -> None:
    # apex: the losses of an iteration that feed one optimizer add up, and what a user clips between them
    # and the step (here the model's parameters, a no-op clip that still rewrites the gradients) is the sum.
    # L + L = 2L: every gradient doubles exactly, so the two runs must agree bit for bit. Gradients are
    # compared as well as weights: Adam's update barely moves when every gradient is scaled alike.
    def train(two_losses: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = mixprec.initialize(model, opt, "O2", num_losses=2, verbosity=0, **options)
        seen: list[torch.Tensor] = []
        for x, y in _batches(3):
            losses = [nn.functional.cross_entropy(model(x).float(), y) for _ in range(2)] if two_losses else [
                2 * nn.functional.cross_entropy(model(x).float(), y)]
            for loss_id, loss in enumerate(losses):
                with mixprec.scale_loss(loss, opt, loss_id=loss_id) as scaled:
                    scaled.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            seen += [m.grad.clone() for m in amp.master_params(opt)]
            opt.step()
            opt.zero_grad()
        amp.reset()
        return seen + [m.detach().clone() for m in amp.master_params(opt)]

    for a, b in zip(train(two_losses=True), train(two_losses=False), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("options", [{"dtype": torch.float16, "loss_scale": 128.0},
                                     {"dtype": torch.bfloat16}], ids=["O2 fp16", "O2 bf16"])
def test_a_clip_of_the_model_sees_a_gradient_only_an_earlier_loss_made(options: dict) -> None:
    """An MoE trial's router losses (loss_id 1) reach part of the model: after their scale_loss the model's
    .grad of the head, which only the LM loss (loss_id 0) reached, was None, though its master held it. A
    clip of model.parameters() saw norm 3.59 of 3.94 and left the head unclipped (masters at 1.91 after a
    clip to 1). Every master gradient is in the model's .grad, and the clip reaches all of them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.initialize(model, opt, "O2", num_losses=2, verbosity=0, **options)
    hidden = model[0](torch.randn(16, 8, dtype=options["dtype"]))
    with mixprec.scale_loss(model[1](hidden).float().square().mean(), opt, loss_id=0) as scaled:
        scaled.backward(retain_graph=True)
    with mixprec.scale_loss(hidden.float().square().mean(), opt, loss_id=1) as scaled:  # model[0] alone
        scaled.backward()
    masters = list(amp.master_params(opt))
    for p, m in zip(model.parameters(), masters, strict=True):
        assert p.grad is not None and torch.equal(p.grad, m.grad.to(p.dtype))
    true_norm = torch.nn.utils.get_total_norm([m.grad for m in masters])
    seen = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    # the model's gradients are the masters' rounded to half: the norms agree to half's precision
    torch.testing.assert_close(seen.float(), true_norm, rtol=1e-2, atol=0)
    opt.step()  # takes the clipped model gradients into the masters first
    clipped = torch.nn.utils.get_total_norm([m.grad for m in masters])
    torch.testing.assert_close(clipped, torch.tensor(0.01), rtol=1e-2, atol=0)


def test_state_dict_round_trip() -> None:
    _train("O2", steps=5)
    saved = amp.state_dict()
    assert set(saved) == {"loss_scaler0"}
    scale = saved["loss_scaler0"]["loss_scale"]
    model = _net()
    mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    amp.load_state_dict(saved)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == scale
    assert amp.state_dict()["loss_scaler0"]["mixprec"] == saved["loss_scaler0"]["mixprec"]


def test_state_dict_entries_print_as_apexs_and_the_earlier_flat_form_still_loads() -> None:
    _train("O2", steps=3)
    entry = amp.state_dict()["loss_scaler0"]
    # apex's two keys, and mixprec's full state under one key (a printout of apex's is two numbers).
    assert list(entry) == ["loss_scale", "unskipped", "mixprec"]
    assert entry["mixprec"] == amp.loss_scaler().state_dict()
    flat = {"loss_scale": entry["loss_scale"], "unskipped": entry["unskipped"], **entry["mixprec"]}
    model = _net()
    mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    amp.load_state_dict({"loss_scaler0": flat})  # what mixprec wrote before the nesting
    assert amp.loss_scaler().state_dict() == entry["mixprec"]


def test_clipping_master_params_under_o2() -> None:
    model = _net()
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", verbosity=0)
    x, y = next(_batches(1))
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    norm = torch.nn.utils.clip_grad_norm_(mixprec.master_params(opt), max_norm=1e-3)
    assert norm > 1e-3  # the unscaled (not the scaled) gradient norm, a plausible value
    assert norm < 100
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in mixprec.master_params(opt)]))
    assert clipped == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(opt_level="01"), "Unknown opt_level"),
        (dict(opt_level="O1", master_weights=True), "already are the master weights"),
        (dict(opt_level="O1", keep_batchnorm_fp32=True), "keep_batchnorm_fp32 only applies"),
        (dict(opt_level="O2", patch_torch_functions=True), "contradicts itself"),
        (dict(opt_level="O2", dtype=torch.int8), "integer dtypes"),
        (dict(opt_level="O2", loss_scale="big"), "loss_scale must be"),
    ],
)
def test_bad_options_name_the_fix(kwargs: dict[str, object], match: str) -> None:
    model = _net()
    with pytest.raises(ConfigError, match=match) as err:
        mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbosity=0, **kwargs)
    assert "fix:" in str(err.value)


def test_optimizer_of_another_model_and_double_initialize() -> None:
    model, other = _net(), _net(1)
    with pytest.raises(ParameterMismatchError, match="not parameters of the given model"):
        mixprec.initialize(model, torch.optim.SGD(other.parameters(), lr=0.1), verbosity=0)
    mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", verbosity=0)
    with pytest.raises(ConfigError, match="already called"):
        mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", verbosity=0)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_parameter_of_its_own_shape_outside_the_models_steps_as_it_is(level: str) -> None:
    """A trial's SAC: the temperature log_alpha (a bare nn.Parameter in its own Adam) was refused as "not
    parameters of the given model(s)"; apex took it. It stays fp32 and takes Adam's first step, -lr *
    sign(grad), as in fp32."""
    model = _net()
    log_alpha = nn.Parameter(torch.zeros(()))
    opts = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam([log_alpha], lr=0.01)]
    model, opts = mixprec.initialize(model, opts, opt_level=level, verbosity=0)
    x, _ = next(_batches(1))
    with mixprec.scale_loss(-(log_alpha.exp() * model(x).float().mean()), opts) as scaled:
        scaled.backward()
    sign = torch.sign(-model(x).float().mean().detach())  # d/d log_alpha of the loss, at log_alpha = 0
    for opt in opts:
        opt.step()
    assert log_alpha.dtype == torch.float32
    torch.testing.assert_close(log_alpha.detach(), -0.01 * sign, rtol=1e-4, atol=0)


def test_structure_in_structure_out_and_verbosity(capsys: pytest.CaptureFixture[str]) -> None:
    models = [_net(), _net(1)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    out_models, out_opts = mixprec.initialize(models, opts, opt_level="O2")
    assert isinstance(out_models, list) and isinstance(out_opts, list) and len(out_opts) == 2
    printed = capsys.readouterr().out
    assert "Selected optimization level O2" in printed and "master_weights" in printed
    single = mixprec.initialize(nn.Linear(2, 2), opt_level="O0", verbosity=0)
    assert isinstance(single, nn.Linear)
    assert capsys.readouterr().out == ""


def test_losses_reaching_different_parameters_keep_their_own_gradients() -> None:
    """Loss 0 reaches only `a`, loss 1 only `b` (same shapes): each keeps its own gradient."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(4, 4, bias=False), "b": nn.Linear(4, 4, bias=False)})
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = mixprec.initialize(
        model, opt, opt_level="O0", loss_scale="dynamic", num_losses=2, verbosity=0
    )
    x = torch.randn(2, 4)
    with mixprec.scale_loss(model["a"](x).sum(), opt, loss_id=0) as s:
        s.backward()
    with mixprec.scale_loss(model["b"](x).sum(), opt, loss_id=1) as s:
        s.backward()
    (ref["a"](x).sum() + ref["b"](x).sum()).backward()
    for name in ("a", "b"):
        torch.testing.assert_close(model[name].weight.grad, ref[name].weight.grad)


@pytest.mark.parametrize("overrides", [dict(opt_level="O3"), dict(opt_level="O2", master_weights=False)])
def test_dynamic_scaling_of_half_gradients_without_masters(overrides: dict[str, object]) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = mixprec.initialize(model, opt, loss_scale="dynamic", verbosity=0, **overrides)
    x, y = next(_batches(1))
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fused_sgd_momentum_survives_a_skipped_first_step_under_o2() -> None:
    """torch's fused SGD leaves its momentum buffer uninitialized when found_inf skips its first step."""
    runs = {}
    for fused in (True, False):
        torch.manual_seed(0)
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=fused, foreach=not fused)
        model, opt = mixprec.initialize(model, opt, opt_level="O2", verbosity=0)
        for i, (x, y) in enumerate(_batches(3)):
            with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
                scaled.backward()
                if i == 0:
                    model[0].weight.grad.view(-1)[0] = float("inf")
            opt.step()
            opt.zero_grad()
        runs[fused] = list(mixprec.master_params(opt))
        amp.reset()
    for a, b in zip(runs[True], runs[False], strict=True):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------------
# apex's documented behaviours (issue: a home for apex.amp users)


def test_o2_model_state_dict_is_fp32_and_loads_into_an_fp32_model() -> None:
    model = _net()
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", verbosity=0)
    saved = model.state_dict()
    assert all(not t.is_floating_point() or t.dtype == torch.float32 for t in saved.values())
    fp32 = _net(seed=5)
    fp32.load_state_dict(saved)
    torch.testing.assert_close(fp32[0].weight, model[0].weight.float(), atol=0, rtol=0)


def test_amp_state_dict_has_apexs_keys_and_loads_an_apex_checkpoint() -> None:
    model = _net()
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", verbosity=0)
    saved = amp.state_dict()["loss_scaler0"]
    assert saved["loss_scale"] == 2.0**16 and saved["unskipped"] == 0
    # What apex's LossScaler.state_dict() wrote: the scale and the clean steps since the last overflow.
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 1999}})
    scaler = amp.loss_scaler()
    assert scaler.get_scale() == 128.0 and amp.state_dict()["loss_scaler0"]["unskipped"] == 1999
    x, y = next(_batches(1))
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()  # apex: the 2000th clean step (its scale_window) doubles the scale
    assert scaler.get_scale() == 256.0


def test_one_overflowing_loss_skips_every_optimizer_of_its_scale_loss() -> None:
    """apex: scale_loss(loss, [opt0, opt1]) skips both steps when that loss overflowed, even if only
    opt1's gradients were inf (torch.amp would step opt0)."""
    m0, m1 = _net(0), _net(1)
    o0, o1 = torch.optim.SGD(m0.parameters(), lr=0.1), torch.optim.SGD(m1.parameters(), lr=0.1)
    # a small static scale: m0's own fp16 gradients stay finite, only m1's are inf
    (m0, m1), (o0, o1) = mixprec.initialize([m0, m1], [o0, o1], "O1", loss_scale=4.0, verbosity=0)
    before = [p.detach().clone() for p in [*m0.parameters(), *m1.parameters()]]
    x = torch.randn(8, 10)
    loss = m0(x).sum() + m1(x).sum() * torch.tensor(float("inf"))
    with mixprec.scale_loss(loss, [o0, o1]) as scaled:
        scaled.backward()
    assert all(torch.isfinite(p.grad).all() for p in m0.parameters() if p.grad is not None)
    o0.step()
    o1.step()
    after = [p.detach() for p in [*m0.parameters(), *m1.parameters()]]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_second_initialize_keeps_the_first_models_scaler() -> None:
    m0, m1 = _net(0), _net(1)
    m0, o0 = mixprec.initialize(m0, torch.optim.SGD(m0.parameters(), lr=0.1), "O2", loss_scale=64.0,
                                verbosity=0)  # fmt: skip
    with pytest.warns(UserWarning, match="called again"):
        m1, o1 = mixprec.initialize(m1, torch.optim.SGD(m1.parameters(), lr=0.1), "O2", loss_scale=8.0,
                                    verbosity=0)  # fmt: skip
    x = torch.randn(8, 10)
    for model, opt, scale in [(m0, o0, 64.0), (m1, o1, 8.0)]:
        loss = model(x).mean()
        with mixprec.scale_loss(loss, opt) as scaled:
            assert scaled.item() == loss.item() * scale
            scaled.backward()


def test_an_initialize_after_reset_starts_a_new_run_without_a_warning() -> None:
    m0 = _net(0)
    mixprec.initialize(m0, torch.optim.SGD(m0.parameters(), lr=0.1), "O2", verbosity=0)
    mixprec.amp.reset()  # what the warning says to do between independent runs
    m1 = _net(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m1, o1 = mixprec.initialize(m1, torch.optim.SGD(m1.parameters(), lr=0.1), "O2", verbosity=0)
    assert mixprec.amp.loss_scaler() is mixprec.amp.loss_scalers_of([o1])[0]


class _LarcLike:
    """apex's LARC as documented: wraps an optimizer in ``.optim``, exposes its param_groups, rescales
    each gradient by a trust ratio, then calls ``optim.step()``."""

    def __init__(self, optimizer: torch.optim.Optimizer, trust: float = 0.5) -> None:
        self.optim, self.trust = optimizer, trust

    @property
    def param_groups(self) -> list[dict]:
        return self.optim.param_groups

    def zero_grad(self) -> None:
        self.optim.zero_grad()

    def step(self) -> None:
        with torch.no_grad():
            for group in self.optim.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(self.trust)
        self.optim.step()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_larc_style_wrappers_are_accepted(level: str) -> None:
    model, ref = _net(), _net()
    larc = _LarcLike(torch.optim.SGD(model.parameters(), lr=0.1))
    model, larc = mixprec.initialize(model, larc, level, loss_scale=1.0, verbosity=0)
    ref_opt = _LarcLike(torch.optim.SGD(ref.parameters(), lr=0.1))
    x, y = next(_batches(1))
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), larc) as scaled:
        scaled.backward()
    larc.step()
    nn.functional.cross_entropy(ref(x), y).backward()
    ref_opt.step()
    tol = 1e-2  # an fp16 forward (O1's GEMMs, O2's weights) against fp32: a few fp16 ulps in the update
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.float(), q, atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------------------
# real models' inputs and outputs


def test_namedtuple_inputs_and_model_output_mappings_are_cast() -> None:
    from collections import OrderedDict, namedtuple

    Batch = namedtuple("Batch", "x mask")

    class Output(OrderedDict):  # HF's ModelOutput is an OrderedDict subclass
        pass

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(10, 4)

        def forward(self, batch: Batch) -> Output:
            assert batch.x.dtype == self.lin.weight.dtype  # the input reached the model in its dtype
            return Output(logits=self.lin(batch.x) * batch.mask)

    model = Net()
    model = mixprec.initialize(model, opt_level="O2", verbosity=0)
    out = model(Batch(torch.randn(2, 10), torch.ones(2, 1)))
    assert type(out) is Output and out["logits"].dtype == torch.float32


def test_o3_with_adam_warns_before_the_weights_go_non_finite() -> None:
    """The reference: one real O3 Adam step does make the fp16 weights non-finite (eps 1e-8 -> 0 in fp16)."""
    model = _net()
    with pytest.warns(UserWarning, match="eps rounds to 0"):
        model, opt = mixprec.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-3), "O3",
                                        verbosity=0)  # fmt: skip
    x, y = next(_batches(1))
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("level, opt_class", [("O3", torch.optim.SGD), ("O2", torch.optim.Adam)])
def test_no_warning_where_the_optimizer_state_is_safe(level: str, opt_class: type) -> None:
    import warnings

    model = _net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mixprec.initialize(model, opt_class(model.parameters(), lr=1e-3), level, verbosity=0)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_skipped_step_leaves_batchnorm_statistics_as_they_were(level: str) -> None:
    """One NaN sample: the step is skipped and BatchNorm's running statistics must not take the NaN."""
    model = _net()
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), level, verbosity=0)
    bn = model[1]
    before = (bn.running_mean.clone(), bn.running_var.clone())
    x, y = next(_batches(1))
    x[0, 0] = float("nan")
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])


def test_optimizer_state_saved_before_initialize_loads_into_o2_and_back() -> None:
    """apex: an O2 optimizer loads a state_dict saved by the plain optimizer of an fp32 run, and its own
    state_dict loads into a plain optimizer of the fp32 model."""
    fp32 = _net()
    plain = torch.optim.Adam(fp32.parameters(), lr=1e-3)
    x, y = next(_batches(1))
    nn.functional.cross_entropy(fp32(x), y).backward()
    plain.step()
    saved = plain.state_dict()
    model = _net()
    model, opt = mixprec.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-3), "O2", verbosity=0)
    opt.load_state_dict(saved)
    back = torch.optim.Adam(_net().parameters(), lr=1e-3)
    back.load_state_dict(opt.state_dict())
    ref, got = plain.state_dict()["state"], back.state_dict()["state"]
    assert set(ref) == set(got)
    for k in ref:
        torch.testing.assert_close(got[k]["exp_avg"], ref[k]["exp_avg"], atol=0, rtol=0)
        torch.testing.assert_close(got[k]["exp_avg_sq"], ref[k]["exp_avg_sq"], atol=0, rtol=0)


def test_clip_grad_norm_of_the_model_parameters_works_under_o2() -> None:
    """Issue 15's trap: torch.amp's clipping recipe on model.parameters() under O2 returned inf and clipped
    nothing. After scale_loss the model's .grad hold the unscaled gradients (mirrored from the masters), so
    the norm is the fp32 run's and the clip reaches the step."""
    fp32 = _net()
    x, y = next(_batches(1))
    nn.functional.cross_entropy(fp32(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(fp32.parameters(), max_norm=float("inf"))
    model = _net()
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), "O2", verbosity=0)
    before = [p.detach().float().clone() for p in model.parameters()]
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
    assert torch.isfinite(norm) and norm.item() == pytest.approx(ref_norm.item(), rel=2e-2)  # fp16 forward
    opt.step()
    after = [p.detach().float() for p in model.parameters()]
    step = torch.cat([(a - b).flatten() for a, b in zip(after, before, strict=True)])
    assert step.norm().item() < 2e-3  # lr 1 x a gradient clipped to norm 1e-3 (+ fp16 rounding of weights)


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_cast_model_outputs_casts_the_outputs_at_any_level(level: str) -> None:
    """apex's initialize docs: cast_model_outputs ensures the model's outputs are always cast to that type,
    regardless of opt_level."""
    model = mixprec.initialize(_net(), opt_level=level, cast_model_outputs=torch.float16, verbosity=0)
    assert model(torch.randn(4, 10)).dtype == torch.float16


def test_scale_loss_refuses_the_optimizer_o2_replaced_and_names_the_one_to_use() -> None:
    model = _net()
    given = torch.optim.AdamW(model.parameters())
    model, returned = mixprec.initialize(model, given, "O2", verbosity=0)
    assert isinstance(returned, MasterWeights) and returned is not given
    x, y = next(_batches(1))
    with pytest.raises(ConfigError, match="returned a new optimizer") as err:
        with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), given) as scaled:
            scaled.backward()
    assert "opt = mixprec.initialize(model, opt, 'O2')" in err.value.fix
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), returned) as scaled:  # the right one
        scaled.backward()
    returned.step()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_scale_loss_refuses_an_optimizer_built_after_initialize(level: str) -> None:
    # Such an optimizer's step is not routed through the overflow flags (and under O2 it would step the
    # half weights with no masters): before, O2 failed in the scaler with "wrap the optimizer in
    # MasterWeights" and O1 trained without ever skipping.
    model = _net()
    model, _ = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), level, verbosity=0)
    later = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = next(_batches(1))
    with pytest.raises(ConfigError, match="did not return"):
        with mixprec.scale_loss(nn.functional.cross_entropy(model(x).float(), y), later) as scaled:
            scaled.backward()


def test_scale_loss_given_a_model_for_the_optimizer_says_it_is_not_one() -> None:
    """A user trial: scale_loss(loss, model) said "an optimizer (Sequential) that initialize did not
    return"."""
    model = _net()
    model, _ = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1", verbosity=0)
    x, y = next(_batches(1))
    with pytest.raises(ConfigError, match="got Sequential where .* the optimizer.*is not an optimizer"):
        with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), model) as scaled:
            scaled.backward()


@pytest.mark.parametrize("level", LEVELS)
def test_a_scheduler_built_before_initialize_keeps_working_without_torchs_overridden_warning(
    level: str, recwarn: pytest.WarningsRecorder
) -> None:
    # torch.amp's recipe builds the scheduler first; torch warns if optimizer.step was replaced after the
    # scheduler wrapped it, which initialize does (it routes step through the overflow flags).
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt = mixprec.initialize(model, opt, level, loss_scale=1.0, verbosity=0)
    for x, y in _batches(2):
        with mixprec.scale_loss(nn.functional.cross_entropy(model(x).float(), y), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
    assert [str(w.message) for w in recwarn if "lr_scheduler" in str(w.message)
            or "overridden" in str(w.message)] == []
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)  # the scheduler drives the optimizer


def test_scale_loss_passes_the_loss_through_when_initialize_was_disabled() -> None:
    # apex's documented enabled=False: "renders all Amp calls no-ops, so your script should run as if Amp
    # were not present" (apex.amp.initialize): scale_loss yields the loss itself, backward is the plain one.
    other = _net()
    mixprec.initialize(other, torch.optim.SGD(other.parameters(), lr=0.1), "O2", verbosity=0)  # earlier
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.initialize(model, opt, "O2", enabled=False)
    x, y = next(_batches(1))
    loss = nn.functional.cross_entropy(model(x), y)
    with mixprec.scale_loss(loss, opt) as scaled:
        assert scaled is loss
        scaled.backward()
    reference = _net()
    nn.functional.cross_entropy(reference(x), y).backward()
    for ours, ref in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.grad, ref.grad)


def test_an_enabled_initialize_after_a_disabled_one_scales_again() -> None:
    """The disabled call's pass-through must not outlive it: the same optimizer given to an enabled
    initialize afterwards gets its loss scaled (it was passed through, unscaled and unchecked)."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mixprec.initialize(model, opt, "O1", enabled=False)
    model, opt = mixprec.initialize(model, opt, "O1", verbosity=0)
    x, y = next(_batches(1))
    loss = nn.functional.cross_entropy(model(x), y)
    with mixprec.scale_loss(loss, opt) as scaled:
        assert scaled is not loss and scaled.item() == pytest.approx(loss.item() * 2.0**16)  # apex's start
        scaled.backward()


def test_the_replaced_optimizer_is_named_after_a_second_initialize() -> None:
    first = _net()
    given = torch.optim.AdamW(first.parameters())
    first, _ = mixprec.initialize(first, given, "O2", verbosity=0)
    second = _net()
    with pytest.warns(UserWarning, match="initialize was called again"):
        mixprec.initialize(second, torch.optim.AdamW(second.parameters()), "O2", verbosity=0)
    x, y = next(_batches(1))
    with pytest.raises(ConfigError, match="returned a new optimizer"):
        with mixprec.scale_loss(nn.functional.cross_entropy(first(x), y), given) as scaled:
            scaled.backward()


def test_a_scheduler_built_before_initialize_sees_the_fused_master_step(
    recwarn: pytest.WarningsRecorder,
) -> None:
    # O2 bf16 with master_grads=False steps the masters without calling the wrapped AdamW's step(): the
    # scheduler built on that AdamW must still learn that a step ran, or torch warns that
    # lr_scheduler.step() came before optimizer.step().
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt = mixprec.initialize(model, opt, "O2", dtype=torch.bfloat16, master_grads=False, verbosity=0)
    for x, y in _batches(2):
        with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
    assert [str(w.message) for w in recwarn if "lr_scheduler" in str(w.message)] == []
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_training_step_never_reads_a_tensor_on_the_host(level: str, dtype: torch.dtype) -> None:
    """On a GPU a host read waits for every queued kernel: the host stops running ahead and the step
    costs its CPU time plus its GPU time. The CPU stand-in for torch.cuda.set_sync_debug_mode: forward,
    scale_loss (unscale, inf check, scale update) and a fused AdamW step with every Tensor-to-host read
    raising. Loss scaling is dynamic (apex's default at both levels), overflow and all."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # fused: it skips on the device
    model, opt = mixprec.initialize(model, opt, opt_level=level, dtype=dtype, verbosity=0)
    for i, (x, y) in enumerate(_batches(3)):
        before = [p.detach().clone() for p in model.parameters()]
        with NoHostReads() if i else contextlib.nullcontext():  # the first step creates the state
            loss = nn.functional.cross_entropy(model(x), y)
            with mixprec.scale_loss(loss * (float("inf") if i == 2 else 1.0), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
        unchanged = all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        assert unchanged is (i == 2)  # the overflowing step was skipped, on the device; the others stepped


# ---- apex's behaviour where a review against its source found mixprec different (2026-11-25) -------------


@pytest.mark.parametrize("cast", [nn.Module.half, nn.Module.bfloat16])
@pytest.mark.parametrize("level", LEVELS)
def test_a_model_already_cast_to_half_is_refused_as_apex_refuses_it(level: str, cast: object) -> None:
    """apex (_initialize.check_params_fp32) raises at every level; mixprec took it at O2 and failed at
    O0/O1 on the first scale_loss (unscaling half gradients)."""
    model = cast(_net())  # type: ignore[operator]
    with pytest.raises(ConfigError, match=r"(?s)Found parameter '0.weight' of torch.*\.half\(\).*fp32 model"):
        mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), level, verbosity=0)


def test_frozen_half_parameters_and_half_buffers_stay_allowed() -> None:
    """A frozen bf16 backbone under a trained fp32 head (the adapter pattern) and an fp16 buffer train
    nothing half: the refusal above must not reach them."""
    model = _net()
    model[0].bfloat16().requires_grad_(False)
    model.register_buffer("table", torch.zeros(3, dtype=torch.float16))
    head = [p for p in model.parameters() if p.requires_grad]
    mixprec.initialize(model, torch.optim.SGD(head, lr=0.1), "O1", dtype=torch.bfloat16, verbosity=0)


def test_o0_casts_floating_inputs_and_outputs_to_fp32_as_apex() -> None:
    """apex O0: cast_model_type=torch.float32, so an fp16 (or fp64) batch reaches the fp32 model as fp32."""
    model = mixprec.initialize(_net(), opt_level="O0", verbosity=0)
    for dtype in (torch.float16, torch.float64):
        assert model(torch.randn(8, 10).to(dtype)).dtype == torch.float32
    untouched = mixprec.initialize(_net(1), opt_level="O0", cast_model_type=False, verbosity=0)
    with pytest.raises(RuntimeError, match="dtype"):  # apex: cast_model_type=False patches nothing
        untouched(torch.randn(8, 10).half())
    # apex also casts the model to fp32; mixprec leaves an fp64 model, and so its fp64 inputs, as they are
    double = mixprec.initialize(_net(2).double(), opt_level="O0", verbosity=0)
    assert double(torch.randn(8, 10, dtype=torch.float64)).dtype == torch.float64


def _overflowing_step(verbosity: int, level: str = "O2", optimizer: type = torch.optim.SGD) -> None:
    model = _net()
    model, opt = mixprec.initialize(model, optimizer(model.parameters(), lr=0.1), level,
                                    verbosity=verbosity)  # fmt: skip
    x, y = next(_batches(1))
    loss = nn.functional.cross_entropy(model(x), y) * float("inf")
    with mixprec.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW])
def test_a_skipped_step_says_so_as_apex_does(capsys: pytest.CaptureFixture[str], optimizer: type) -> None:
    """apex's handle.skip_step prints this line at verbosity >= 1 (its default); mixprec was silent. O2
    makes AdamW fused, which skips inside its kernel: on the CPU the flag reads for free, so it says so too
    (a user trial found it quiet)."""
    _overflowing_step(verbosity=1, optimizer=optimizer)
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0"
    _overflowing_step(verbosity=1, level="O3")  # static: skipped too (apex would apply the inf), and said
    assert capsys.readouterr().out.splitlines()[-1].endswith("loss scaler 0 keeping its static 1.0")
    _overflowing_step(verbosity=0)
    assert capsys.readouterr().out == ""


def test_an_overflow_at_the_floor_says_the_scale_stays(capsys: pytest.CaptureFixture[str]) -> None:
    """At the dynamic scale's floor every skipped step said "reducing loss scale to 1.0" (a user trial)."""
    model = _net()
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2",
                                    max_loss_scale=4.0, verbosity=1)  # apex: starts at min(max, 2**16)
    x, y = next(_batches(1))
    for _ in range(4):
        loss = nn.functional.cross_entropy(model(x), y) * float("inf")
        with mixprec.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    tails = [line.split("loss scaler 0 ")[1] for line in capsys.readouterr().out.splitlines()
             if line.startswith("Gradient overflow")]
    assert tails == ["reducing loss scale to 2.0", "reducing loss scale to 1.0",
                     "keeping loss scale at its floor 1.0", "keeping loss scale at its floor 1.0"]


def test_an_overflow_of_one_loss_over_two_optimizers_is_said_once(capsys: pytest.CaptureFixture[str]) -> None:
    """One overflowing scale_loss(loss, [opt1, opt2]) printed apex's line at each optimizer's step: twice
    for one skip (a DLRM trial's two optimizers). apex said it once per loss; the next overflow again."""
    model = _net()
    opts = [torch.optim.SGD([*model[0].parameters(), *model[1].parameters()], lr=0.1),
            torch.optim.SGD(model[3].parameters(), lr=0.1)]
    model, opts = mixprec.initialize(model, opts, "O2", verbosity=1)
    x, y = next(_batches(1))
    for _ in range(2):
        loss = nn.functional.cross_entropy(model(x), y) * float("inf")
        with mixprec.scale_loss(loss, opts) as scaled:
            scaled.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Gradient overflow")]
    assert [line.split("loss scaler 0 ")[1] for line in said] == ["reducing loss scale to 32768.0",
                                                                  "reducing loss scale to 16384.0"]


def _moved(after: Iterator[torch.Tensor], before: list[torch.Tensor]) -> torch.Tensor:
    """The norm of the update from ``before`` to ``after``, in fp32."""
    steps = [(a.float() - b).flatten() for a, b in zip(after, before, strict=True)]
    return torch.linalg.vector_norm(torch.cat(steps))


@pytest.mark.parametrize("how", ["MasterWeights", "O2 bf16 without scale_loss"])
def test_a_clip_of_master_params_before_the_masters_have_gradients_clips(how: str) -> None:
    """A clip of master_params(opt) between backward and the step clipped nothing when the masters had no
    gradient yet (MasterWeights used directly; O2 bf16 with backward outside scale_loss): the step then
    used the unclipped gradients, silently. The gradients are now moved to the masters first."""
    x, y = next(_batches(1))
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
    if how == "MasterWeights":
        model = model.bfloat16()
        opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=1.0))
    else:
        model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), "O2",
                                        dtype=torch.bfloat16, verbosity=0)  # fmt: skip
    nn.functional.cross_entropy(model(x.bfloat16()).float(), y).backward()
    want = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()]))
    before = [p.detach().float().clone() for p in opt.master_views()]
    got = nn.utils.clip_grad_norm_(mixprec.master_params(opt), 1e-3)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)  # the norm of the true gradients
    opt.step()
    assert _moved(opt.master_views(), before) <= 1e-3 * (1 + 1e-5)  # lr 1: the clipped gradients


def test_master_params_between_delayed_micro_steps_leaves_the_accumulation_alone() -> None:
    """Between delay_unscale micro-steps the model's gradients are still scaled: master_params must not
    move them to the masters, or the last scale_loss would unscale a partial sum."""
    def run(peek: bool) -> list[torch.Tensor]:
        amp.reset()
        model = _net()
        model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", verbosity=0)
        for i, (x, y) in enumerate(_batches(2)):
            with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y) / 2, opt,
                                    delay_unscale=i == 0) as scaled:  # fmt: skip
                scaled.backward()
            if peek and i == 0:
                assert len(list(mixprec.master_params(opt))) == len(list(model.parameters()))
        opt.step()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)


def test_initialize_after_a_loaded_optimizer_state_names_apexs_resume_order() -> None:
    """nanoGPT's resume order (optimizer.load_state_dict, then initialize) was refused as "already
    stepped", which the optimizer had not; the message now names the order that works."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = mixprec.initialize(model, opt, "O2", verbosity=0)
    x, y = next(_batches(1))
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    saved = opt.state_dict()
    amp.reset()
    fresh = _net()
    plain = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    plain.load_state_dict(saved)
    with pytest.raises(ConfigError, match="loaded a state_dict") as info:
        mixprec.initialize(fresh, plain, "O2", verbosity=0)
    assert "initialize, then model/optimizer/amp load_state_dict" in str(info.value)


def test_scale_loss_names_replaced_parameters_when_no_optimizer_got_a_gradient() -> None:
    """Parameters replaced after initialize (what fully_shard does) leave the optimizer's tensors without
    gradients: scale_loss raised torch's "call scaler.step(optimizer) (or unscale_)", which a scale_loss
    user never calls."""
    model = _net()
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", verbosity=0)
    for layer in (model[0], model[3]):
        layer.weight = nn.Parameter(layer.weight.detach().clone())
        layer.bias = nn.Parameter(layer.bias.detach().clone())
    model[1].requires_grad_(False)
    x, y = next(_batches(1))
    with pytest.raises(mixprec.ScalerStateError, match="replaced after"):
        with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
            scaled.backward()


def test_a_loss_that_reaches_no_parameter_passes_through_scale_loss_as_in_apex() -> None:
    """A constant auxiliary loss (an empty MoE term, a frozen warm-up) gives no gradient at all: apex
    lets it pass; mixprec raised torch's "No inf checks were recorded prior to update"."""
    model = _net()
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", verbosity=0)
    x, y = next(_batches(1))
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    want = [p.grad.clone() for p in mixprec.master_params(opt)]
    with mixprec.scale_loss(torch.zeros((), requires_grad=True), opt) as scaled:
        scaled.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(mixprec.master_params(opt), want, strict=True))
    opt.step()


def _two_parts_two_optimizers(num_losses: int) -> tuple[nn.Module, Any, Any]:
    """An O2 model whose first part (optimizer a) is frozen and whose second (optimizer b) trains."""
    model = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 4))
    a, b = torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[2].parameters(), lr=0.1)
    model, (a, b) = mixprec.initialize(model, [a, b], "O2", verbosity=0, num_losses=num_losses)
    model[0].requires_grad_(False)
    return model, a, b


def test_gradients_an_earlier_loss_left_are_not_this_losss() -> None:
    """The check for gradients on parameters no optimizer passed holds counted every .grad, so a constant
    loss for one optimizer after a real loss for another was refused."""
    model, a, b = _two_parts_two_optimizers(num_losses=2)  # a's part frozen: its loss is a constant for now
    x, y = next(_batches(1))
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), b, loss_id=1) as scaled:
        scaled.backward()
    with mixprec.scale_loss(torch.tensor(0.5, requires_grad=True), a, loss_id=0) as scaled:
        scaled.backward()
    a.step()
    b.step()


def test_a_loss_given_to_the_wrong_optimizer_is_refused() -> None:
    """The loss reaches only b's parameters but scale_loss got a: b's gradients stayed scaled by 65536 and
    b.step() trained on them, silently."""
    model, a, b = _two_parts_two_optimizers(num_losses=1)
    x, y = next(_batches(1))
    with pytest.raises(mixprec.ScalerStateError, match="parameter\\(s\\) of another optimizer"):
        with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), a) as scaled:
            scaled.backward()


def _shared_trunk_two_losses(level: str) -> tuple[nn.Module, Any, Any, torch.Tensor]:
    """A body and a head, one optimizer each; the second loss of the same forward reaches both (trial:
    a ResNet's auxiliary loss given only to the head's optimizer)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
    body, head = (torch.optim.SGD(part.parameters(), lr=0.1) for part in (model[0], model[2]))
    model, [body, head] = mixprec.initialize(model, [body, head], level, num_losses=2, verbosity=0)
    x, y = next(_batches(1))
    out = model(x)
    with mixprec.scale_loss(nn.functional.cross_entropy(out, y), [body, head], loss_id=0) as scaled:
        scaled.backward(retain_graph=True)
    return model, body, head, out.float().pow(2).mean()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_step_on_gradients_another_optimizers_loss_left_scaled_is_refused(level: str) -> None:
    """The body's gradients held the auxiliary loss times 65536 (unscaled only for the head), so the
    body's step was ~30x too large, and an overflow in them went unchecked: NaN weights, no message."""
    model, body, head, aux = _shared_trunk_two_losses(level)
    before = model[0].weight.detach().clone()
    with mixprec.scale_loss(aux, head, loss_id=1) as scaled:
        scaled.backward()
    for _ in range(2):  # a second try (a notebook cell run again) is refused too
        with pytest.raises(mixprec.ScalerStateError, match="loss_id=1.*not passed"):
            body.step()
    assert torch.equal(model[0].weight, before)
    head.step()  # the head's gradients were unscaled: its step goes on


def test_a_loss_for_an_optimizer_whose_gradients_another_loss_left_scaled_is_refused() -> None:
    """A review: the next scale_loss given the body would unscale loss 1's scaled values as its own (by
    another scale, or set them aside as unscaled), and cleared the record that would have caught it."""
    model, body, head, aux = _shared_trunk_two_losses("O2")
    with mixprec.scale_loss(aux, head, loss_id=1) as scaled:
        scaled.backward()
    x, y = next(_batches(1))
    with pytest.raises(mixprec.ScalerStateError, match=r"scale_loss\(\.\.\., loss_id=0\) on .*loss_id=1"):
        with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), body, loss_id=0) as scaled:
            scaled.backward()


def test_scaled_gradients_on_another_optimizer_pass_when_they_are_not_stepped_on() -> None:
    """A GAN's generator loss writes the discriminator's gradients too; zeroed before the discriminator's
    next step (or passed to the loss with it), nothing scaled is stepped on."""
    for level in ("O0", "O2"):
        model, body, head, aux = _shared_trunk_two_losses(level)
        with mixprec.scale_loss(aux, head, loss_id=1) as scaled:
            scaled.backward()
        head.step()
        if level != "O0":  # O0's scale is 1: nothing is left scaled
            body.zero_grad()
        body.step()
        amp.reset()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_gradient_penalty_block_that_writes_no_gradient_is_not_refused(level: str) -> None:
    """WGAN-GP the apex way (a trial): the penalty's scale_loss(..., delay_unscale=True) only feeds
    autograd.grad, and the critic's zero_grad comes after it. Its entry refused the generator loss's
    scaled gradients left on the critic, which that block neither reads nor unscales (apex leaves .grad
    alone there). A delayed block whose backward adds to them is still refused, at its end."""
    torch.manual_seed(0)
    gen, critic = nn.Linear(4, 8), nn.Linear(8, 1)
    opts = [torch.optim.Adam(gen.parameters()), torch.optim.Adam(critic.parameters())]
    [gen, critic], [opt_g, opt_d] = mixprec.initialize([gen, critic], opts, level, num_losses=2, verbosity=0)

    def penalty_then_critic_step(backward_in_penalty: bool = False) -> None:
        real, fake = torch.randn(16, 8), gen(torch.randn(16, 4)).detach()
        mixed = (0.5 * real + 0.5 * fake).requires_grad_(True)
        with mixprec.scale_loss(critic(mixed).sum(), opt_d, loss_id=0, delay_unscale=True) as scaled:
            if backward_in_penalty:
                scaled.backward(retain_graph=True)  # onto the generator loss's leftovers: refused below
            (g,) = torch.autograd.grad(scaled, mixed, create_graph=True)
        penalty = ((g / amp.loss_scaler(0).get_scale()).norm(dim=1) - 1).pow(2).mean()
        opt_d.zero_grad()
        with mixprec.scale_loss(critic(fake).mean() - critic(real).mean() + 10 * penalty, opt_d,
                                loss_id=0) as scaled:  # fmt: skip
            scaled.backward()
        opt_d.step()

    def generator_step() -> None:  # its backward writes the critic's gradients too, scaled by loss 1
        opt_g.zero_grad()
        with mixprec.scale_loss(-critic(gen(torch.randn(16, 4))).mean(), opt_g, loss_id=1) as scaled:
            scaled.backward()
        opt_g.step()

    for _ in range(3):
        penalty_then_critic_step()
        generator_step()
    with pytest.raises(mixprec.ScalerStateError, match=r"(?s)delay_unscale=True, whose backward added.*"
                                                       r"loss_id=1\) wrote"):  # fmt: skip
        penalty_then_critic_step(backward_in_penalty=True)


def test_loss_scaler_of_an_earlier_initialize_is_reached_by_its_optimizer() -> None:
    """A trial's WGAN-GP with one initialize per model: the critic's penalty divided by loss_scaler(), the
    latest call's (the generator's) scale, a 4x wrong penalty once the critic's scale backed off."""
    critic, gen = nn.Linear(8, 1), nn.Linear(4, 8)
    critic, opt_d = mixprec.initialize(critic, torch.optim.SGD(critic.parameters(), lr=0.1), "O1",
                                       verbosity=0)  # fmt: skip
    with pytest.warns(UserWarning, match=r"loss_scaler\(optimizer=its_optimizer\)"):
        gen, opt_g = mixprec.initialize(gen, torch.optim.SGD(gen.parameters(), lr=0.1), "O1", verbosity=0)
    with mixprec.scale_loss(critic(torch.randn(3, 8)).sum() * float("inf"), opt_d) as scaled:
        scaled.backward()  # an overflow: the critic's scale backs off, the generator's does not
    opt_d.step()
    with mixprec.scale_loss(gen(torch.randn(3, 4)).mean() * 1e-3, opt_g) as scaled:  # no overflow
        scaled.backward()
    assert amp.loss_scaler(optimizer=opt_d).get_scale() == 2.0**15
    assert amp.loss_scaler().get_scale() == amp.loss_scaler(optimizer=opt_g).get_scale() == 2.0**16
    with pytest.raises(ConfigError, match="no mixprec.initialize returned"):
        amp.loss_scaler(optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_model_zero_grad_starts_a_new_iteration_under_o2(set_to_none: bool) -> None:
    """word_language_model's loop zeroes with model.zero_grad() and may step by hand: under O2 the masters'
    gradients were summed into every later loss's, and the model's .grad (their mirror) showed the running
    sum (a trial: train loss 0.892 against fp32's 0.418). As in torch, model.zero_grad() clears them; two
    losses without a zero_grad between still add up (apex's accumulation)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0), "O2", verbosity=0)
    x, y = torch.randn(8, 4), torch.tensor([0, 1] * 4)
    seen = []
    for _ in range(3):  # lr 0: the same weights, the same gradient each time
        model.zero_grad(set_to_none=set_to_none)
        with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
            scaled.backward()
        seen.append(model.weight.grad.detach().clone())
    assert all(torch.equal(g, seen[0]) for g in seen)
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()  # no zero_grad: a second loss of the iteration adds to the first
    torch.testing.assert_close(model.weight.grad.float(), 2 * seen[0].float(), rtol=2e-3, atol=0)


def test_o2_keeps_an_earlier_loss_that_reached_only_fp32_parameters() -> None:
    """A review of the model.zero_grad() rule: a first loss reaching only the parameters O2 keeps fp32
    (an L1 penalty on BatchNorm's scales) left the half parameters without gradients, was taken for a
    model.zero_grad() and dropped (BN's update 0.43 instead of O1's 8.34)."""
    def bn_update(level: str) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), level,
                                        num_losses=2, verbosity=0)  # fmt: skip
        before = model[1].weight.detach().float().clone()
        with mixprec.scale_loss(model[1].weight.float().abs().sum(), opt, loss_id=0) as scaled:
            scaled.backward()
        with mixprec.scale_loss(model(torch.randn(16, 4)).float().pow(2).mean(), opt, loss_id=1) as scaled:
            scaled.backward()
        opt.step()
        amp.reset()
        return before - model[1].weight.detach().float()

    torch.testing.assert_close(bn_update("O2"), bn_update("O1"), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("how", ["create_graph", "after_an_unscaled_loss"])
def test_a_delayed_block_cannot_carry_another_losss_scaled_gradients(level: str, how: str) -> None:
    """A review of the deferred check: a delayed block after an earlier unscaled loss set the other loss's
    scaled gradients aside as unscaled (the step 16,000x too large), and a create_graph backward, which
    replaces .grad instead of adding in place, passed as untouched. Both are refused."""
    torch.manual_seed(0)
    body, head = nn.Linear(4, 8), nn.Linear(8, 2)
    model = nn.Sequential(body, head)
    opts = [torch.optim.SGD(body.parameters(), lr=1e-3), torch.optim.SGD(head.parameters(), lr=1e-3)]
    model, [opt_body, opt_head] = mixprec.initialize(model, opts, level, num_losses=2, verbosity=0)
    x = torch.randn(16, 4)
    with pytest.raises(mixprec.ScalerStateError, match=r"loss_id=1\) wrote"):
        if how == "after_an_unscaled_loss":
            with mixprec.scale_loss(model(x).float().pow(2).mean(), [opt_body, opt_head], loss_id=0) as s:
                s.backward()
        with mixprec.scale_loss(model(x).float().pow(2).mean(), opt_head, loss_id=1) as s:  # the mistake
            s.backward()
        with mixprec.scale_loss(model(x).float().pow(2).mean(), [opt_body, opt_head], loss_id=0,
                                delay_unscale=True) as s:  # fmt: skip
            s.backward(create_graph=how == "create_graph")
        with mixprec.scale_loss(model(x).float().pow(2).mean(), [opt_body, opt_head], loss_id=0) as s:
            s.backward()
        opt_body.step()


def test_a_parameter_two_optimizers_hold_is_unscaled_with_the_one_passed() -> None:
    model = _net()
    parts = (model.parameters(), model[3].parameters())
    everything, head = (torch.optim.SGD(params, lr=0.1) for params in parts)
    model, [everything, head] = mixprec.initialize(model, [everything, head], "O1", verbosity=0)
    x, y = next(_batches(1))
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), everything) as scaled:
        scaled.backward()
    everything.step()
    head.step()  # its gradients are the ones `everything` unscaled: nothing left scaled


def test_a_loss_that_reaches_no_parameter_works_iteration_after_iteration() -> None:
    """Passing it left the scaler's unscale_ recorded: the next iteration raised "unscale_() has already
    been called"."""
    model = _net()
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", verbosity=0)
    scaler = amp.loss_scaler()
    scaler.set_growth_interval(2)
    scale = scaler.get_scale()
    for _ in range(3):
        with mixprec.scale_loss(torch.zeros((), requires_grad=True), opt) as scaled:
            scaled.backward()
        opt.step()
    assert scaler.get_scale() == 2 * scale  # clean iterations, as apex counts them: growth goes on


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_a_prepared_model_saves_whole_and_loads_back(level: str) -> None:
    """``torch.save(model)`` (the whole model, as many scripts save one) failed at every level: the
    model's hooks held lambdas. The loaded model gives the same outputs, output dtype included."""
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    model = mixprec.initialize(model, opt_level=level, cast_model_outputs=torch.float64, verbosity=0)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(3, 4)
    out = model(x)
    assert out.dtype == torch.float64 and torch.equal(loaded(x), out)


def test_o2_model_loaded_after_initialize_keeps_the_loaded_weights() -> None:
    """apex's resume order loads the model after initialize; a fine-tune loads pretrained weights the same
    way. The masters made at initialize must not write the old weights back at the first step."""
    torch.manual_seed(0)
    pretrained = nn.Linear(4, 4)
    torch.manual_seed(1)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = mixprec.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    model.load_state_dict(pretrained.state_dict())
    loaded = model.weight.detach().clone()
    with mixprec.scale_loss(model(torch.randn(2, 4)).sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert torch.equal(model.weight, loaded)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_forward_after_model_float_is_refused_naming_restore(level: str) -> None:
    """apex's patched forward keeps casting inputs to fp16 after ``model.float()``, and the first fp32
    weight it meets fails with a dtype mismatch. mixprec's emulated half arithmetic took the half inputs
    and fp32 weights silently: an "fp32 evaluation" gave the O2 model's half-precision outputs (a user
    trial's ResNet, bit for bit). Now the forward is refused with the way back to fp32."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.initialize(model, opt, opt_level=level, verbosity=0)
    model.float()
    with pytest.raises(ConfigError, match=r"float32 now.*casts inputs to float16(.|\n)*amp.restore"):
        model(torch.randn(3, 4))
    amp.restore(model)
    assert model(torch.randn(3, 4)).dtype is torch.float32


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_restore_gives_back_an_fp32_model_with_the_masters_values(level: str) -> None:
    """After O2, ``model.float()`` left the input hook casting to half ("mat1 and mat2 must have the same
    dtype"); restore takes every hook off and gives the parameters their masters' fp32 values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.initialize(model, opt, opt_level=level, cast_model_outputs=torch.float64,
                                    verbosity=0)  # fmt: skip
    for _ in range(2):
        with mixprec.scale_loss(model(torch.randn(3, 4)).float().square().mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    masters = [m.detach().clone() for m in opt.master_views()] if isinstance(opt, MasterWeights) else None
    assert amp.restore(model) is model
    assert all(p.dtype == torch.float32 for p in model.parameters())
    if masters is not None:
        assert all(torch.equal(p, m) for p, m in zip(model.parameters(), masters, strict=True))
    assert not [m for m in model.modules()
                if m._forward_pre_hooks or m._forward_hooks or "forward" in m.__dict__]  # fmt: skip
    plain = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    plain.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    assert torch.equal(model(x), plain(x))  # an fp32 model again: fp32 output, no region
    with pytest.raises(ConfigError, match="restored already"):
        amp.restore(model)


@pytest.mark.parametrize("api", ["parametrizations", "hooks"])
def test_restore_after_weight_norm_was_folded_is_refused_and_the_other_order_is_exact(api: str) -> None:
    """Folding weight norm for export replaces g and v by a new weight computed in half: restore left that
    weight half (the next forward failed in torch) or raised a bare AttributeError ('no attribute
    weight_g'). Now it refuses before changing anything, naming the order that works: restore, then fold,
    whose weight is the fold of the fp32 masters."""
    def build() -> tuple[nn.Module, nn.Conv1d]:
        torch.manual_seed(0)
        conv = nn.Conv1d(2, 4, 3)
        if api == "parametrizations":
            nn.utils.parametrizations.weight_norm(conv)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch's deprecation of the hook API
                nn.utils.weight_norm(conv)
        return nn.Sequential(conv, nn.Flatten(), nn.Linear(24, 1)), conv

    def fold(conv: nn.Conv1d) -> None:
        if api == "parametrizations":
            nn.utils.parametrize.remove_parametrizations(conv, "weight")
        else:
            nn.utils.remove_weight_norm(conv)

    x = torch.randn(5, 2, 8)
    for order in ("fold, restore", "restore, fold"):
        model, conv = build()
        model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", verbosity=0)
        with mixprec.scale_loss(model(x).sum(), opt) as scaled:
            scaled.backward()
        opt.step()
        if order == "fold, restore":
            fold(conv)
            with pytest.raises(ConfigError, match=r"'0\.(parametrizations\.weight\.original0|weight_g)'.*"
                                                  r"no longer in the model(.|\n)*restore first, then"):
                amp.restore(model)
            continue
        pairs = zip(opt.model_params(), opt.master_views(), strict=True)
        masters = {id(p): m.detach().clone() for p, m in pairs}
        amp.restore(model)
        g, v = ((conv.parametrizations.weight.original0, conv.parametrizations.weight.original1)
                if api == "parametrizations" else (conv.weight_g, conv.weight_v))  # fmt: skip
        assert torch.equal(g, masters[id(g)]) and torch.equal(v, masters[id(v)])
        want = g * v / v.norm(dim=(1, 2), keepdim=True)  # weight norm's fold, of the fp32 masters
        fold(conv)
        assert conv.weight.dtype is torch.float32
        torch.testing.assert_close(conv.weight, want, rtol=1e-6, atol=0)
        assert model(x).dtype is torch.float32


def test_restore_behind_a_larc_style_wrapper_gives_the_masters_values() -> None:
    """restore looked for MasterWeights among the optimizers initialize returned, not inside a LARC-style
    wrapper's .optim: the model came back with its fp16-rounded weights."""
    torch.manual_seed(0)
    model = _net()
    larc = _LarcLike(torch.optim.SGD(model.parameters(), lr=0.1))
    model, larc = mixprec.initialize(model, larc, "O2", verbosity=0)
    x, y = next(_batches(1))
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), larc) as scaled:
        scaled.backward()
    larc.step()
    pairs = [(p, m.detach().clone()) for p, m in zip(larc.optim.model_params(), larc.optim.master_views(),
                                                     strict=True)]
    amp.restore(model)
    assert pairs and all(torch.equal(p, m) for p, m in pairs)


def test_restore_keeps_weights_loaded_after_the_last_step() -> None:
    """Loading the best epoch's weights, then restoring: restore wrote the last step's masters over them."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    best = {k: v.clone() for k, v in nn.Linear(4, 4).state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    with mixprec.scale_loss(model(torch.randn(2, 4)).sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    model.load_state_dict(best)
    amp.restore(model)
    assert torch.equal(model.weight, best["weight"].half().float())  # the loaded weights, as held in fp16


def _o2_bf16_sgd_after_backward() -> tuple[nn.Module, Any]:
    """O2 bf16 over SGD with lr 1 (a step subtracts the gradient), after one scale_loss block."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4))
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), "O2",
                                    dtype=torch.bfloat16, verbosity=0)
    x, y = next(_batches(1))
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    return model, opt


def test_a_clip_of_the_model_parameters_after_scale_loss_shows_in_the_masters_gradients() -> None:
    """A user trial: after clip_grad_norm_(model.parameters()) outside the block, master_params(opt) still
    held the unclipped gradients (norm 0.93 against the clip's 0.5) until the step took the edit. A clip
    made after master_params was read still reaches the step."""
    model, opt = _o2_bf16_sgd_after_backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2)
    masters = list(amp.master_params(opt))
    clipped = [p.grad.float() for p in model.parameters()]
    assert all(torch.equal(m.grad, c) for m, c in zip(masters, clipped, strict=True))  # exact upcasts
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # a second clip, after the masters were read
    before = [m.detach().clone() for m in masters]
    want = [p.grad.float() for p in model.parameters()]
    opt.step()
    for m, b, g in zip(amp.master_params(opt), before, want, strict=True):
        torch.testing.assert_close(m.detach(), b - g, rtol=0, atol=1e-7)  # SGD, lr 1: the second clip's


@pytest.mark.parametrize("clip", ["opt.clip_grad_norm_", "clip of master_params"])
def test_a_clip_of_the_masters_survives_a_later_touch_of_the_model_gradients(clip: str) -> None:
    """From a review: after the masters' gradients were clipped, a norm logged with
    clip_grad_norm_(model.parameters(), inf) (a multiply by 1 in place) made the step copy the model's
    unclipped gradients back over them: an update of norm 0.79 instead of the clip's 1e-3."""
    model, opt = _o2_bf16_sgd_after_backward()
    if clip == "opt.clip_grad_norm_":
        opt.clip_grad_norm_(1e-3)
    else:
        torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1e-3)
    logged = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    if clip == "opt.clip_grad_norm_":  # the wrapper's clip shows in the model's .grad too
        assert logged.item() == pytest.approx(1e-3, rel=1e-2)  # their bf16 rounding
    else:  # a clip of the masters outside the library: the model's .grad are the unclipped ones
        assert logged.item() > 0.1
    before = [m.detach().clone() for m in amp.master_params(opt)]
    opt.step()
    after = amp.master_params(opt)
    update = torch.cat([(b - m.detach()).flatten() for b, m in zip(before, after, strict=True)])
    # SGD, lr 1: the clipped gradient (after the wrapper's clip, the log's edit is taken as the model holds
    # it: the clip rounded to bf16)
    assert update.norm().item() == pytest.approx(1e-3, rel=1e-2)


def _master_grads_of_losses(parts: list[tuple[float, bool, bool]], dtype: torch.dtype = torch.float16
                            ) -> list[torch.Tensor]:
    """O2's master gradients after losses k x cross-entropy of one batch, each (k, delay_unscale,
    zero_grad before it), at a static scale of 16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 4))
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2",
                                    dtype=dtype, loss_scale=2.0**4, verbosity=0)
    x, y = next(_batches(1))
    for k, delay, zero_first in parts:
        if zero_first:
            opt.zero_grad()
        with mixprec.scale_loss(k * nn.functional.cross_entropy(model(x), y), opt,
                                delay_unscale=delay) as scaled:
            scaled.backward()
    grads = [m.grad.clone() for m in amp.master_params(opt)]
    amp.reset()
    return grads


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_delayed_loss_between_two_unscaled_ones_adds_up_with_them(dtype: torch.dtype) -> None:
    """From a review: losses 1x, 2x with delay_unscale, then 4x into one O2 optimizer gave the masters 4x
    the gradient: the first loss's unscaled gradients, set aside when the delayed one began, were dropped
    at its exit, and the delayed loss's own were zeroed by the next. Reference: one loss of 7x."""
    # within the half backward's rounding (7x computed once against 2x + 4x summed in the half .grad): two
    # units in the last place of the largest gradient (4/7 of it, before the fix, is far outside)
    parts = _master_grads_of_losses([(1.0, False, False), (2.0, True, False), (4.0, False, False)], dtype)
    for got, want in zip(parts, _master_grads_of_losses([(7.0, False, False)], dtype), strict=True):
        ulp = torch.finfo(dtype).eps * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=0, atol=2 * ulp)


def _update_norm_of_step(opt: Any) -> float:
    """The norm of what ``opt.step()`` changed in the masters (read without amp.master_params, which
    takes the model's gradient edits itself)."""
    masters = getattr(opt, "optim", opt)  # a LARC-like wrapper holds the MasterWeights
    before = [m.detach().clone() for m in masters.master_params()]
    opt.step()
    after = masters.master_params()
    return torch.cat([(b - m.detach()).flatten() for b, m in zip(before, after, strict=True)]).norm().item()


def test_a_clip_of_the_model_parameters_after_a_norm_logged_through_the_wrapper_reaches_the_step() -> None:
    """From a review: opt.clip_grad_norm_(inf) (the fp32 norm, for a log) multiplies the masters'
    gradients by 1 in place; a clip of model.parameters() after it was then dropped (update 0.18 for 1e-3)."""
    model, opt = _o2_bf16_sgd_after_backward()
    opt.clip_grad_norm_(float("inf"))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    assert _update_norm_of_step(opt) == pytest.approx(1e-3, rel=1e-2)  # the clip of bf16 gradients


def test_a_clip_of_the_model_parameters_reaches_the_masters_before_a_larc_like_wrapper_scales_them() -> None:
    """From a review: the wrapper's in-place trust-ratio scaling of the masters' gradients made them look
    edited by the user, and the model clip before it was dropped. Reference: lr x trust x the clip."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4))
    larc = _LarcLike(torch.optim.SGD(model.parameters(), lr=1.0), trust=0.1)
    model, opt = mixprec.initialize(model, larc, "O2", dtype=torch.bfloat16, verbosity=0)
    x, y = next(_batches(1))
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-2)
    assert _update_norm_of_step(opt) == pytest.approx(1e-3, rel=1e-2)


def test_a_zero_grad_after_a_delayed_loss_drops_the_gradients_carried_past_it() -> None:
    """From a review: 1x, 2x delayed, zero_grad, 4x gave 5x: the first loss's gradients, carried past the
    delayed one, came back after the zero_grad. Reference: the 4x loss alone."""
    got = _master_grads_of_losses([(1.0, False, False), (2.0, True, False), (4.0, False, True)])
    for g, want in zip(got, _master_grads_of_losses([(4.0, False, False)]), strict=True):
        assert torch.equal(g, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_step_right_after_a_delayed_loss_is_refused_with_the_fix(dtype: torch.dtype) -> None:
    """apex's scale_loss docstring: on exit, with delay_unscale=False, the gradients are unscaled "so that
    optimizer.step() can be called" (apex/amp/handle.py). A step right after a delayed one
    applied gradients still multiplied by the scale (fp16's 2**16: NaN weights in a review's run); it is
    refused, nothing changed, and the accumulation ended properly then steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 4))
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", dtype=dtype,
                                    verbosity=0)
    x, y = next(_batches(1))
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt, delay_unscale=True) as scaled:
        scaled.backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ScalerStateError, match="delay_unscale=True") as err:
        opt.step()
    assert "without delay_unscale" in err.value.fix
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_a_saved_or_copied_model_carries_no_optimizer_state() -> None:
    """initialize's hooks on the model (the no_sync watch among them) must not hold the run's state: a
    torch.save(model) or an EMA's deepcopy(model) would carry the optimizer, its masters and moments."""
    import io

    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    opt = torch.optim.Adam(model.parameters())
    model, opt = mixprec.initialize(model, opt, "O2", verbosity=0)
    with mixprec.scale_loss(model(torch.randn(8, 64).half()).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()  # Adam's moments and the fp32 masters now exist: 3x the half model's bytes in fp32 alone

    def saved_bytes(obj: Any) -> int:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return len(buffer.getvalue())

    weights = saved_bytes(model.state_dict())  # fp32 on save (apex's O2 hook): the masters' size
    assert saved_bytes(model) < 1.5 * weights
    assert saved_bytes(copy.deepcopy(model)) < 1.5 * weights
    amp.reset()


def test_scale_loss_without_an_optimizer_says_so() -> None:
    """A user trial (pytorch/examples' word_language_model updates by hand, no optimizer): initialize(model)
    then scale_loss(loss, None) blamed parameters "that no optimizer holds" and sharding."""
    model = mixprec.initialize(_net(), opt_level="O2", verbosity=0)
    x, y = next(_batches(1))
    loss = nn.functional.cross_entropy(model(x), y)
    for nothing in (None, []):
        with pytest.raises(ConfigError, match=r"(?s)scale_loss got no optimizer.*torch.optim.SGD"):
            with mixprec.scale_loss(loss, nothing):
                pass


def test_restore_of_a_model_loaded_elsewhere_names_the_fp32_way() -> None:
    """torch.load'ed in a new process (generate.py's way), restore said "initialize has not been called:
    call initialize first"; the fp32 copy comes from the saved model's fp32 state dict."""
    saved = mixprec.initialize(_net(), opt_level="O2", verbosity=0)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with pytest.raises(ConfigError, match=r"(?s)loaded with torch.load.*load_state_dict\(saved_model"):
        mixprec.amp.restore(loaded)
    fp32 = _net()
    fp32.load_state_dict(loaded.state_dict())
    assert all(p.dtype is torch.float32 for p in fp32.parameters())


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_restore_gives_back_float_buffers_exactly_and_keeps_no_weight_copy(level: str) -> None:
    """A user trial: restore() left RoPE's inv_freq (a float buffer) rounded to bf16 for good. Its fp32
    value is kept (buffers are few); a frozen parameter's is not (a review: keeping every untrained
    parameter's fp32 original made an inference or frozen-backbone model larger than in fp32)."""
    torch.manual_seed(0)
    model = _net()
    model.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8), persistent=False)
    frozen = model[0].bias
    frozen.requires_grad_(False)
    before = {"bias": frozen.detach().clone(), "inv_freq": model.inv_freq.clone()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with pytest.warns(UserWarning, match=r"rounded the computed buffer\(s\) inv_freq") as said:
        model, opt = mixprec.initialize(model, opt, level, dtype=torch.bfloat16, verbosity=0)
    assert said[0].filename == __file__  # silent before (apex's model.half() is)
    assert model.inv_freq.dtype is torch.bfloat16 and not torch.equal(model.inv_freq.float(),
                                                                       before["inv_freq"])
    kept = [c for h in mixprec.amp._STATE.models for c in h.converted if c.before is not None]
    assert "inv_freq" in [c.name for c in kept] and not any(c.is_param for c in kept)  # O3: BatchNorm's too
    x, y = next(_batches(1))
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    mixprec.amp.restore(model)
    assert torch.equal(model.inv_freq, before["inv_freq"])
    assert torch.equal(model[0].bias, before["bias"].bfloat16().float())  # no master: its rounding


def test_a_meta_device_model_initializes() -> None:
    """Built on the meta device, materialised after initialize (to_empty): keeping a buffer's original or
    comparing its rounding read values a meta tensor does not hold (a review)."""
    with torch.device("meta"):
        model = _net()
        model.register_buffer("inv_freq", torch.ones(4), persistent=False)
    model[0].weight.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model, opt = mixprec.initialize(model, opt, "O2", dtype=torch.bfloat16, verbosity=0)
    model.to_empty(device="cpu")
    assert model[0].weight.dtype is torch.bfloat16 and model.inv_freq.device.type == "cpu"


class _SparseTower(nn.Module):
    """A DLRM's shape at its smallest: a sparse-gradient EmbeddingBag (summed bags) under a dense layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.EmbeddingBag(10, 4, mode="sum", sparse=True)
        self.top = nn.Linear(4, 1)
        with torch.no_grad():  # weights of few bits: the table's gradient (the top's weight) is exact in half
            self.top.weight.copy_(torch.tensor([[0.5, -0.25, 0.125, 1.0]]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.top(self.table(ids))


@pytest.mark.parametrize(("level", "dtype"), [("O2", torch.float16), ("O2", torch.bfloat16),
                                              ("O3", torch.bfloat16)])
def test_a_sparse_embedding_trains_fp32_beside_the_half_model(level: str, dtype: torch.dtype) -> None:
    """DLRM's optimizers: SparseAdam for the tables, Adam for the rest. O2 cast the table to half and gave it
    a dense fp32 master, and the first scale_loss raised on its sparse gradient. The table stays fp32 (its
    own master): its SparseAdam update equals an fp32 run's, bit for bit (its gradient, the top's weight, is
    exact in half), so the loss scale came off it."""
    ids = torch.tensor([[1, 2, 3], [3, 4, 4]])
    reference = _SparseTower()
    sparse, dense = torch.optim.SparseAdam(reference.table.parameters()), torch.optim.SGD(
        reference.top.parameters(), lr=0.0)
    reference(ids).mean().backward()
    sparse.step()
    model = _SparseTower()
    opts = [torch.optim.SparseAdam(model.table.parameters()), torch.optim.SGD(model.top.parameters(), lr=0.0)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "MasterWeights: none of the optimizer's parameters is half"
        # a scale the dense gradients stay finite under in fp16 (sums of 6 rows times the scale)
        model, opts = mixprec.initialize(model, opts, opt_level=level, dtype=dtype, loss_scale=128.0,
                                         verbosity=0)
    assert model.table.weight.dtype == torch.float32 and model.top.weight.dtype == dtype
    with mixprec.scale_loss(model(ids).mean(), opts) as scaled:
        scaled.backward()
    for opt in opts:
        opt.step()
    assert torch.equal(model.table.weight, reference.table.weight)
    assert not torch.equal(model.table.weight, _SparseTower().table.weight)  # it moved
    del dense


class _WeightedTower(_SparseTower):
    """Weighted bags (TorchRec's per_sample_weights): weights given, and weights a layer computes."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(1, 1)
        with torch.no_grad():  # scores of few bits: exact in half
            self.score.weight.fill_(0.5)
            self.score.bias.fill_(0.25)

    def forward(self, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        computed = self.score(weights.unsqueeze(-1)).squeeze(-1)
        offsets = torch.tensor([0, 3])
        return self.top(self.table(ids, offsets, per_sample_weights=weights)
                        + self.table(ids, offsets, per_sample_weights=computed))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weighted_sparse_bags_train_and_their_optimizer_resumes(dtype: torch.dtype) -> None:
    """A recommender trial under O2: the fp32 sparse table met half per_sample_weights (the input cast, a
    half layer's output) and torch raised "Expected tensor for argument #1 'weight' to have the same type";
    and its SparseAdam, wrapped with no masters (every parameter fp32), could not load its state ("Tensor
    list must have at least one tensor"). The table's update equals an fp32 run's, bit for bit, and the
    reloaded optimizer's next step equals the uninterrupted one's."""
    ids, weights = torch.tensor([1, 2, 3, 3, 4, 4]), torch.tensor([0.5, 1.0, 2.0, 0.25, 1.0, 0.5])
    reference = _WeightedTower()
    ref_opt = torch.optim.SparseAdam(reference.table.parameters())
    reference(ids, weights).mean().backward()
    ref_opt.step()
    model = _WeightedTower()
    opts = [torch.optim.SparseAdam(model.table.parameters()),
            torch.optim.SGD([*model.top.parameters(), *model.score.parameters()], lr=0.0)]
    model, opts = mixprec.initialize(model, opts, "O2", dtype=dtype, loss_scale=128.0, verbosity=0)
    with mixprec.scale_loss(model(ids, weights).mean(), opts) as scaled:
        scaled.backward()
    for opt in opts:
        opt.step()
    assert torch.equal(model.table.weight, reference.table.weight)
    saved, before = copy.deepcopy(opts[0].state_dict()), model.table.weight.detach().clone()

    def second_step() -> torch.Tensor:
        for opt in opts:
            opt.zero_grad()
        with mixprec.scale_loss(model(ids, weights).mean(), opts) as scaled:
            scaled.backward()
        opts[0].step()
        return model.table.weight.detach().clone()

    uninterrupted = second_step()
    with torch.no_grad():
        model.table.weight.copy_(before)
    opts[0].load_state_dict(saved)  # as load_checkpoint does
    assert torch.equal(second_step(), uninterrupted)


@pytest.mark.parametrize("orthogonal_map", ["matrix_exp", "cayley", "householder"])
def test_an_orthogonal_parametrization_trains_under_o2(orthogonal_map: str) -> None:
    """torch.nn.utils.parametrizations.orthogonal in an O2 model (a trial): the cayley map raised "lu_cpu not
    implemented for 'Half'", householder "orgqr_cpu ...", and the default matrix_exp returned NaN in half
    once its parameter moved off zero (every step after the first skipped). Its weight is computed in fp32
    now: the losses an fp32 model's, the weight orthogonal."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    nn.utils.parametrizations.orthogonal(net[0], orthogonal_map=orthogonal_map)
    reference = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt = mixprec.initialize(net, opt, "O2", dtype=torch.bfloat16, verbosity=0)
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(x), y)
        with mixprec.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = nn.functional.cross_entropy(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=2e-2)
    assert mixprec.amp.loss_scaler().skipped_steps == 0
    weight = model[0].weight.float()
    torch.testing.assert_close(weight @ weight.T, torch.eye(8), atol=2e-2, rtol=0)  # bf16 rounds it


def test_gradients_no_optimizer_of_initialize_holds_are_named_once() -> None:
    """A DLRM trial passed initialize its dense optimizer only and stepped the tables' SGD itself: the tables
    stepped on gradients 65536 times too large and went NaN, and the warning that followed blamed the
    forward. The first scale_loss names the parameters no optimizer of initialize holds."""
    model = _net()
    opt = torch.optim.SGD(model[3].parameters(), lr=0.1)
    model, opt = mixprec.initialize(model, opt, "O2", verbosity=0)
    x, y = next(_batches(1))
    named = r"4 model parameter\(s\) .*\(0.weight, 0.bias, 1.weight and 1 more\)"
    with pytest.warns(UserWarning, match=named):
        with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
            scaled.backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
            scaled.backward()


@pytest.mark.parametrize("case", ["every parameter held", "bf16: the scale is 1"])
def test_no_warning_where_every_gradient_is_unscaled(case: str) -> None:
    model = _net()
    held = model.parameters() if case == "every parameter held" else model[3].parameters()
    dtype = torch.float16 if case == "every parameter held" else torch.bfloat16
    model, opt = mixprec.initialize(model, torch.optim.SGD(held, lr=0.1), "O2", dtype=dtype, verbosity=0)
    x, y = next(_batches(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
            scaled.backward()


class _HandRMSNorm(nn.Module):
    """mamba-minimal's RMSNorm, written with elementwise ops: no fp32 cast of its own."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.seen: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x.dtype
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


def _quiet_net() -> nn.Module:
    """Small activations before the norm: mean(x**2) ~ 1e-6, so rsqrt ~ 300 and its backward's
    0.5 * rsqrt**3 ~ 1.3e7, past fp16's 65504 even at a loss scale of 1."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), _HandRMSNorm(16), nn.Linear(16, 4))
    with torch.no_grad():
        net[0].weight.mul_(1e-3)
        net[0].bias.zero_()
    return net


@pytest.mark.parametrize("kept", [False, True])
def test_keep_fp32_keeps_a_module_fp32_in_an_o2_model(kept: bool) -> None:
    """keep_fp32 said "under any autocast", and a half model is none: marked before O2, the module ran in
    fp16 anyway and a hand-written RMSNorm's backward overflowed at every step, at any loss scale (a
    Mamba trial skipped 300 of 300 steps). Now its tensors stay fp32, it computes in fp32 between casts,
    and the gradients are the fp32 model's within fp16's rounding. The reference: the fp32 model."""
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    ref = _quiet_net()
    nn.functional.cross_entropy(ref(x), y).backward()
    net = _quiet_net()
    if kept:
        mixprec.keep_fp32(net[1])
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model, opt = amp.initialize(net, opt, opt_level="O2", loss_scale=1.0, verbosity=0)
    out = model(x)
    with amp.scale_loss(nn.functional.cross_entropy(out, y), opt) as scaled:
        scaled.backward()
    grad = model[0].weight.grad
    if not kept:
        assert model[1].seen is torch.float16 and not torch.isfinite(grad).all()  # what was fixed
        return
    assert model[1].seen is torch.float32 and model[1].weight.dtype is torch.float32
    assert model[0].weight.dtype is torch.float16 and model[2].weight.dtype is torch.float16
    assert out.dtype is torch.float32  # O2's outputs, as before
    # fp16 rounds the first layer's small outputs (relative 2**-11) before the norm divides by their rms
    error = (grad.float() - ref[0].weight.grad).norm() / ref[0].weight.grad.norm()
    assert error < 5e-3, error  # 5e-4 measured
    masters = {id(p) for p in opt.model_params()}
    assert id(model[1].weight) not in masters  # fp32: stepped as it is, as BatchNorm's under O2
    before = model[1].weight.detach().clone()
    opt.step()
    assert not torch.equal(model[1].weight, before)


def test_keep_fp32_after_the_cast_is_refused_naming_the_order() -> None:
    """Marked after initialize had cast it, the module stayed half and ran half, silently (a trial tried
    both orders). Its fp32 values are gone by then: refused, saying to mark it first."""
    net = _quiet_net()
    model, _ = amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    with pytest.raises(mixprec.errors.AutocastError, match="before mixprec casts the model") as info:
        mixprec.keep_fp32(model[1])
    assert "before initialize or fit" in str(info.value)


class _ParameterlessNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x.dtype
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


def test_keep_fp32_on_a_parameterless_module_works_before_the_cast_and_is_warned_of_after() -> None:
    """A re-trial: a parameterless norm marked after initialize was accepted and ran in half, silently (the
    refusal reads parameters). Marked before, it runs in fp32; after, its first half forward warns."""
    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), _ParameterlessNorm(), nn.Linear(8, 4))

    before = net()
    mixprec.keep_fp32(before[1])
    model, _ = amp.initialize(before, torch.optim.SGD(before.parameters(), lr=0.1), opt_level="O2",
                              verbosity=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(4, 8))
    assert model[1].seen is torch.float32
    amp.reset()
    after = net()
    model, _ = amp.initialize(after, torch.optim.SGD(after.parameters(), lr=0.1), opt_level="O2",
                              verbosity=0)
    mixprec.keep_fp32(model[1])
    with pytest.warns(UserWarning, match="keep_fp32: this _ParameterlessNorm gets torch.float16 inputs"):
        model(torch.randn(4, 8))
    assert model[1].seen is torch.float16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(4, 8))  # once per module


def test_after_restore_a_kept_module_run_by_hand_in_half_is_warned_of_again() -> None:
    """prepare marks the keep_fp32 modules it keeps fp32 (no warning there); restore takes the mark off, so
    the same model cast by hand and run under half_compute, where the module runs in half, says so."""
    net = nn.Sequential(nn.Linear(8, 8), _ParameterlessNorm(), nn.Linear(8, 4))
    mixprec.keep_fp32(net[1])
    model, _ = amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    amp.restore(model)
    model.half()
    with pytest.warns(UserWarning, match="keep_fp32: this _ParameterlessNorm gets torch.float16"):
        with mixprec.half_compute("cpu", torch.float16):
            model(torch.randn(4, 8).half())


class _Encoded(nn.Module):
    """A Fourier encoding of coordinates (NeRF's): frequencies up to 2**9 * pi, then a half MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = mixprec.keep_fp32(_Fourier())
        self.mlp = nn.Sequential(nn.Linear(2 + 2 * 2 * 10, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, coords: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.encode(coords))


class _Fourier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freqs", 2.0 ** torch.arange(10) * torch.pi)
        self.seen: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x
        angles = (x[..., None] * self.freqs).flatten(1)
        return torch.cat([x, angles.sin(), angles.cos()], -1)


@pytest.mark.parametrize("arithmetic", ["emulated", "native"])
def test_cast_model_inputs_false_gives_a_kept_module_the_inputs_as_given(
    arithmetic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A half model rounds its inputs at its boundary (apex O2's rule), before a keep_fp32 encoding can keep
    them: an INR trial's Fourier features were off by up to 1.98 and its model scored 19.6 dB where fp32
    reached 38.5. With cast_model_inputs=False the encoding computes from the exact coordinates, as fp32
    does, and the half GEMMs after it run on both kinds of device."""
    monkeypatch.setenv("MIXPREC_HALF_ARITHMETIC", f"cpu:{arithmetic}")
    coords = torch.rand(32, 2, generator=torch.Generator().manual_seed(0)) * 2 - 1
    torch.manual_seed(0)
    reference = _Encoded()
    features = reference.encode(coords)
    for cast in (True, False):
        model = copy.deepcopy(reference)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = mixprec.initialize(model, opt, "O2", dtype=torch.bfloat16, cast_model_inputs=cast,
                                        verbosity=0)
        out = model(coords)
        seen = model.encode.seen
        assert seen is not None and torch.equal(seen, coords) is not cast  # rounded only when cast
        if not cast:  # fp32's encoding, rounded once as it leaves the kept module for the half MLP
            assert torch.equal(model.encode(coords), features.to(torch.bfloat16))
        with mixprec.scale_loss(out.square().mean(), opt) as loss:
            loss.backward()
        opt.step()
        mixprec.amp.reset()


def test_cast_model_inputs_false_is_refused_where_no_model_is_cast() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="cast_inputs=False keeps a half model's inputs as given"):
        mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1", cast_model_inputs=False,
                           verbosity=0)
