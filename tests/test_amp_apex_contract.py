"""mixprec.amp against apex.amp's own code, for what a user trial found different (apex cannot be installed
here: its amp was removed in 2025). The reference below restates apex's LossScaler rules from its source
(apex/amp/scaler.py: ``__init__`` and ``update_scale``; apex/amp/frontend.py: ``initialize``,
``state_dict``) and every test compares mixprec with it or with apex's documented signature."""

from __future__ import annotations

import collections
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from mixprec import amp
from mixprec.errors import BannedOpError, ConfigError

pytestmark = pytest.mark.usefixtures("fresh_amp_state")


@dataclass
class ApexLossScaler:
    """apex's LossScaler, rule for rule: the start is capped by the ceiling; an overflow halves the scale
    (no floor unless min_loss_scale) and zeroes ``unskipped``; every clean iteration counts, at a static
    scale too; after ``scale_window`` clean ones a dynamic scale doubles, up to the ceiling."""

    dynamic: bool = True
    scale: float = 2.0**16
    min_loss_scale: float | None = None
    max_loss_scale: float = 2.0**24
    scale_window: int = 2000
    unskipped: int = 0

    def __post_init__(self) -> None:
        if self.dynamic:
            self.scale = min(self.max_loss_scale, self.scale)

    def update(self, overflow: bool) -> None:
        if overflow and self.dynamic:
            halved = self.scale / 2
            self.scale = max(self.min_loss_scale, halved) if self.min_loss_scale else halved
            self.unskipped = 0
        else:
            self.unskipped += 1
        if self.unskipped == self.scale_window and self.dynamic:
            self.scale = min(self.max_loss_scale, self.scale * 2)
            self.unskipped = 0


def _model_and_opt(**initialize: object) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return amp.initialize(model, opt, verbosity=0, **initialize)


def _iteration(model: nn.Module, opt: torch.optim.Optimizer, overflow: bool) -> None:
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
        if overflow:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
    opt.step()
    opt.zero_grad()


MIXED = [True, False, False, True, True, False, False, False]  # overflowing iterations


@pytest.mark.parametrize(
    ("initialize", "reference", "overflows"),
    [
        ({"opt_level": "O1"}, ApexLossScaler(), MIXED),
        ({"opt_level": "O1", "max_loss_scale": 2.0**10}, ApexLossScaler(max_loss_scale=2.0**10), MIXED),
        ({"opt_level": "O2", "min_loss_scale": 2.0**14}, ApexLossScaler(min_loss_scale=2.0**14), MIXED),
        # apex neither checks nor skips at a static scale (mixprec does, on purpose: the apex doc's
        # differences), so only clean iterations compare there
        ({"opt_level": "O1", "loss_scale": 128.0}, ApexLossScaler(dynamic=False, scale=128.0), [False] * 5),
    ],
    ids=["dynamic", "max_loss_scale caps the start", "min_loss_scale", "static"],
)
def test_loss_scale_and_unskipped_follow_apexs_scaler(
    initialize: dict, reference: ApexLossScaler, overflows: list[bool]
) -> None:
    """It started at 2**16 under a lower max_loss_scale (apex starts at the ceiling), and ``unskipped``
    stayed 0 at a static scale (apex counts the clean iterations there too)."""
    model, opt = _model_and_opt(**initialize)
    seen, expected = [], []
    for overflow in overflows:
        expected.append((reference.scale, reference.unskipped))
        seen.append(tuple(amp.state_dict()["loss_scaler0"][k] for k in ("loss_scale", "unskipped")))
        _iteration(model, opt, overflow)
        reference.update(overflow)
    assert seen == expected


def test_a_static_scale_counts_clean_iterations_since_its_last_skip() -> None:
    """mixprec skips an overflowing step at a static scale too, so ``unskipped`` restarts there."""
    model, opt = _model_and_opt(opt_level="O1", loss_scale=128.0)
    counts = []
    for overflow in (False, False, True, False):
        _iteration(model, opt, overflow)
        counts.append(amp.state_dict()["loss_scaler0"]["unskipped"])
    assert counts == [1, 2, 0, 1] and amp.loss_scaler().get_scale() == 128.0


def test_state_dict_takes_apexs_destination() -> None:
    """apex: ``state_dict(destination=None)`` fills ``destination`` (an OrderedDict by default)."""
    _model_and_opt(opt_level="O1")
    destination = {"epoch": 3}
    assert amp.state_dict(destination) is destination
    assert destination["epoch"] == 3 and destination["loss_scaler0"]["loss_scale"] == 2.0**16
    assert isinstance(amp.state_dict(), collections.OrderedDict)


