"""Learner.to_fp16's arguments: fastai v1's positional order, out-of-range values refused at the call in the
user's words, and a run whose every batch overflows stopped (skip_limit) or floored (min_scale)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import mixprec
from mixprec.callbacks import Callback, CancelTrainException, MixedPrecision
from mixprec.data import DataBunch
from mixprec.errors import ConfigError, PersistentOverflowError
from mixprec.learner import Learner

pytestmark = pytest.mark.usefixtures("one_thread")

# fastai v1's final signature (fastai/train.py, 1.0.6x): to_fp16(learn, loss_scale=None, max_noskip=1000,
# dynamic=True, clip=None, flat_master=False, max_scale=2**24, loss_fp32=True).
FASTAI_V1_ORDER = ["loss_scale", "max_noskip", "dynamic", "clip", "flat_master", "max_scale", "loss_fp32"]
FASTAI_V1_DEFAULTS = {"loss_scale": None, "max_noskip": 1000, "dynamic": True, "clip": None,
                      "flat_master": False, "max_scale": 2**24, "loss_fp32": True}  # fmt: skip


def _learner() -> Learner:
    data = mixprec.digits(batch_size=64, seed=0)
    torch.manual_seed(0)
    return Learner(data, mixprec.build_model("mlp", data, n_hidden=16), silent=True)


def test_positional_order_and_defaults_are_fastai_v1s() -> None:
    params = list(inspect.signature(Learner.to_fp16).parameters.values())[1:]
    positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == FASTAI_V1_ORDER
    assert {p.name: p.default for p in params if p.name in FASTAI_V1_DEFAULTS} == FASTAI_V1_DEFAULTS
    extras = [p for p in params if p.name not in FASTAI_V1_ORDER]
    # mixprec's extras keyword-only; **unknown only to refuse v2's names with their v1 equivalents
    assert extras and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extras[:-1])
    assert extras[-1].kind is inspect.Parameter.VAR_KEYWORD


def test_two_positional_arguments_are_loss_scale_and_max_noskip() -> None:
    learn = _learner().to_fp16(1024.0, 500)
    mp = learn.mp_cb
    assert isinstance(mp, MixedPrecision)
    assert (mp.loss_scale, mp.max_noskip, mp.flat_master) == (1024.0, 500, False)
    learn.fit(1, callbacks=[_StopAfter(1)])
    assert learn.scaler is not None
    assert (learn.recorder.loss_scales[0], learn.scaler.get_growth_interval()) == (1024.0, 500)


@pytest.mark.parametrize(("dynamic", "start"), [(True, 2.0**16), (False, 512.0)])
def test_loss_scale_none_follows_fastais_rule(dynamic: bool, start: float) -> None:
    """fastai v1 (fastai/callbacks/fp16.py): ``self.loss_scale = ifnone(loss_scale, 2**16 if dynamic else
    512)``. mixprec read None as "no loss scaling": fp16 trained unscaled, with no inf/NaN check."""
    learn = _learner().to_fp16(None, dynamic=dynamic)
    learn.fit(1, callbacks=[_StopAfter(1)])
    assert learn.scaler is not None and learn.recorder.loss_scales[0] == start
    assert learn.mp_cb.recipe.scale.dynamic is dynamic  # type: ignore[union-attr]


def test_apexs_loss_scale_dynamic_is_refused_naming_the_argument_that_says_it() -> None:
    """A user trial: the hint said "None: no scaling", left from when None meant that (it is fastai's rule
    for a start now: the test above)."""
    with pytest.raises(ConfigError, match="loss_scale must be a positive") as refused:
        _learner().to_fp16(loss_scale="dynamic")
    assert "dynamic=True" in str(refused.value) and "no scaling" not in str(refused.value)


def test_loss_scale_none_starts_no_higher_than_max_scale() -> None:
    learn = _learner().to_fp16(None, max_scale=1024.0)
    assert learn.mp_cb.recipe.scale.init_scale == 1024.0  # type: ignore[union-attr]


@pytest.mark.parametrize("clip", [-1.0, 0.0, math.nan, math.inf])
def test_a_clip_that_would_invert_or_zero_training_is_refused(clip: float) -> None:
    with pytest.raises(ConfigError, match=r"clip must be a positive, finite gradient norm"):
        _learner().to_fp16(clip=clip)


@pytest.mark.parametrize(
    ("argument", "value"),
    [("loss_scale", 0), ("loss_scale", -512.0), ("loss_scale", math.inf), ("max_noskip", 0),
     ("max_noskip", 2.5), ("max_scale", -1.0), ("min_scale", 0.0), ("skip_limit", 0)],
)  # fmt: skip
def test_errors_name_the_argument_the_user_passed(argument: str, value: float) -> None:
    with pytest.raises(ConfigError) as info:
        _learner().to_fp16(**{argument: value})
    message = str(info.value)
    assert message.startswith(f"{argument} must be")
    # GradScaler's names for the same settings are not the user's
    assert "init_scale" not in message and "growth_interval" not in message


def test_min_scale_above_max_scale_is_refused() -> None:
    with pytest.raises(ConfigError, match="min_scale=1024.0 is larger than max_scale=512.0"):
        _learner().to_fp16(min_scale=1024.0, max_scale=512.0)


class _NaNInputs(Callback):
    """Every training batch is NaN (a corrupt shard): every step's gradients are non-finite."""

    order = -50  # before MixedPrecision casts the batch

    def on_batch_begin(self) -> None:
        if self.training:
            self.learn.xb = torch.full_like(self.xb, math.nan)


