"""GradientAccumulation (fastai v2's): k batches of b samples accumulate into the step one batch of k*b
takes, in fp32 against plain torch and in every precision recipe; under dynamic loss scaling the scale
follows torch.amp's accumulation recipe (one unscale, check and update per step); a partial accumulation
carries over an epoch end (and a checkpoint) and is dropped at the end of the fit; schedules and
``learn.iteration`` count batches, the optimizer counts steps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec
from mixprec.callbacks import Callback, CancelTrainException, GradientAccumulation, OneCycleScheduler
from mixprec.errors import ConfigError
from mixprec.faults import inject_grad_faults
from mixprec.learner import Learner

pytestmark = pytest.mark.usefixtures("one_thread")

N_IN, N_CLASSES, LR = 6, 3, 0.5


def _xy(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n samples of one fixed set: the learners and the references see the same ones."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, N_IN, generator=g), torch.randint(0, N_CLASSES, (256,), generator=g)
    return x[:n], y[:n]


def _data(n: int, batch_size: int) -> mixprec.DataBunch:
    """n samples in loader order (no shuffling: the reference must see the same samples in each step)."""
    x, y = _xy(n)
    train = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)
    valid = DataLoader(TensorDataset(x[:8], y[:8]), batch_size=8)
    return mixprec.DataBunch(train, valid, N_CLASSES, (N_IN,), "accumulation")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(N_IN, 16), nn.ReLU(), nn.Linear(16, N_CLASSES))


def _sgd(params: object, lr: float) -> torch.optim.Optimizer:
    # Plain SGD: the update is lr * gradient, so a wrong gradient scale (the sum of the micro-batches' mean
    # gradients, or the last micro-batch alone) shows in the weights. Adam's first step is lr * sign(g):
    # blind to the scale.
    return torch.optim.SGD(params, lr=lr)  # type: ignore[arg-type]


def _learner(n: int, batch_size: int, *callbacks: Callback) -> Learner:
    return Learner(_data(n, batch_size), _model(), opt_func=_sgd, callbacks=callbacks, silent=True)


def _flat(model: nn.Module) -> torch.Tensor:
    return nn.utils.parameters_to_vector(model.parameters()).detach().float().clone()


def _reference(steps: list[list[tuple[int, int]]], n_acc: int) -> torch.Tensor:
    """Plain torch fp32: for each step, the slices ``[start, end)`` of the data it accumulates, each loss
    multiplied by ``len / n_acc`` (fastai's rule), then one SGD step. One slice of n_acc samples is the
    ordinary big-batch step."""
    model, (x, y) = _model(), _xy(256)
    opt = _sgd(model.parameters(), LR)
    for slices in steps:
        for start, end in slices:
            (F.cross_entropy(model(x[start:end]), y[start:end]) * ((end - start) / n_acc)).backward()
        opt.step()
        opt.zero_grad()
    return _flat(model)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


# ---------------------------------------------------------------- fp32: the big-batch step, exactly
@pytest.mark.parametrize(("batch_size", "k"), [(8, 4), (5, 3)])
def test_k_batches_step_as_one_batch_of_k_times_the_size(batch_size: int, k: int) -> None:
    learn = _learner(batch_size * k, batch_size, GradientAccumulation(n_acc=batch_size * k))
    learn.fit(1, lr=LR)
    want = _reference([[(0, batch_size * k)]], batch_size * k)  # one batch of k*b, plain torch
    # fp32 throughout: only the order of the additions differs (k partial sums against one), a few ulps
    torch.testing.assert_close(_flat(learn.model), want, rtol=1e-6, atol=1e-6)
    assert learn.recorder.skipped == [False]  # one step, taken


def test_a_partial_accumulation_carries_over_the_epoch_end_and_the_fit_end_drops_it() -> None:
    # 40 samples in batches of 16, 16, 8; n_acc=32. Epoch 1: step A after 32 samples, 8 left pending.
    # Epoch 2: 8 + 16 = 24, + 16 = 40 >= 32: step B on 40 samples, each loss still divided by n_acc (the
    # gradient is 40/32 of the mean: fastai's overshoot). The last 8 are pending when the fit ends: dropped.
    learn = _learner(40, 16, GradientAccumulation(n_acc=32))
    with pytest.warns(UserWarning, match="counted 40 samples") as said:
        learn.fit(2, lr=LR)
    assert said[0].filename == __file__  # the fit's line, not the callback's (a user trial)
    want = _reference([[(0, 16), (16, 32)], [(32, 40), (0, 16), (16, 32)]], 32)
    torch.testing.assert_close(_flat(learn.model), want, rtol=1e-6, atol=1e-6)
    assert learn.recorder.skipped == [False, False]
    assert all(p.grad is None for p in learn.model.parameters())  # the dropped 8 left nothing behind


def test_more_samples_than_the_fit_has_never_step() -> None:
    learn = _learner(32, 8, GradientAccumulation(n_acc=1000))  # fastai's own check: nothing moves
    before = _flat(learn.model)
    learn.fit(2, lr=LR)
    assert torch.equal(_flat(learn.model), before)
    assert learn.recorder.lrs == [] and len(learn.recorder.losses) == 8


# ---------------------------------------------------------------- steps, schedules, the Recorder
def test_schedules_and_iterations_count_batches_and_the_optimizer_counts_steps() -> None:
    # fastai: train_iter and the schedules (pct_train) move at every batch; the optimizer steps once per
    # n_acc samples, with the learning rate the schedule set for the batch that completes them.
    sched = OneCycleScheduler(1e-2)
    learn = Learner(_data(96, 8), _model(), callbacks=[GradientAccumulation(32)], silent=True)  # AdamW
    learn.fit(1, lr=1e-2, callbacks=[sched])
    assert (learn.iteration, sched.step_no, len(learn.recorder.losses)) == (12, 12, 12)
    steps = {int(s["step"]) for s in learn.opt.state.values()}  # type: ignore[union-attr]
    assert steps == {3}
    assert learn.recorder.lrs == pytest.approx([sched._at(i)[0] for i in (3, 7, 11)])
    assert learn.recorder.skipped == [False] * 3


# ---------------------------------------------------------------- every precision: the masters see the sum
PRECISIONS: dict[str, tuple[Callable[[Learner], Learner], float]] = {
    # the recipe, and the relative error of the weight change it may have against fp32 (a wrong
    # accumulation, e.g. the masters getting the last micro-batch only, is off by 50% or more)
    "fp16": (lambda learn: learn.to_fp16(), 2e-3),
    "fp16-flat-master": (lambda learn: learn.to_fp16(flat_master=True), 2e-3),
    "O2": (lambda learn: learn.to_recipe("O2"), 2e-3),
    "O1": (lambda learn: learn.to_recipe("O1"), 2e-3),
    "bf16": (lambda learn: learn.to_bf16(), 2e-2),  # 8-bit significand
}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_recipe_steps_on_the_accumulated_gradient(precision: str) -> None:
    set_precision, tolerance = PRECISIONS[precision]
    learn = set_precision(_learner(32, 8, GradientAccumulation(n_acc=32)))
    before = _flat(learn.model)
    learn.fit(1, lr=LR)
    # The weight change, not the weights: the change is what accumulation decides, and the fp32 masters
    # hold it exactly (the model is fp32 again after the fit, holding the masters).
    got, want = _flat(learn.model) - before, _reference([[(0, 32)]], 32) - before
    assert _relative_error(got, want) < tolerance
    assert learn.recorder.skipped == [False]


# ---------------------------------------------------------------- dynamic loss scaling against torch.amp
ACC, MICRO, STEPS, FAULTS = 3, 8, 6, (4, 12)  # faults: the 2nd micro-batch of step 1, the 1st of step 4


def _torch_amp(init_scale: float, growth_interval: int) -> tuple[torch.Tensor, list[float], list[bool]]:
    """torch.amp's accumulation recipe: fp32 weights, autocast fp16, every micro-batch scaled with the same
    scale; unscale, inf check, step (or skip) and update once per step; zero_grad either way."""
    model, (x, y) = _model(), _xy(ACC * MICRO * STEPS)
    opt = _sgd(model.parameters(), LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    inject_grad_faults(model[0], at=FAULTS)  # counts backward passes: micro-batches
    scales, skipped = [], []
    for step in range(STEPS):
        for i in range(ACC):
            start = (step * ACC + i) * MICRO
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x[start : start + MICRO])
            loss = F.cross_entropy(out.float(), y[start : start + MICRO]) * (MICRO / (ACC * MICRO))
            scaler.scale(loss).backward()
        scales.append(scaler.get_scale())
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < scales[-1])  # torch's only sign of a skip: the scale backed off
        opt.zero_grad()
    return _flat(model), scales, skipped


@pytest.mark.parametrize("recipe", ["to_fp16", "O1"])
def test_dynamic_scaling_follows_torch_amp_step_for_step(recipe: str) -> None:
    learn = _learner(ACC * MICRO * STEPS, MICRO, GradientAccumulation(n_acc=ACC * MICRO))
    if recipe == "to_fp16":  # fp16 model, fp32 masters: the gradients accumulate in the half .grad
        learn.to_fp16(512.0, 2)  # growth after 2 clean steps: the run grows the scale as well as backs off
    else:  # fp32 weights under autocast, as torch.amp's recipe
        learn.to_recipe(mixprec.recipe.RECIPES["O1"].replace(scale=mixprec.recipe.ScaleConfig(
            init_scale=512.0, growth_interval=2)))  # fmt: skip
    inject_grad_faults(learn.model[0], at=FAULTS)
    learn.fit(1, lr=LR)
    want, scales, skipped = _torch_amp(512.0, 2)
    # An inf in one micro-batch skips its whole step (not the micro-batch alone), backs the scale off once
    # and is discarded with the rest of the step's gradients; the scale changes only at real steps.
    assert skipped == [False, True, False, False, True, False]
    assert learn.recorder.loss_scales == scales == [512.0, 512.0, 256.0, 256.0, 512.0, 256.0]
    assert learn.recorder.skipped == skipped
    assert learn.scaler is not None and learn.scaler.get_scale() == 256.0
    assert len(learn.recorder.losses) == ACC * STEPS
    # fp16 forwards and (to_fp16) fp16 sums of the micro-batch gradients: half-precision agreement
    assert _relative_error(_flat(learn.model), want) < 5e-4


# ---------------------------------------------------------------- checkpoints
class _StopAfterFirstEpoch(Callback):
    order = 300  # after the Checkpoint (200) saved the epoch

    def on_epoch_end(self) -> None:
        raise CancelTrainException()


@pytest.mark.parametrize("half", [False, True], ids=["fp32", "fp16"])
def test_a_resumed_fit_finishes_the_accumulation_the_saved_one_was_in(tmp_path: Path, half: bool) -> None:
    # As above: the first epoch ends with 8 samples pending; the resumed fit must add them into its step.
    def learner() -> Learner:
        learn = _learner(40, 16, GradientAccumulation(n_acc=32))
        return learn.to_fp16() if half else learn

    whole = learner()
    whole.fit(2, lr=LR)
    path = tmp_path / "run.pt"
    learner().fit(2, lr=LR, checkpoint=path, callbacks=[_StopAfterFirstEpoch()])
    resumed = learner()
    resumed.fit(2, lr=LR, resume=path)
    assert torch.equal(_flat(resumed.model), _flat(whole.model))
    assert resumed.recorder.losses == whole.recorder.losses


# ---------------------------------------------------------------- arguments
@pytest.mark.parametrize("n_acc", [0, -32, 2.5, 32.0, "32", None, True])
def test_n_acc_must_be_a_positive_int(n_acc: object) -> None:
    with pytest.raises(ConfigError) as info:
        GradientAccumulation(n_acc=n_acc)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith(f"n_acc must be an int >= 1 (the number of samples to accumulate before each "
                              f"optimizer step), got {n_acc!r}.")  # fmt: skip
    assert "fix: e.g. GradientAccumulation(n_acc=64)" in message


def test_it_runs_before_mixed_precision_whatever_order_it_was_added_in() -> None:
    learn = _learner(32, 8).to_fp16()
    acc = GradientAccumulation(16)
    learn.add_cb(acc)
    names = [type(cb).__name__ for cb in learn.callbacks]
    assert names.index("GradientAccumulation") < names.index("MixedPrecision")
    assert acc.order == mixprec.MixedPrecision.order - 4  # fastai's MixedPrecision.order - 4


def test_an_n_acc_that_is_not_a_multiple_warns_once_and_two_accumulators_are_refused() -> None:
    """With batches of 8 and n_acc=12 each step counts 16 samples, and its gradient is 16/12 of the mean:
    fastai's rule, silent before. Two accumulators in one fit each divided the loss and cancelled steps
    on their own count (one step in 8 batches, matching neither)."""
    learn = _learner(32, 8, GradientAccumulation(n_acc=12))
    with pytest.warns(UserWarning, match="16/12 times the mean") as caught:
        learn.fit(1, lr=0.1)
    assert len([w for w in caught if "GradientAccumulation" in str(w.message)]) == 1
    learn = _learner(32, 8, GradientAccumulation(n_acc=16))
    with pytest.raises(ConfigError, match="two GradientAccumulation callbacks"):
        learn.fit(1, lr=0.1, callbacks=[GradientAccumulation(n_acc=32)])
