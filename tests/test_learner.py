"""The Learner's loop: event order, step cancelling, evaluation, precision switches; fp16/bf16 training
matches the fp32 run on digits."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.callbacks import (
    EVENTS,
    Callback,
    CancelBatchException,
    CancelStepException,
    CancelTrainException,
    MixedPrecision,
)
from mixprec.errors import ConfigError
from mixprec.learner import Learner, accuracy, error_rate

pytestmark = pytest.mark.usefixtures("one_thread")


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])]


def _learner(n_hidden: int = 128, batch_size: int = 64, device: str = "cpu", **kw: object) -> Learner:
    data = mixprec.digits(batch_size=batch_size, seed=0)
    torch.manual_seed(0)
    model = mixprec.build_model("mlp", data, n_hidden=n_hidden).to(device)
    return Learner(data, model, metrics=[accuracy], silent=True, **kw)  # type: ignore[arg-type]


class EventLog(Callback):
    def __init__(self) -> None:
        self.log: list[tuple[str, bool]] = []

    def __getattribute__(self, name: str) -> object:
        if name in EVENTS:
            return lambda: self.log.append((name, self.learn.training))
        return super().__getattribute__(name)


# ------------------------------------------------------------------------------------------ accuracy
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_reaches_fp32_accuracy_on_digits(precision: str, device: str) -> None:
    accs = {}
    for mode in ("fp32", precision):
        learn = _learner(device=device)
        getattr(learn, f"to_{mode}")()
        learn.fit_one_cycle(4, 1e-2)
        accs[mode] = learn.recorder.epochs[-1].metric("accuracy")
        assert all(p.dtype == torch.float32 for p in learn.model.parameters())  # on_train_end undid it
    assert accs["fp32"] >= 0.95, accs
    assert accs[precision] >= 0.95, accs
    assert abs(accs["fp32"] - accs[precision]) <= 0.01, accs


# ------------------------------------------------------------------------------------------ the loop
def test_events_fire_in_the_documented_order() -> None:
    learn = _learner(batch_size=512)
    log = EventLog()
    learn.fit(1, callbacks=[log])
    n_train, n_valid = len(learn.data.train), len(learn.data.valid)
    batch = ["on_batch_begin", "on_loss_begin", "on_backward_begin", "on_backward_end", "on_step_end",
             "on_batch_end"]
    expected = [("on_train_begin", False), ("on_epoch_begin", False)]
    expected += [(e, True) for e in batch] * n_train
    expected += [(e, False) for e in ("on_batch_begin", "on_loss_begin", "on_batch_end")] * n_valid
    expected += [("on_epoch_end", False), ("on_train_end", False)]
    assert log.log == expected
    assert log not in learn.callbacks  # fit(callbacks=...) are for that fit only


class SkipEveryStep(Callback):
    def on_backward_end(self) -> None:
        raise CancelStepException()

    def on_step_end(self) -> None:
        self.seen_skipped = self.learn.step_skipped


def test_cancel_step_skips_the_update_but_not_on_step_end() -> None:
    learn = _learner()
    before = [p.detach().clone() for p in learn.model.parameters()]
    skip = SkipEveryStep()
    learn.fit(1, callbacks=[skip])
    assert skip.seen_skipped is True
    assert all(torch.equal(a, b) for a, b in zip(before, learn.model.parameters(), strict=True))
    assert learn.recorder.skipped_steps == len(learn.data.train)
    assert all(p.grad is None for p in learn.model.parameters())  # zero_grad still ran


class StopAfter(Callback):
    def __init__(self, n: int) -> None:
        self.n = n

    def on_batch_end(self) -> None:
        if self.training and self.iteration + 1 >= self.n:
            raise CancelTrainException()


def test_cancel_train_stops_and_still_ends_training() -> None:
    learn = _learner().to_fp16()
    log = EventLog()
    learn.fit(3, callbacks=[StopAfter(2), log])
    assert len(learn.recorder.losses) == 2
    assert log.log[-1] == ("on_train_end", False)
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())


class Boom(Callback):
    def on_backward_begin(self) -> None:
        raise RuntimeError("boom")


def test_an_error_mid_training_leaves_the_model_fp32() -> None:
    learn = _learner().to_fp16()
    with pytest.raises(RuntimeError, match="boom"):
        learn.fit(1, callbacks=[Boom()])
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())


def test_validate_matches_a_manual_evaluation() -> None:
    learn = _learner()
    learn.fit(1)
    learn.metrics.append(error_rate)
    loss, acc, err = learn.validate()
    xs, ys = zip(*learn.data.valid, strict=True)
    x, y = torch.cat(xs), torch.cat(ys)
    with torch.no_grad():
        out = learn.model(x)
    assert loss == pytest.approx(F.cross_entropy(out, y).item(), rel=1e-5)
    assert acc == pytest.approx((out.argmax(1) == y).float().mean().item())
    assert err == pytest.approx(1 - acc)


def test_predict_one_sample_and_a_batch() -> None:
    learn = _learner()
    xb, _ = learn.data.one_batch("valid")
    batch = learn.predict(xb)
    assert batch.shape == (len(xb), 10) and batch.dtype == torch.float32
    torch.testing.assert_close(learn.predict(xb[3]), batch[3])
    preds, targs = learn.get_preds()
    assert len(preds) == len(targs) == len(learn.data.valid.dataset)


class _CausalTokens(nn.Module):
    """A GPT's contract: a (batch, time) batch of token ids of any length up to the context."""

    def __init__(self, vocab: int = 12) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, 8), nn.Linear(8, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape  # a 1-D prompt is not a batch: it fails here
        causal_mean = self.emb(idx).cumsum(1) / torch.arange(1, t + 1)[:, None]
        return self.head(causal_mean)


def test_predict_takes_one_prompt_shorter_than_the_context() -> None:
    """One sample was told from a batch by its shape equalling input_shape, so a language model's prompt
    shorter than the context (5 tokens of 16) went in as a batch of 5 (the model refused 1-D ids; a trial
    generated by hand). One sample is an input with input_shape's number of dimensions."""
    tokens = torch.randint(0, 12, (32, 16))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, tokens), batch_size=8)
    data = mixprec.DataBunch(loader, loader, 12, (16,), "tokens")
    learn = Learner(data, _CausalTokens(), loss_func=lambda out, y: F.cross_entropy(out.flatten(0, 1),
                                                                                     y.flatten()))
    prompt = tokens[0, :5]
    out = learn.predict(prompt)
    assert out.shape == (5, 12)
    torch.testing.assert_close(out, learn.predict(prompt[None])[0], rtol=0, atol=0)
    assert learn.predict(tokens[:3]).shape == (3, 16, 12)  # a batch stays a batch