def test_an_apex_checkpoint_below_the_scale_floor_names_min_loss_scale() -> None:
    """apex has no floor (a scale of 0.5 is possible there); mixprec's default floor is 1 (on purpose,
    docs/migrating-from-apex.md). Loading such a checkpoint says how to resume at its scale, and does."""
    _model_and_opt(opt_level="O1")
    apex_checkpoint = {"loss_scaler0": {"loss_scale": 0.5, "unskipped": 3}}
    with pytest.raises(ConfigError, match=r"min_loss_scale=0\.5"):
        amp.load_state_dict(apex_checkpoint)
    amp.reset()
    _model_and_opt(opt_level="O1", min_loss_scale=0.25)
    amp.load_state_dict(apex_checkpoint)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 0.5


def test_apexs_positional_order_is_read_as_apexs() -> None:
    """apex: ``initialize(models, optimizers=None, enabled=True, opt_level="O1", ...)``. A bool third is
    apex's ``enabled``; mixprec's own third positional, a str, is ``opt_level``."""
    model, _ = _model_and_opt()  # O1 by default: the model stays fp32
    assert next(model.parameters()).dtype == torch.float32
    amp.reset()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), True, "O2", verbosity=0)
    assert model.weight.dtype == torch.float16
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert amp.initialize(model, opt, False, "O2") == (model, opt)  # disabled: untouched, as apex
    assert model.weight.dtype == torch.float32
    with pytest.raises(TypeError, match="multiple values for argument 'opt_level'"):
        amp.initialize(model, opt, True, "O2", opt_level="O1")
    with pytest.raises(TypeError, match="verbosity both by position"):
        amp.initialize(model, opt, True, "O2", None, None, None, None, None, None, 1, 0, verbosity=2)
    with pytest.raises(TypeError, match="in apex's order the third is enabled"):
        amp.initialize(model, opt, "O2", True)
    apex_order = ["enabled", "opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
                  "master_weights", "loss_scale", "cast_model_outputs", "num_losses", "verbosity",
                  "min_loss_scale", "max_loss_scale"]  # apex/amp/frontend.py's signature
    assert list(amp.APEX_POSITIONAL) == apex_order
    assert set(apex_order) <= set(inspect.signature(amp.initialize).parameters)


def test_what_apex_refused_with_runtime_error_is_a_runtime_error() -> None:
    """apex raised RuntimeError for an unknown opt level and for a model cast with .half() first."""
    model = nn.Linear(4, 2)
    with pytest.raises(RuntimeError, match="letter O, not zero"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="01")
    model = nn.Linear(4, 2).half()
    with pytest.raises(RuntimeError, match="you do not need to call .half"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2")


class _Calls(nn.Module):
    """A model whose forward calls ``fn(x_fp32, h_half)`` (h: a linear's output, half under O1)."""

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn, self.lin = fn, nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.lin(x))


def _dtypes_seen_under_o1(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[torch.dtype]:
    seen: list[torch.dtype] = []

    def recording(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        seen.extend((x.dtype, h.dtype))
        return x + h.float()

    model = _Calls(fn(recording) if fn is not None else recording)
    # bf16: the suite's reference arithmetic runs it natively (fp16 is emulated there, and an emulated half
    # function receives fp32 tensors holding half values)
    model, _ = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1",
                              dtype=torch.bfloat16, verbosity=0)
    model(torch.randn(2, 4))
    amp.reset()
    return seen


@pytest.mark.parametrize(
    ("decorator", "expected"),
    [
        (None, [torch.float32, torch.bfloat16]),  # as called: the input fp32, the linear's output half
        ("half_function", [torch.bfloat16, torch.bfloat16]),
        ("float_function", [torch.float32, torch.float32]),
        ("promote_function", [torch.float32, torch.float32]),  # the widest floating input
    ],
)
def test_apexs_function_decorators_are_in_mixprec_amp(
    decorator: str | None, expected: list[torch.dtype], clean_registry: None
) -> None:
    """apex/amp/__init__.py exports half_function, float_function and promote_function (decorators of
    your own functions); mixprec.amp had none of them."""
    assert _dtypes_seen_under_o1(None if decorator is None else getattr(amp, decorator)) == expected


def test_apexs_register_functions_are_in_mixprec_amp(clean_registry: None) -> None:
    """apex's ``amp.register_float_function(torch, "sigmoid")`` (apex/amp/__init__.py exports the three
    register_* functions; mixprec had them only at the top level)."""
    def sigmoid_of_half(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        out = torch.sigmoid(h)
        seen.append(out.dtype)
        return out

    seen: list[torch.dtype] = []
    for register in (None, amp.register_float_function):
        if register is not None:
            register(torch, "sigmoid")
        model = _Calls(sigmoid_of_half)
        model, _ = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1",
                                  dtype=torch.bfloat16, verbosity=0)
        model(torch.randn(2, 4))
        amp.reset()
    assert seen == [torch.bfloat16, torch.float32]
    assert all(callable(getattr(amp, f"register_{kind}_function")) for kind in ("half", "float", "promote"))


def test_delay_overflow_check_is_taken_and_the_check_kept() -> None:
    """apex's scale_loss takes ``delay_overflow_check``; with True apex skipped the inf check. mixprec
    keeps it, says so once, and still skips the overflowing step."""
    model, opt = _model_and_opt(opt_level="O1")
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    with pytest.warns(UserWarning, match="mixprec keeps both") as caught:
        with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt, delay_overflow_check=True) as s:
            s.backward()
            next(model.parameters()).grad.view(-1)[0] = float("inf")
    assert caught[0].filename == __file__  # the user's with-line
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**15