class _StopAfter(Callback):
    def __init__(self, steps: int) -> None:
        self.steps, self.seen = steps, 0

    def on_step_end(self) -> None:
        self.seen += 1

    def on_batch_end(self) -> None:
        if self.training and self.seen >= self.steps:
            raise CancelTrainException()


def test_nan_in_every_batch_stops_with_persistent_overflow_error() -> None:
    learn = _learner().to_fp16(skip_limit=5)
    before = [p.detach().clone() for p in learn.model.parameters()]
    counter = _StopAfter(10**6)
    with pytest.raises(PersistentOverflowError):
        learn.fit(3, callbacks=[_NaNInputs(), counter])
    # GradScaler's rule: it raises at the update after skip_limit consecutive skipped steps
    assert counter.seen == 5
    # no step was taken, and the model is fp32 again, as it was
    assert all(torch.equal(a, b) for a, b in zip(before, learn.model.parameters(), strict=True))


def test_min_scale_floors_the_dynamic_scale_under_persistent_overflow() -> None:
    learn = _learner().to_fp16(loss_scale=512.0, min_scale=64.0)
    learn.fit(1, callbacks=[_NaNInputs(), _StopAfter(7)])
    # every step overflows: halve after each, never below the floor
    expected = [max(512.0 * 0.5**k, 64.0) for k in range(7)]
    assert learn.recorder.loss_scales == expected
    assert all(learn.recorder.skipped)


# ---- from a review against fastai v1's source (2026-11-25) ------------------------------------------------


def test_the_callbacks_positional_order_is_fastai_v1s_too() -> None:
    """MixedPrecision(learn, loss_scale, max_noskip, dynamic, clip, flat_master, max_scale, loss_fp32) in
    fastai, with dtype in learn's place here. mixprec had flat_master third: MixedPrecision(fp16, 512., 2000)
    turned on flat masters with a growth interval left at 1000."""
    params = list(inspect.signature(MixedPrecision.__init__).parameters.values())[2:]  # self, dtype
    positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional[: len(FASTAI_V1_ORDER)] == FASTAI_V1_ORDER
    mp = MixedPrecision(torch.float16, 512.0, 2000)
    assert (mp.max_noskip, mp.flat_master) == (2000, False)
    with pytest.raises(ConfigError, match="flat_master must be True or False"):
        MixedPrecision(torch.float16, 512.0, 1000, True, None, 2000)  # an argument one place off