def test_a_loader_of_dict_batches_is_refused_naming_the_adapter() -> None:
    """A trial's Hugging Face-style collator yielded dicts: 'too many values to unpack (expected 2)'."""
    ids = torch.randint(0, 12, (8, 16))
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids[:, 0]}]
    data = mixprec.DataBunch(batches, batches, 12, (16,), "dicts")  # type: ignore[arg-type]
    learn = Learner(data, _CausalTokens(), silent=True)
    with pytest.raises(ConfigError, match=r"(?s)dict with keys input_ids, attention_mask, labels.*"
                                          r"\(\(b\['input_ids'\]"):
        learn.fit(1)


class _WithLengths(nn.Module):
    """A tagger's shape: (features, lengths) in, as its loader yields them."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.body(x.flatten(1)) * lengths[:, None]


def test_predict_takes_a_batch_of_several_inputs_without_a_gradient() -> None:
    """predict read x.shape, so a model of several inputs could not use it (a BiLSTM-CRF trial called its
    model by hand), and it built an autograd graph. It takes the inputs as the loader yields them, as
    training does (model(*x)), under no_grad."""
    learn = _learner()
    learn.model = model = _WithLengths()
    xb, _ = learn.data.one_batch("valid")
    lengths = torch.arange(len(xb), dtype=torch.float32)
    out = learn.predict((xb, lengths))
    assert not out.requires_grad
    torch.testing.assert_close(out, model(xb, lengths), rtol=0, atol=0)


class _FramesAndLengths(nn.Module):
    """A CTC model's shape: (features, lengths) in, (log-probabilities, output lengths) out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.body(x.flatten(1)).log_softmax(-1), lengths


