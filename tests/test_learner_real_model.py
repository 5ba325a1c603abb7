"""The Learner for a real model (issue 15): step-based fits, schedules over steps (one-cycle against torch's
OneCycleLR, warm-up + cosine against nanoGPT's get_lr), models that return (logits, loss), optimizers with
their own param groups, decay/no-decay groups, and gradient clipping in any precision."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.callbacks import Callback, CancelTrainException, GradientClipping, WarmupCosineScheduler
from mixprec.errors import ConfigError
from mixprec.learner import Learner, decay_groups

pytestmark = pytest.mark.usefixtures("one_thread")


def _data(batch_size: int = 64) -> mixprec.DataBunch:
    return mixprec.synthetic(n=400, input_shape=(16,), n_classes=4, batch_size=batch_size, seed=0)


class LossModel(nn.Module):
    """A classifier that computes its own loss when given targets, as nanoGPT and Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # noqa: E501
        logits = self.body(x)
        return logits, None if y is None else F.cross_entropy(logits, y)


class LrLog(Callback):
    order = 0  # after the schedules (-15): sees the rate this step uses

    def on_train_begin(self) -> None:
        self.lrs: list[list[float]] = []

    def on_batch_begin(self) -> None:
        if self.training:
            self.lrs.append([g["lr"] for g in self.opt.param_groups])


# ------------------------------------------------------------------------------------------ steps
@pytest.mark.parametrize("steps", [3, 7, 12])
def test_fit_steps_takes_exactly_that_many_steps_and_validates_each_epoch(steps: int) -> None:
    data = _data()  # 320 training samples: 5 batches per epoch
    torch.manual_seed(0)
    learn = Learner(data, LossModel(), loss_func=None, silent=True)
    learn.fit(steps=steps)
    assert len(learn.recorder.losses) == steps
    assert len(learn.recorder.epochs) == math.ceil(steps / len(data.train))
    assert learn.iteration == steps


@pytest.mark.parametrize(("epochs", "steps"), [(None, None), (1, 5), (0, None), (None, 0), (None, 2.5)])
def test_fit_needs_exactly_one_of_epochs_and_steps(epochs: int | None, steps: int | None) -> None:
    learn = Learner(_data(), LossModel(), loss_func=None, silent=True)
    with pytest.raises(ConfigError, match="epochs|steps"):
        learn.fit(epochs, steps=steps)


def test_fit_one_cycle_over_steps_matches_torch_onecyclelr() -> None:
    learn = Learner(_data(), LossModel(), loss_func=None, silent=True)
    learn.fit_one_cycle(lr_max=1e-2, pct_start=0.25, steps=13)
    ref_opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=1.0)
    ref = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=1e-2, total_steps=13, pct_start=0.25,
                                              div_factor=25.0, final_div_factor=1e4)
    ref_lrs = []
    for _ in range(13):
        ref_lrs.append(ref_opt.param_groups[0]["lr"])
        ref_opt.step()
        ref.step()
    torch.testing.assert_close(torch.tensor(learn.recorder.lrs), torch.tensor(ref_lrs), rtol=1e-6, atol=0)