def _dcgan(opt_level: str | None, iterations: int = 3) -> list[torch.Tensor]:
    """apex's examples/dcgan loop, small: three scale_loss blocks per iteration (loss_ids 0, 1, 2), both
    models with BatchNorm; the generator's loss goes back through a forward made before optD's step.
    ``opt_level`` None: the same loop in plain fp32, no amp."""
    torch.manual_seed(0)
    net_g = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 6), nn.Tanh())
    net_d = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-4, betas=(0.5, 0.999))
    if opt_level is not None:
        [net_d, net_g], [opt_d, opt_g] = amp.initialize([net_d, net_g], [opt_d, opt_g], opt_level=opt_level,
                                                        num_losses=3, verbosity=0)

    def backward(loss: torch.Tensor, opt: torch.optim.Optimizer, loss_id: int) -> None:
        if opt_level is None:
            loss.backward()
            return
        with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
            scaled.backward()

    criterion = nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(1)
    for _ in range(iterations):
        real, noise = torch.randn(16, 6, generator=g), torch.randn(16, 4, generator=g)
        ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
        net_d.zero_grad()
        backward(criterion(net_d(real), ones), opt_d, 0)
        fake = net_g(noise)
        backward(criterion(net_d(fake.detach()), zeros), opt_d, 1)
        opt_d.step()
        net_g.zero_grad()
        backward(criterion(net_d(fake), ones), opt_g, 2)
        opt_g.step()
    if opt_level is not None:
        amp.reset()
    return [t.detach().float().clone() for m in (net_d, net_g) for t in (*m.parameters(), *m.buffers())]


def test_apexs_dcgan_example_runs_and_o0_matches_fp32_bit_for_bit() -> None:
    """It failed at every opt level in the generator's backward ("modified by an inplace operation"): each
    loss's scaler update rewrote the BatchNorm buffers the pending graph had saved."""
    fp32 = _dcgan(None)
    for level, tolerance in (("O0", 0.0), ("O1", 2e-3), ("O2", 2e-3)):
        for a, b in zip(_dcgan(level), fp32, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=tolerance, msg=level)


def _bce_of_a_sigmoid_discriminator(opt_level: str, dtype: torch.dtype, logits: bool = False) -> float:
    """The older DCGAN form: a Sigmoid ends the discriminator and nn.BCELoss takes its output (apex's
    example switched to BCEWithLogitsLoss; pytorch/examples and many GAN repositories kept this one)."""
    torch.manual_seed(0)
    layers = [nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1)]
    net_d = nn.Sequential(*layers) if logits else nn.Sequential(*layers, nn.Sigmoid())
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-4)
    net_d, opt_d = amp.initialize(net_d, opt_d, opt_level=opt_level, dtype=dtype, verbosity=0)
    criterion = nn.BCEWithLogitsLoss() if logits else nn.BCELoss()
    loss = criterion(net_d(torch.randn(8, 6)).view(-1), torch.ones(8))
    with amp.scale_loss(loss, opt_d) as scaled:
        scaled.backward()
    opt_d.step()
    return float(loss)