def _ctc_style_loss(pred: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor, weight: torch.Tensor
                    ) -> torch.Tensor:
    log_probs, lengths = pred
    return -(log_probs.gather(1, y[:, None]).squeeze(1) * weight * lengths).mean()


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_several_targets_and_outputs_go_through_fit_validate_and_predict(precision: str) -> None:
    """A CTC trial's loader yields ((features, lengths), (targets, target_lengths)): the Learner moved yb
    with yb.to() (a bare AttributeError at the first batch), and predict called .float() on the model's
    tuple. Targets go to loss_func(pred, *yb) and metrics as fastai v2 passes them; outputs keep their
    container. The losses match the same model fed one target tensor."""
    data = mixprec.digits(batch_size=128, seed=0)

    def loader(dl: Any) -> list[Any]:
        return [((x, torch.ones(len(x))), (y, torch.full((len(y),), 0.5))) for x, y in dl]

    batches = mixprec.DataBunch(loader(data.train), loader(data.valid), data.n_classes, data.input_shape,
                                "digits")  # type: ignore[arg-type]
    learn = Learner(batches, _FramesAndLengths(), loss_func=_ctc_style_loss, silent=True,
                    metrics=[lambda pred, y, w: (pred[0].argmax(-1) == y).float().mean()])
    if precision == "fp16":
        learn.to_fp16()
    learn.fit(1, 1e-2)
    one_target = mixprec.DataBunch([(xb, yb[0]) for xb, yb in batches.train],
                                   [(xb, yb[0]) for xb, yb in batches.valid], data.n_classes,
                                   data.input_shape, "digits")  # type: ignore[arg-type]
    ref = Learner(one_target, _FramesAndLengths(), silent=True,  # the same loss of one target tensor
                  loss_func=lambda pred, y: _ctc_style_loss(pred, y, torch.full((len(y),), 0.5)))
    if precision == "fp16":
        ref.to_fp16()
    ref.fit(1, 1e-2)
    assert learn.recorder.losses == ref.recorder.losses
    (x, lengths), (y, _) = batches.valid[0]
    log_probs, out_lengths = learn.predict((x, lengths))
    assert log_probs.dtype == torch.float32 and torch.equal(out_lengths, lengths)
    preds, (targets, weights) = learn.get_preds()
    assert len(preds[0]) == len(targets) == len(weights) == sum(len(b[1][0]) for b in batches.valid)
    assert len(learn.validate()) == 2


def test_precision_switches_keep_one_callback() -> None:
    learn = _learner()
    learn.to_fp16().to_bf16()
    mps = [cb for cb in learn.callbacks if isinstance(cb, MixedPrecision)]
    assert len(mps) == 1 and mps[0].dtype == torch.bfloat16
    learn.to_fp32()
    assert not any(isinstance(cb, MixedPrecision) for cb in learn.callbacks)


def test_to_fp16_keeps_fastais_signature_and_documented_scaling() -> None:
    """fastai v1.0.61's to_fp16(loss_scale=None, max_noskip=1000, dynamic=True, clip=None, ...): None starts
    a dynamic scale at 2**16, as fastai v2's (torch's GradScaler) does. mixprec started at 512, where a
    ConvNeXt's layer-scale gradients (gamma 1e-6) were 98% zeros in fp16 and the scale took 1000 clean
    steps per doubling to lift them."""
    learn = _learner().to_fp16()
    mp = learn.mp_cb
    assert isinstance(mp, MixedPrecision)
    settings = (mp.loss_scale, mp.dynamic, mp.flat_master, mp.max_noskip, mp.clip)
    assert settings == (2.0**16, True, False, 1000, None)
    assert _learner().to_fp16(dynamic=False).mp_cb.loss_scale == 512.0  # fastai's static default
    learn.fit(1)
    assert learn.scaler is not None and learn.scaler.is_dynamic
    assert learn.recorder.loss_scales[0] == 2.0**16  # dynamic scaling starts at loss_scale