def test_fastai_v1s_learner_first_call_is_refused_naming_to_fp16() -> None:
    """A user trial: MixedPrecision(learn) said "dtype=Learner(...) is not one"."""
    with pytest.raises(ConfigError, match=r"(?s)fastai v1's order.*learn\.to_fp16\(\)"):
        MixedPrecision(_learner())  # type: ignore[arg-type]


def test_to_fp32_removes_a_mixed_precision_callback_passed_in_as_fastai_does() -> None:
    """fastai's to_fp32 removes every MixedPrecision; mixprec's only the one to_fp16 added, so one given
    in callbacks= stayed, and to_fp16 then stacked a second (fit: "already keeps master weights")."""
    data = mixprec.digits(batch_size=64, seed=0)
    learn = Learner(data, mixprec.build_model("mlp", data, n_hidden=16), silent=True,
                    callbacks=[MixedPrecision()])  # fmt: skip
    learn.to_fp32()
    assert not any(isinstance(c, MixedPrecision) for c in learn.callbacks)
    learn.to_fp16()
    assert sum(isinstance(c, MixedPrecision) for c in learn.callbacks) == 1
    learn.fit(1, callbacks=[_StopAfter(1)])


def test_fastai_v2s_keywords_are_refused_with_their_v1_names() -> None:
    """The signature is v1's (positional calls keep their meaning); v2's GradScaler names were a bare
    'unexpected keyword argument'."""
    with pytest.raises(TypeError, match=r"init_scale -> loss_scale=.*growth_interval -> max_noskip="):
        _learner().to_fp16(init_scale=1024.0, growth_interval=100)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'loss_scal'"):
        _learner().to_fp16(loss_scal=1024.0)


def test_whole_number_inputs_the_learners_cast_rounds_are_named_once() -> None:
    """The Learner casts a batch itself (fastai v1's callback does), so the model's input hook saw half
    inputs and the warning initialize's models give (bf16 rounds 998 and 999 to 1000) never came: a user
    trial's float timesteps reached a to_bf16() model rounded, silently."""
    t = torch.tensor([998.0, 999.0, 361.0, 5.0])

    class Timed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(1, 4)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.lin(t[:, None] / 1000)

    batches = [(t, torch.tensor([0, 1, 2, 3]))] * 2
    loader = DataLoader(batches, batch_size=None)
    data = DataBunch(loader, loader, None, (1,), "t")
    learn = Learner(data, Timed(), silent=True).to_bf16()
    with pytest.warns(UserWarning, match="input 0 holds whole numbers .* 998 became 1000") as said:
        learn.fit(1)
    assert said[0].filename == __file__
    assert sum("whole numbers" in str(w.message) for w in said) == 1  # once per fit, not per batch


@pytest.mark.parametrize("to_half", ["to_fp16", "to_bf16"])
def test_cast_inputs_false_hands_the_model_its_batch_as_given(to_half: str) -> None:
    """fastai v1's callback casts each batch to half (the Learner's default, as before); cast_inputs=False
    leaves the floating inputs fp32 for a model whose inputs' low bits matter (coordinates)."""
    seen: list[torch.Tensor] = []

    class Spy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x)
            return self.lin(x.flatten(1))

    for cast in (True, False):
        seen.clear()
        data = mixprec.digits(batch_size=64, seed=0)
        learn = getattr(Learner(data, Spy(), silent=True), to_half)(cast_inputs=cast)
        learn.fit(steps=2)
        half = torch.float16 if to_half == "to_fp16" else torch.bfloat16
        assert {x.dtype for x in seen} == {half if cast else torch.float32}
        assert learn.model.lin.weight.dtype is torch.float32  # handed back fp32 either way