@pytest.mark.usefixtures("fresh_amp_state", "clean_registry")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_o1_refuses_bce_of_half_probabilities_as_apex_did(dtype: torch.dtype) -> None:
    """apex's O1 raised for F.binary_cross_entropy of a half input (its BANNED_FUNCS: the sigmoid before it
    saturates, 1.0 above x ~ 8.3 in fp16). mixprec's O1 computes the loss outside the region from the
    output cast to fp32, so nothing refused it: a confident discriminator's loss went inf, every step
    skipped, the scale at its floor (a DCGAN trial). Its fixes work, and O2, which apex never checked
    (its output is fp32 already), is left alone."""
    with pytest.raises(BannedOpError, match="BCEWithLogitsLoss"):
        _bce_of_a_sigmoid_discriminator("O1", dtype)
    amp.reset()
    assert math.isfinite(_bce_of_a_sigmoid_discriminator("O1", dtype, logits=True))
    amp.reset()
    assert math.isfinite(_bce_of_a_sigmoid_discriminator("O2", dtype))
    amp.reset()
    amp.register_float_function(torch, "sigmoid")  # apex's advice in the same error
    assert math.isfinite(_bce_of_a_sigmoid_discriminator("O1", dtype))


def _dcgan_iteration(inject_into_generator_loss: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One iteration of the DCGAN loop at a static scale; optionally an overflow in the generator's loss
    (loss_id 2) only. Returns (discriminator buffers, generator buffers) after it."""
    torch.manual_seed(0)
    net_g = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 6))
    net_d = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    opt_d, opt_g = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (net_d, net_g))
    [net_d, net_g], [opt_d, opt_g] = amp.initialize([net_d, net_g], [opt_d, opt_g], opt_level="O1",
                                                    loss_scale=128.0, num_losses=3, verbosity=0)
    criterion = nn.BCEWithLogitsLoss()
    real, noise, ones, zeros = torch.randn(16, 6), torch.randn(16, 4), torch.ones(16, 1), torch.zeros(16, 1)
    with amp.scale_loss(criterion(net_d(real), ones), opt_d, loss_id=0) as scaled:
        scaled.backward()
    fake = net_g(noise)
    with amp.scale_loss(criterion(net_d(fake.detach()), zeros), opt_d, loss_id=1) as scaled:
        scaled.backward()
    opt_d.step()
    with amp.scale_loss(criterion(net_d(fake), ones), opt_g, loss_id=2) as scaled:
        scaled.backward()
        if inject_into_generator_loss:
            next(net_g.parameters()).grad.view(-1)[0] = float("inf")
    opt_g.step()
    amp.reset()
    return [b.clone() for b in net_d.buffers()], [b.clone() for b in net_g.buffers()]


def test_a_skipped_step_puts_back_the_buffers_of_the_models_its_optimizer_trains_only() -> None:
    """Every loss's scaler watched every model: the generator loss's overflow put the discriminator's
    BatchNorm statistics back to before its real-batch forward, though its step was taken."""
    clean_d, clean_g = _dcgan_iteration(inject_into_generator_loss=False)
    skipped_d, skipped_g = _dcgan_iteration(inject_into_generator_loss=True)
    for a, b in zip(skipped_d, clean_d, strict=True):  # optD stepped: its model's statistics stand
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.manual_seed(0)
    fresh_g = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 6))
    for a, b in zip(skipped_g, fresh_g.buffers(), strict=True):  # optG skipped: as before its forward
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not all(torch.equal(a, b) for a, b in zip(clean_g, fresh_g.buffers(), strict=True))


@pytest.mark.parametrize("apex_order", [False, True])
def test_initializes_warnings_name_the_callers_line(apex_order: bool) -> None:
    """A wrapper taking apex's positional order stood between the user and initialize: its warnings
    named mixprec/amp.py instead of the caller's line."""

    def fresh(**kwargs: object) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if apex_order:
            return amp.initialize(model, opt, True, kwargs.pop("opt_level"), verbosity=0, **kwargs)
        return amp.initialize(model, opt, verbosity=0, **kwargs)

    fresh(opt_level="O1")
    with pytest.warns(UserWarning, match="called again") as again:
        fresh(opt_level="O1")
    amp.reset()
    with pytest.warns(UserWarning, match="does nothing") as useless:
        fresh(opt_level="O0", master_weights=True)  # fp32 weights are the masters already
    assert [w.filename for w in (*again, *useless)] == [__file__] * 2