class MomentumLog(Callback):
    def on_train_begin(self) -> None:
        self.moms: list[float] = []

    def on_step_end(self) -> None:
        group = self.opt.param_groups[0]
        self.moms.append(group["betas"][0] if "betas" in group else group["momentum"])


OPTS = {
    "adamw": lambda ps, lr: torch.optim.AdamW(ps, lr=lr),
    "sgd": lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9),
}


@pytest.mark.parametrize("opt", list(OPTS))
def test_one_cycle_schedule_matches_torch_onecyclelr(opt: str) -> None:
    learn = _learner(opt_func=OPTS[opt])
    log = MomentumLog()
    learn.add_cb(log)
    learn.fit_one_cycle(2, 1e-2, div_factor=25.0, pct_start=0.25)
    total = len(learn.recorder.lrs)
    ref_opt = OPTS[opt]([nn.Parameter(torch.zeros(1))], 1.0)
    ref = torch.optim.lr_scheduler.OneCycleLR(
        ref_opt, max_lr=1e-2, total_steps=total, pct_start=0.25, div_factor=25.0, final_div_factor=1e4
    )
    ref_lrs, ref_moms = [], []
    for _ in range(total):
        group = ref_opt.param_groups[0]
        ref_lrs.append(group["lr"])
        ref_moms.append(group["betas"][0] if "betas" in group else group["momentum"])
        ref_opt.step()
        ref.step()
    torch.testing.assert_close(torch.tensor(learn.recorder.lrs), torch.tensor(ref_lrs), rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(log.moms), torch.tensor(ref_moms), rtol=1e-6, atol=0)


def test_one_cycle_leaves_plain_sgd_without_momentum() -> None:
    learn = _learner(opt_func=lambda ps, lr: torch.optim.SGD(ps, lr=lr))
    learn.fit_one_cycle(1, 1e-2)
    assert learn.opt is not None and learn.opt.param_groups[0]["momentum"] == 0


def test_bad_arguments_raise_config_errors() -> None:
    learn = _learner()
    with pytest.raises(ConfigError, match="epochs"):
        learn.fit(0)
    with pytest.raises(ConfigError, match="float16 or torch.bfloat16"):
        MixedPrecision(torch.float32)
    with pytest.raises(ConfigError, match="split"):
        learn.get_preds("test")


def test_learner_trains_a_model_with_batchnorm_in_fp16() -> None:
    data = mixprec.digits(seed=0)
    torch.manual_seed(0)
    model = mixprec.build_model("cnn", data)
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    learn = Learner(data, model, metrics=[accuracy], silent=True).to_fp16()
    learn.fit_one_cycle(2, 1e-2)
    assert learn.recorder.epochs[-1].metric("accuracy") > 0.5  # learns (10 classes: chance is 0.1)


class _SkipOddBatches(Callback):
    """fastai's way to skip a batch: CancelBatchException in on_batch_begin, in training and validation."""

    def __init__(self) -> None:
        self.seen = {True: 0, False: 0}

    def on_batch_begin(self) -> None:
        self.seen[self.training] += 1
        if self.seen[self.training] % 2:
            raise CancelBatchException()


def test_a_batch_cancelled_before_its_loss_is_skipped_in_training_and_validation() -> None:
    """Cancelled in on_batch_begin, the Recorder crashed on the first batch (no loss yet) and logged the
    previous batch's loss for the others; cancelled in validation, the exception escaped fit."""
    learn = _learner(batch_size=256)
    skip = _SkipOddBatches()
    learn.fit(1, lr=1e-3, callbacks=[skip])
    batches = len(learn.data.train)
    assert len(learn.recorder.losses) == batches - (batches + 1) // 2  # only the batches that ran
    assert len(set(learn.recorder.losses)) == len(learn.recorder.losses)  # none logged twice
    assert skip.seen[False] == len(learn.data.valid)  # validation saw every batch and skipped the odd ones


class _CancelAfterUnscale(Callback):
    order = MixedPrecision.order + 1  # after MixedPrecision's on_backward_end unscaled the gradients

    def on_backward_end(self) -> None:
        raise CancelBatchException()