def _nanogpt_get_lr(it: int, learning_rate: float, warmup_iters: int, lr_decay_iters: int, min_lr: float) -> float:  # noqa: E501
    """nanoGPT's train.py schedule, written from its source: linear warm-up, then cosine to min_lr."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def test_warmup_cosine_matches_nanogpts_schedule_in_every_group() -> None:
    steps, warmup, lr = 17, 4, 6e-3
    learn = Learner(_data(), LossModel(), loss_func=None, silent=True, wd=0.1)  # two param groups
    log = LrLog()
    learn.fit(steps=steps, lr=lr, callbacks=[WarmupCosineScheduler(lr, warmup), log])
    # nanoGPT decays until lr_decay_iters; the fit's last step is steps - 1
    ref = [_nanogpt_get_lr(i, lr, warmup, steps - 1, lr / 10) for i in range(steps)]
    assert len(log.lrs[0]) == 2
    for group in range(2):
        lrs = torch.tensor([s[group] for s in log.lrs], dtype=torch.float64)
        torch.testing.assert_close(lrs, torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=0)


def _two_rates(params: Any, lr: float) -> torch.optim.Optimizer:
    """open_clip's groups: the body at the fit's lr, one parameter group at 10x (its logit_scale)."""
    params = list(params)
    return torch.optim.AdamW([{"params": params[:-1]}, {"params": params[-1:], "lr": 10 * lr}], lr=lr)


@pytest.mark.parametrize("schedule", ["warmup-cosine", "one-cycle"])
def test_a_group_built_at_a_multiple_of_the_lr_keeps_it_under_a_schedule(schedule: str) -> None:
    """The schedules set one rate in every group: a CLIP trial's 10x group for logit_scale lost its 10x,
    unsaid. Each group follows the schedule at its multiple of the fit's lr, as torch's schedulers scale
    each group's base lr (the reference: LambdaLR over the same two groups)."""
    steps, warmup, lr = 12, 3, 6e-3
    learn = Learner(_data(), LossModel(), loss_func=None, silent=True, opt_func=_two_rates)
    log = LrLog()
    if schedule == "warmup-cosine":
        learn.fit(steps=steps, lr=lr, callbacks=[WarmupCosineScheduler(lr, warmup), log])
        base = lr
        curve = [_nanogpt_get_lr(i, lr, warmup, steps - 1, lr / 10) for i in range(steps)]
    else:
        learn.add_cb(log)
        learn.fit_one_cycle(lr_max=lr, steps=steps)
        base = lr / 25  # fit_one_cycle builds the optimizer at lr_max / div_factor, where the curve starts
        ref_opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=1.0)
        cycle = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=lr, total_steps=steps,
                                                    final_div_factor=1e4)
        curve = []
        for _ in range(steps):
            curve.append(ref_opt.param_groups[0]["lr"])
            ref_opt.step()
            cycle.step()
    ref_opt = _two_rates([nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))], base)
    ref = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda i: curve[min(i, steps - 1)] / base)
    expected = []
    for _ in range(steps):
        expected.append([g["lr"] for g in ref_opt.param_groups])
        ref_opt.step()
        ref.step()
    torch.testing.assert_close(torch.tensor(log.lrs, dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=0)


def test_groups_an_opt_func_gave_one_rate_of_its_own_follow_the_schedule_itself() -> None:
    """An opt_func that ignores lr (SGD(params, lr=0.05)) builds every group at its own rate: the schedule
    gives them its rates, as before (the multiples are of the first group there)."""
    learn = Learner(_data(), LossModel(), loss_func=None, silent=True,
                    opt_func=lambda params, lr: torch.optim.SGD(params, lr=0.05))
    log = LrLog()
    learn.fit(steps=6, lr=1e-3, callbacks=[WarmupCosineScheduler(1e-2, 2), log])
    assert log.lrs[2] == [1e-2]


def test_warmup_longer_than_the_fit_is_refused() -> None:
    learn = Learner(_data(), LossModel(), loss_func=None, silent=True)
    with pytest.raises(ConfigError, match="warmup_steps=10"):
        learn.fit(steps=10, callbacks=[WarmupCosineScheduler(1e-3, 10)])


# ------------------------------------------------------------------- model loss and param groups
def _plain_loop(model: nn.Module, data: mixprec.DataBunch, steps: int, lr: float, wd: float) -> None:
    """What the Learner replaces, written as a PyTorch user does, with nanoGPT's decay rule."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    clip = GradientClipping(0.5).max_norm
    done = 0
    while done < steps:
        for x, y in data.train:
            if done == steps:
                break
            model.train()
            _, loss = model(x, y)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            done += 1


def test_model_loss_decay_groups_and_clipping_train_as_the_plain_pytorch_loop() -> None:
    steps, lr, wd = 8, 1e-2, 0.1
    torch.manual_seed(0)
    ref = LossModel()
    learner_model = LossModel()
    learner_model.load_state_dict(ref.state_dict())
    _plain_loop(ref, _data(), steps, lr, wd)
    opt_func = functools.partial(torch.optim.AdamW, betas=(0.9, 0.95))
    learn = Learner(_data(), learner_model, loss_func=None, opt_func=opt_func, silent=True, wd=wd)
    learn.fit(steps=steps, lr=lr, callbacks=[GradientClipping(0.5)])
    # Not bitwise: clipping sums the per-tensor norms in the optimizer's group order (decay group first),
    # the plain loop in the model's order; fp32 rounding of that sum moves weights by ~1e-8.
    for a, b in zip(ref.parameters(), learner_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert [g["weight_decay"] for g in learn.opt.param_groups] == [wd, 0.0]


def test_an_opt_func_may_build_its_own_param_groups() -> None:
    torch.manual_seed(0)
    model = LossModel()

    def opt_func(params: object, lr: float) -> torch.optim.Optimizer:
        # ignores params: the model's own recipe, a group per layer kind
        groups = [{"params": model.body[0].parameters()}, {"params": model.body[1:].parameters()}]
        return torch.optim.SGD(groups, lr=lr)

    learn = Learner(_data(), model, loss_func=None, opt_func=opt_func, silent=True).to_fp16()
    log = LrLog()
    learn.fit_one_cycle(lr_max=1e-2, steps=6, moms=(0.9, 0.9))
    learn.fit(steps=6, lr=0.05, callbacks=[log])
    assert all(group_lrs == [0.05, 0.05] for group_lrs in log.lrs)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_model_that_does_not_return_pred_and_loss_gets_a_clear_error() -> None:
    class LogitsOnly(LossModel):
        def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
            return self.body(x)

    learn = Learner(_data(), LogitsOnly(), loss_func=None, silent=True)
    with pytest.raises(ConfigError, match=r"model\(xb, yb\) must return \(pred, loss\)"):
        learn.fit(steps=1)


def test_predict_and_validate_with_a_model_loss() -> None:
    torch.manual_seed(0)
    learn = Learner(_data(), LossModel(), loss_func=None, metrics=[mixprec.accuracy], silent=True)
    learn.fit(steps=5)
    xb, yb = learn.data.one_batch("valid")
    with torch.no_grad():
        logits, loss = learn.model(xb, yb)
    torch.testing.assert_close(learn.predict(xb), logits)
    valid_x, valid_y = (torch.cat(t) for t in zip(*learn.data.valid, strict=True))
    with torch.no_grad():
        ref_loss = F.cross_entropy(learn.model(valid_x)[0], valid_y)
    assert learn.validate()[0] == pytest.approx(ref_loss.item(), rel=1e-5)


def test_decay_groups_follow_the_dimension_rule_with_tied_weights_once() -> None:
    emb = nn.Embedding(10, 8)
    head = nn.Linear(8, 10, bias=False)
    head.weight = emb.weight  # tied
    frozen = nn.Linear(8, 8)
    frozen.requires_grad_(False)
    model = nn.Sequential(emb, nn.LayerNorm(8), frozen, nn.Linear(8, 8), head)
    decay, no_decay = decay_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [tuple(p.shape) for p in decay["params"]] == [(10, 8), (8, 8)]  # tied once, frozen out
    assert [tuple(p.shape) for p in no_decay["params"]] == [(8,), (8,), (8,)]  # norm weight+bias, a bias


# ------------------------------------------------------------------------------------------ clipping
class _Norm(Callback):
    """Records the norm of the gradients the optimizer reads, in fp32, after clipping."""

    order = 1000  # after clipping

    def __init__(self, norms: list[float]) -> None:
        self.norms = norms

    def on_backward_end(self) -> None:
        grads = [p.grad.flatten() for p in mixprec.master_params(self.opt) if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.cat(grads).float())))


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16 split masters"])
def test_gradient_clipping_bounds_the_norm_the_optimizer_reads(precision: str) -> None:
    """Every step is clipped (max_norm is far below the gradients' norm): the norm the step reads is
    max_norm. Split masters step on the bf16 gradients: clipped with an fp32 norm and each rounded once,
    their norm is within 2**-11 of it (2e-4 here; torch's clip of the bf16 gradients was 1.5-3.5e-3 off)."""
    norms: list[float] = []
    torch.manual_seed(0)
    learn = Learner(_data(), LossModel(), loss_func=None, silent=True)
    if precision == "fp16":
        learn.to_fp16()
    if precision == "bf16 split masters":
        learn.to_recipe(mixprec.Recipe.from_opt_level("O2", torch.bfloat16).replace(split_masters=True))
    learn.fit(steps=5, lr=0.05, callbacks=[GradientClipping(0.01), _Norm(norms)])
    tolerance = 2**-11 if precision == "bf16 split masters" else 1e-5
    assert len(norms) == 5 and all(abs(n / 0.01 - 1) <= tolerance for n in norms), norms


def test_fit_one_cycle_takes_callbacks_for_its_fit_as_fastai_v1() -> None:
    """A user trial: fit_one_cycle had no callbacks= (fastai v1's has), so one-cycle with clipping needed the
    Learner's own callbacks. The clip must reach every step of the one-cycle fit."""
    norms: list[float] = []
    torch.manual_seed(0)
    learn = Learner(_data(), LossModel(), loss_func=None, silent=True)
    learn.fit_one_cycle(steps=5, lr_max=0.05, callbacks=[GradientClipping(0.01), _Norm(norms)])
    assert len(norms) == 5 and all(abs(n / 0.01 - 1) <= 1e-5 for n in norms), norms
    assert not any(isinstance(c, _Norm) for c in learn.callbacks)  # this fit only


@pytest.mark.parametrize("max_norm", [0.0, -1.0, math.inf])
def test_a_clipping_norm_that_inverts_training_is_refused(max_norm: float) -> None:
    with pytest.raises(ConfigError, match="max_norm must be a positive, finite gradient norm"):
        GradientClipping(max_norm)


# ------------------------------------------------------------------------------------------ resume
class _CrashAfterEpoch(Callback):
    order = 300  # after the Checkpoint callback (200) saved the epoch

    def on_epoch_end(self) -> None:
        raise CancelTrainException()


def test_a_step_based_fit_resumes_bit_for_bit(tmp_path: Path) -> None:
    """13 steps over 5-batch epochs (the last one cut short), warm-up + cosine, fp16: crashed after the first
    epoch and resumed, it ends where the uninterrupted fit ends."""

    def fit(**kw: Any) -> Learner:
        torch.manual_seed(0)
        learn = Learner(_data(), LossModel(), loss_func=None, silent=True).to_fp16()
        learn.fit(steps=13, lr=1e-2, callbacks=[WarmupCosineScheduler(1e-2, 3), *kw.pop("extra", [])], **kw)
        return learn

    whole = fit(checkpoint=tmp_path / "ref.pt")
    fit(checkpoint=tmp_path / "run.pt", extra=[_CrashAfterEpoch()])
    resumed = fit(resume=tmp_path / "run.pt")
    for p, q in zip(resumed.model.parameters(), whole.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert resumed.recorder.lrs == whole.recorder.lrs and len(whole.recorder.lrs) == 13


class HFStyleModel(LossModel):
    """Returns what Hugging Face models return: a mapping with ``logits`` and, given labels, ``loss``."""

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> dict[str, Any]:  # type: ignore[override]
        logits, loss = super().forward(x, y)
        return {"logits": logits} if loss is None else {"loss": loss, "logits": logits}


def test_a_mapping_with_logits_and_loss_trains_like_the_tuple_model() -> None:
    runs = []
    for model_type in (LossModel, HFStyleModel):
        torch.manual_seed(0)
        learn = Learner(_data(), model_type(), loss_func=None, silent=True)
        learn.fit(steps=4)
        xb, _ = learn.data.one_batch("valid")
        runs.append((learn.recorder.losses, learn.predict(xb)))
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=0)


@pytest.mark.parametrize("loss_func", [F.cross_entropy, nn.CrossEntropyLoss()])
def test_a_model_loss_with_the_default_loss_func_says_to_pass_none(loss_func: Any) -> None:
    learn = Learner(_data(), LossModel(), loss_func=loss_func, silent=True)
    said = r"(?s)returned a tuple of 2 \(Tensor, NoneType\).*pass loss_func=None"
    with pytest.raises(ConfigError, match=said):
        learn.fit(steps=1)


def test_a_custom_loss_func_gets_the_model_output_as_it_is() -> None:
    seen: list[type] = []

    def first_of_pair(out: Any, yb: torch.Tensor) -> torch.Tensor:
        seen.append(type(out))
        return F.cross_entropy(out[0], yb)

    Learner(_data(), LossModel(), loss_func=first_of_pair, silent=True).fit(steps=1)
    assert seen and set(seen) == {tuple}  # training and validation batches alike


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_loss_func_returning_a_number_is_refused_naming_it(precision: str) -> None:
    """A user trial: torch's errors for it differed by precision ("'float' object has no attribute
    'backward'" in fp32, "outputs must be a Tensor" from inside the scaler in fp16), naming neither."""

    def as_number(out: torch.Tensor, yb: torch.Tensor) -> float:
        return F.cross_entropy(out[0], yb).item()

    learn = Learner(_data(), LossModel(), loss_func=as_number, silent=True)
    if precision == "fp16":
        learn.to_fp16()
    with pytest.raises(ConfigError, match=r"(?s)loss_func returned float.*no \.item\(\)"):
        learn.fit(steps=1)