class _CancelEveryValidationBatch(Callback):
    def on_batch_begin(self) -> None:
        if not self.training:
            raise CancelBatchException()


def test_a_batch_cancelled_after_unscaling_or_every_validation_batch_cancelled_is_refused_clearly() -> None:
    """The first made the next batch fail with the scaler's "unscale_() has already been called"; the
    second said the validation set was empty."""
    learn = _learner(batch_size=256).to_fp16()
    with pytest.raises(ConfigError, match="order < 100"):
        learn.fit(1, lr=1e-3, callbacks=[_CancelAfterUnscale()])
    learn = _learner(batch_size=256)
    with pytest.raises(ConfigError, match="Every validation batch was cancelled"):
        learn.fit(1, lr=1e-3, callbacks=[_CancelEveryValidationBatch()])


class _CancelAfterTheStep(Callback):
    order = MixedPrecision.order - 10

    def on_step_end(self) -> None:
        raise CancelBatchException()


def test_a_batch_cancelled_after_the_step_is_refused_clearly() -> None:
    """The scaler had stepped: the next batch failed with "unscale_() is being called after step()"."""
    learn = _learner(batch_size=256).to_fp16()
    with pytest.raises(ConfigError, match="before the step"):
        learn.fit(1, lr=1e-3, callbacks=[_CancelAfterTheStep()])


class _Empty(torch.utils.data.IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(())


def test_an_empty_validation_loader_without_a_length_is_named() -> None:
    """A check for cancelled batches called len() on the loader: an iterable dataset's has none."""
    learn = _learner(batch_size=256)
    with pytest.raises(ConfigError, match="validation set is empty"):
        learn.validate(torch.utils.data.DataLoader(_Empty(), batch_size=4))


# ---- fastai v1 calls (a user trial ported a v1 script): its names taken, its other orders refused ---------


def test_fit_one_cycle_takes_fastai_v1s_max_lr_as_lr_max() -> None:
    runs = []
    for rate in ({"max_lr": 1e-2}, {"lr_max": 1e-2}):
        learn = _learner(n_hidden=16)
        learn.fit_one_cycle(1, **rate)
        runs.append(learn.recorder.losses)
    assert runs[0] == runs[1]
    with pytest.raises(ConfigError, match="one rate"):
        _learner(n_hidden=16).fit_one_cycle(1, 1e-2, max_lr=1e-3)


def test_fastai_v1s_positional_moms_in_fit_one_cycle_is_refused_naming_the_order() -> None:
    with pytest.raises(ConfigError, match=r"(?s)third argument is div_factor.*moms="):
        _learner(n_hidden=16).fit_one_cycle(1, 1e-2, (0.95, 0.85))  # type: ignore[arg-type]


def test_fastais_weight_decay_in_fits_third_place_is_refused_naming_wd() -> None:
    with pytest.raises(ConfigError, match=r"(?s)third argument is callbacks.*Learner\(\.\.\., wd="):
        _learner(n_hidden=16).fit(1, 1e-2, 1e-4)  # type: ignore[arg-type]


def test_fastai_v1s_learner_order_is_refused_naming_the_keywords() -> None:
    data = mixprec.digits(batch_size=64, seed=0)
    model = mixprec.build_model("mlp", data, n_hidden=16)
    for opt_func in (torch.optim.AdamW, functools.partial(torch.optim.SGD, momentum=0.9)):
        with pytest.raises(ConfigError, match=r"(?s)got an optimizer.*opt_func=\.\.\., loss_func=\.\.\."):
            Learner(data, model, opt_func, F.cross_entropy, silent=True)  # type: ignore[arg-type]


def test_one_metric_is_taken_as_fastai_v1_takes_it() -> None:
    results = []
    for metrics in ([accuracy], accuracy):
        data = mixprec.digits(batch_size=64, seed=0)
        torch.manual_seed(0)
        learn = Learner(data, mixprec.build_model("mlp", data, n_hidden=16), metrics=metrics, silent=True)
        learn.fit(1)
        results.append(learn.valid_metrics)
    assert results[0] == results[1] and len(results[1]) == 1


@pytest.mark.parametrize("wrong", ["a pair of loaders", "one loader"])
def test_data_without_train_and_valid_is_refused_at_construction_naming_databunch(wrong: str) -> None:
    """fastai's Learner takes DataLoaders (.train, .valid); a pair of loaders or one loader got as far as
    fit, then "'tuple' object has no attribute 'train'" (a user trial)."""
    data = mixprec.digits(batch_size=64, seed=0)
    given = (data.train, data.valid) if wrong == "a pair of loaders" else data.train
    model = mixprec.build_model("mlp", data, n_hidden=16)
    got = "a tuple" if wrong == "a pair of loaders" else "a DataLoader"
    with pytest.raises(ConfigError, match=rf"(?s)first argument is the data.*got {got}.*mixprec.DataBunch"):
        Learner(given, model, silent=True)  # type: ignore[arg-type]


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.dtypes: set[torch.dtype] = set()

    def forward(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        self.dtypes |= {left.dtype, right.dtype}
        return self.net(torch.cat([left, right], dim=1))


Batches = list[tuple[torch.Tensor, torch.Tensor]]


def _halves(batches: Batches) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    return [((x.flatten(1)[:, :32], x.flatten(1)[:, 32:]), y) for x, y in batches]


@pytest.mark.parametrize("precision", ["fp32", "to_fp16"])
def test_a_batch_of_several_inputs_is_passed_as_model_star_xb(precision: str) -> None:
    """fastai's Learner calls model(*xb) when a batch's input is a tuple (a seq2seq model's source and
    target): the Learner failed with "'list' object has no attribute 'to'" (a user trial). The same
    network fed the two halves of each digits image trains exactly as the one fed the whole image."""
    data = mixprec.digits(batch_size=64, seed=0)
    train, valid = list(data.train), list(data.valid)  # one shuffle, the same batches for both models
    whole = mixprec.DataBunch(train, valid, data.n_classes, data.input_shape, "digits")  # type: ignore[arg-type]
    split = mixprec.DataBunch(_halves(train), _halves(valid),  # type: ignore[arg-type]
                              data.n_classes, data.input_shape, "digits, two halves")
    two = _TwoInputs()
    one = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    one.load_state_dict({f"{int(k[0]) + 1}{k[1:]}": v for k, v in two.net.state_dict().items()})
    runs = []
    for learner_data, model in ((split, two), (whole, one)):
        learn = Learner(learner_data, model, silent=True)
        if precision == "to_fp16":
            learn.to_fp16()
        learn.fit(1, 1e-2)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert two.dtypes == ({torch.float16} if precision == "to_fp16" else {torch.float32})
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


class _OptimizerSeen(Callback):
    """Records the parameters the fit's optimizer holds and, under to_fp16/to_bf16, its fp32 masters."""

    def on_train_begin(self) -> None:
        self.held: list[torch.Tensor] = []
        self.masters = 0

    def on_step_end(self) -> None:
        opt = self.learn.opt
        if not self.held:
            model_params = opt.model_params() if hasattr(opt, "model_params") else (
                p for g in opt.param_groups for p in g["params"])
            self.held = list(model_params)
            self.masters = sum(m.numel() for m in getattr(opt, "master_views", list)())


@pytest.mark.parametrize("precision", [None, "bf16"])
@pytest.mark.parametrize("wd", [None, 0.01])
def test_the_optimizer_holds_the_trainable_parameters_only(precision: str | None, wd: float | None) -> None:
    """fastai builds its optimizer over trainable_params(model) (its default splitter): a frozen base (a
    LoRA's) is not in it, so to_bf16() makes no fp32 master for it (4 bytes per frozen weight)."""
    learn = _learner(wd=wd)
    first, last = learn.model[1], learn.model[-1]  # type: ignore[index]
    first.requires_grad_(False)
    if precision == "bf16":
        learn.to_bf16()
    seen = _OptimizerSeen()
    learn.fit(steps=2, callbacks=[seen])
    trainable = [p for p in learn.model.parameters() if p.requires_grad]
    assert {id(p) for p in seen.held} == {id(p) for p in trainable}
    assert last.weight.requires_grad and not first.weight.requires_grad
    if precision == "bf16":
        assert seen.masters == sum(p.numel() for p in trainable)


def test_a_fit_with_every_parameter_frozen_is_refused_naming_it() -> None:
    learn = _learner()
    learn.model.requires_grad_(False)
    with pytest.raises(ConfigError, match="every parameter of the .* is frozen") as info:
        learn.fit(steps=1)
    assert "requires_grad_(True)" in str(info.value)


# ------------------------------------------------------------------------ CTC-style batches (a trial)
class _Framewise(nn.Module):
    """Per-frame log-probabilities over 4 symbols: a CTC model's output, padded to its batch's length."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.proj(x).log_softmax(-1)


def _ctc_batches(frames: list[int]) -> list[Any]:
    """Batches of 4 samples: ((x, lengths), (all labels concatenated, label lengths)), F.ctc_loss's 1-D
    target form, with 3 labels a sample, so the concatenated labels are 12 long."""
    g = torch.Generator().manual_seed(0)
    return [((torch.randn(4, t, 3, generator=g), torch.full((4,), t)),
             (torch.randint(1, 4, (12,), generator=g), torch.full((4,), 3))) for t in frames]


def _ctc(pred: torch.Tensor, labels: torch.Tensor, label_lengths: torch.Tensor) -> torch.Tensor:
    lengths = torch.full((pred.shape[0],), pred.shape[1])
    return F.ctc_loss(pred.transpose(0, 1), labels, lengths, label_lengths)


def test_ctc_batches_count_samples_and_their_padded_outputs_are_kept_per_sample() -> None:
    """A speech trial: with CTC's concatenated labels the batch size read the first target's length (12
    tokens, not 4 samples), so GradientAccumulation(n_acc=8) stepped every batch instead of every second;
    and get_preds raised "Sizes of tensors must match" on outputs padded per batch, where fastai's
    to_concat keeps them per sample."""
    train, valid = _ctc_batches([6, 6, 6, 6]), _ctc_batches([5, 7])
    data = mixprec.DataBunch(train, valid, None, (6, 3), "ctc")  # type: ignore[arg-type]
    torch.manual_seed(0)

    class Weights(Callback):
        def __init__(self) -> None:
            self.seen: list[torch.Tensor] = []

        def on_batch_end(self) -> None:
            if self.learn.training:
                self.seen.append(self.learn.model.proj.weight.detach().clone())

    weights = Weights()
    learn = Learner(data, _Framewise(), loss_func=_ctc, silent=True,
                    callbacks=[mixprec.callbacks.GradientAccumulation(n_acc=8), weights])
    learn.fit(1, 0.1)
    assert learn.batch_size == 4
    moved = [not torch.equal(a, b) for a, b in zip(weights.seen, weights.seen[1:], strict=False)]
    assert moved == [True, False, True]  # stepped after batches 2 and 4 only (8 samples each time)
    preds, _ = learn.get_preds()
    assert [tuple(p.shape) for p in preds] == [(5, 4)] * 4 + [(7, 4)] * 4
    torch.testing.assert_close(preds[4], learn.predict(valid[1][0])[0])


@pytest.mark.parametrize(
    ("xb", "yb", "size"),
    [
        # PyG-style graphs: 26 nodes' features, their edges and graph ids; one target per graph (a review:
        # the majority of leading sizes counted nodes)
        ((torch.randn(26, 3), torch.zeros(2, 40, dtype=torch.long), torch.zeros(26, dtype=torch.long)),
         torch.randn(4), 4),
        # seq-first inputs with a (T, B) mask, one target per sequence
        ((torch.randn(10, 4, 3), torch.ones(10, 4, dtype=torch.bool)), torch.zeros(4, dtype=torch.long), 4),
        # CTC: 12 concatenated labels, then 4 label lengths; 4 inputs
        ((torch.randn(4, 6, 3), torch.full((4,), 6)),
         (torch.ones(12, dtype=torch.long), torch.full((4,), 3)), 4),
    ],
)
def test_the_batch_size_is_the_first_targets_length_except_under_ctcs_concatenated_labels(
    xb: Any, yb: Any, size: int
) -> None:
    learn = _learner()
    learn.xb, learn.yb = xb, yb
    assert learn.batch_size == size
