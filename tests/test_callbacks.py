"""Callbacks: MixedPrecision's state at every event, against a hand-written loop over the same core parts;
overflow skipping; AutocastMixedPrecision; the Recorder and the progress table."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
from mixprec.autocast import half_compute
from mixprec.callbacks import AutocastMixedPrecision, Callback, MixedPrecision, model_to_half
from mixprec.learner import Learner, accuracy
from mixprec.master import MasterWeights
from mixprec.scaler import GradScaler

pytestmark = pytest.mark.usefixtures("one_thread")


HALF = [torch.float16, torch.bfloat16]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])]


def _cnn_learner(batch_size: int = 128, device: str = "cpu", **kw: object) -> Learner:
    """simple_cnn has BatchNorm: the case where MixedPrecision must keep some parameters fp32."""
    data = mixprec.digits(batch_size=batch_size, seed=0)
    torch.manual_seed(0)
    model = mixprec.build_model("cnn", data).to(device)
    return Learner(data, model, opt_func=lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9),
                   metrics=[accuracy], silent=True, **kw)  # type: ignore[arg-type]


def _is_bn_param(model: nn.Module) -> dict[int, bool]:
    return {
        id(p): isinstance(m, nn.BatchNorm2d) for m in model.modules() for p in m.parameters(recurse=False)
    }


class StateSpy(Callback):
    """Runs after MixedPrecision at every event and checks the state that event promises."""

    order = 1000

    def __init__(self, dtype: torch.dtype, scale: float | None) -> None:
        self.dtype, self.scale = dtype, scale
        self.seen: set[str] = set()

    def _params_are_mixed(self) -> None:
        bn = _is_bn_param(self.learn.model)
        for p in self.learn.model.parameters():
            assert p.dtype == (torch.float32 if bn[id(p)] else self.dtype)
        masters = list(self.opt.master_params())
        assert masters and all(m.dtype == torch.float32 for m in masters)

    def on_train_begin(self) -> None:
        self.seen.add("on_train_begin")
        assert isinstance(self.opt, MasterWeights)
        self._params_are_mixed()
        for half, master in zip(self.opt.model_params(), self.opt.master_views(), strict=True):
            assert torch.equal(master.to(self.dtype), half)  # the half weights are the masters rounded

    def on_batch_begin(self) -> None:
        self.seen.add("on_batch_begin")
        assert self.xb.dtype == self.dtype
        self._params_are_mixed()

    def on_loss_begin(self) -> None:
        self.seen.add("on_loss_begin")
        assert self.pred.dtype == torch.float32  # the loss and its reductions run in fp32

    def on_backward_begin(self) -> None:
        self.seen.add("on_backward_begin")
        assert self.loss.dtype == torch.float32
        torch.testing.assert_close(self.loss_grad, self.loss * (self.scale or 1.0), rtol=0, atol=0)

    def on_backward_end(self) -> None:
        self.seen.add("on_backward_end")
        scale = self.scale or 1.0
        for half, master in zip(self.opt.model_params(), self.opt.master_views(), strict=True):
            assert half.grad is not None and half.grad.dtype == self.dtype
            assert master.grad is not None and master.grad.dtype == torch.float32
            # the fp32 master gradient is the half gradient, unscaled (powers of two: exact)
            torch.testing.assert_close(master.grad, half.grad.float() / scale, rtol=0, atol=0)

    def on_step_end(self) -> None:
        self.seen.add("on_step_end")
        self._params_are_mixed()
        for half, master in zip(self.opt.model_params(), self.opt.master_views(), strict=True):
            assert torch.equal(master.detach().to(self.dtype), half)  # masters copied back, rounded
        self.last_masters = [m.detach().clone() for m in self.opt.master_views()]

    def on_train_end(self) -> None:
        self.seen.add("on_train_end")
        assert all(p.dtype == torch.float32 for p in self.learn.model.parameters())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF)
def test_mixed_precision_state_at_every_event(dtype: torch.dtype, device: str) -> None:
    learn = _cnn_learner(device=device)
    scale = 512.0 if dtype == torch.float16 else None
    learn.add_cb(MixedPrecision(dtype, loss_scale=scale))
    spy = StateSpy(dtype, scale)
    fp32_before = {id(p): p.detach().clone() for p in learn.model.parameters()}
    learn.add_cb(_FirstMasters(fp32_before))
    learn.fit(1, 0.05, callbacks=[spy])
    assert spy.seen == {"on_train_begin", "on_batch_begin", "on_loss_begin", "on_backward_begin",
                        "on_backward_end", "on_step_end", "on_train_end"}
    # after training the model holds the masters' fp32 values, not their half rounding
    half_params = [p for p in learn.model.parameters() if not _is_bn_param(learn.model)[id(p)]]
    for p, master in zip(half_params, spy.last_masters, strict=True):
        assert torch.equal(p, master)


class _FirstMasters(Callback):
    """The masters start from the fp32 weights themselves, not from their rounding to half precision."""

    order = 999

    def __init__(self, fp32_before: dict[int, torch.Tensor]) -> None:
        self.fp32_before = fp32_before

    def on_train_begin(self) -> None:
        for half, master in zip(self.opt.model_params(), self.opt.master_views(), strict=True):
            assert torch.equal(master, self.fp32_before[id(half)])


def test_mixed_precision_equals_the_loop_written_by_hand() -> None:
    """MixedPrecision is an arrangement of GradScaler + MasterWeights: the same steps written out give the
    same weights, bit for bit."""
    steps, lr = 5, 0.05
    learn = _cnn_learner()
    learn.to_fp16(loss_scale=1024.0, dynamic=True, max_noskip=2)

    class StopAfter(Callback):
        def on_batch_end(self) -> None:
            if self.training and self.iteration + 1 == steps:
                from mixprec.callbacks import CancelTrainException

                raise CancelTrainException()

    learn.fit(1, lr, callbacks=[StopAfter()])

    data = mixprec.digits(batch_size=128, seed=0)
    torch.manual_seed(0)
    model = mixprec.build_model("cnn", data)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    fp32 = {id(p): p.detach() for p in model.parameters()}
    model_to_half(model, torch.float16)
    opt = MasterWeights(opt, model=model)
    with torch.no_grad():
        for p, m in zip(opt.model_params(), opt.master_views(), strict=True):
            m.copy_(fp32[id(p)])
    scaler = GradScaler("cpu", init_scale=1024.0, growth_interval=2, max_scale=2.0**24)
    model.train()
    for i, (x, y) in enumerate(data.train):
        if i == steps:
            break
        with half_compute("cpu", torch.float16):
            out = model(x.half())
        loss = nn.functional.cross_entropy(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    masters = list(opt.master_views())
    half_params = [p for p in learn.model.parameters() if not _is_bn_param(learn.model)[id(p)]]
    for p, m in zip(half_params, masters, strict=True):
        assert torch.equal(p, m)
    assert learn.recorder.loss_scales == scaler.scale_history()


@pytest.mark.parametrize("device", DEVICES)
def test_overflow_skips_the_step_and_backs_off(device: str) -> None:
    """A loss scale of 2**23 overflows fp16 (max 65504) in backward: the step is skipped, nothing moves,
    the scale halves; once it is small enough, training proceeds."""
    learn = _cnn_learner(device=device).to_fp16(loss_scale=2.0**23)
    first: list[torch.Tensor] = []

    class Snapshot(Callback):
        order = -100

        def on_batch_begin(self) -> None:
            if self.training and self.iteration == 0:
                first.extend(p.detach().clone() for p in self.learn.model.parameters())

        def on_step_end(self) -> None:
            if self.iteration == 0:
                assert self.learn.step_skipped
                now = self.learn.model.parameters()
                assert all(torch.equal(a, b) for a, b in zip(first, now, strict=True))

    learn.fit(1, 0.05, callbacks=[Snapshot()])
    rec = learn.recorder
    assert rec.skipped[0] and 0 < rec.skipped_steps < len(rec.skipped)
    # the rule: halve after a skipped step, else keep (max_noskip=1000 clean steps are not reached)
    for i in range(len(rec.skipped) - 1):
        assert rec.loss_scales[i + 1] == rec.loss_scales[i] / (2 if rec.skipped[i] else 1)
    assert rec.loss_scales[-1] < 2.0**23 and rec.losses[-1] < rec.losses[rec.skipped.index(False)]


def test_static_scale_stays_fixed() -> None:
    learn = _cnn_learner().to_fp16(loss_scale=256.0, dynamic=False, max_noskip=1)
    learn.fit(1, 0.05)
    assert set(learn.recorder.loss_scales) == {256.0}
    assert learn.scaler is not None and not learn.scaler.is_dynamic


def test_flat_master_trains_like_per_parameter_masters() -> None:
    weights = []
    for flat in (False, True):
        learn = _cnn_learner().to_fp16(flat_master=flat)
        learn.fit(1, 0.05)
        weights.append([p.detach().clone() for p in learn.model.parameters()])
    for a, b in zip(*weights, strict=True):
        assert torch.equal(a, b)


def test_without_master_weights_the_optimizer_updates_half_weights() -> None:
    learn = _cnn_learner()
    mp = MixedPrecision(torch.float16, master_weights=False, keep_bn_fp32=False)
    learn.add_cb(mp)

    class Check(Callback):
        order = 1000

        def on_step_end(self) -> None:
            assert not isinstance(self.opt, MasterWeights)
            assert all(p.dtype == torch.float16 for g in self.opt.param_groups for p in g["params"])

    learn.fit(1, 0.05, callbacks=[Check()])
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())


def test_clip_bounds_the_unscaled_master_gradient_norm() -> None:
    norms: list[float] = []

    class Norm(Callback):
        order = 1000

        def on_backward_end(self) -> None:
            grads = [m.grad for m in self.opt.master_params() if m.grad is not None]
            norms.append(float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))))

    learn = _cnn_learner().to_fp16(clip=0.1)
    learn.fit(1, 0.05, callbacks=[Norm()])
    assert max(norms) <= 0.1 * (1 + 1e-5)


def test_clip_bounds_the_update_of_a_masterweights_the_user_built() -> None:
    """With no MixedPrecision callback to fill the masters, GradientClipping clipped nothing (the masters
    had no gradient yet), then raised once master_params refused that: it now clips through the wrapper."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 4).bfloat16(), torch.randint(0, 2, (32,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    data = mixprec.DataBunch(loader, loader, 2, (4,), "toy")
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).bfloat16()
    learn = Learner(data, model, loss_func=lambda p, t: nn.functional.cross_entropy(p.float(), t),
                    opt_func=lambda params, lr: MasterWeights(torch.optim.SGD(params, lr=lr)), silent=True)
    before = [p.detach().float().clone() for p in model.parameters()]
    learn.fit(steps=1, lr=1.0, callbacks=[mixprec.callbacks.GradientClipping(1e-3)])
    steps = [(m - b).flatten() for m, b in zip(learn.opt.master_views(), before, strict=True)]
    moved = torch.linalg.vector_norm(torch.cat(steps))
    assert 0 < moved <= 1e-3 * (1 + 1e-5)  # lr 1: the update is the clipped gradient


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_mixed_precision_keeps_fp32_weights(device: str) -> None:
    learn = _cnn_learner(device=device)
    learn.add_cb(AutocastMixedPrecision(torch.float16))

    class Check(Callback):
        order = 1000

        def on_loss_begin(self) -> None:
            assert self.xb.dtype == torch.float32 and self.pred.dtype == torch.float32

        def on_backward_end(self) -> None:
            assert all(p.grad.dtype == torch.float32 for p in self.learn.model.parameters())

    learn.fit(1, 0.05, callbacks=[Check()])
    assert learn.scaler is not None and learn.scaler.is_enabled()
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())
    assert learn.recorder.epochs[-1].metric("accuracy") > 0.3


def test_recorder_keeps_one_entry_per_step_and_plots(tmp_path: Path) -> None:
    learn = _cnn_learner().to_fp16()
    learn.fit(2, 0.05)
    rec = learn.recorder
    n = 2 * len(learn.data.train)
    assert len(rec.losses) == len(rec.lrs) == len(rec.loss_scales) == len(rec.skipped) == n
    assert [r.epoch for r in rec.epochs] == [0, 1]
    assert rec.epochs[0].train_loss == pytest.approx(sum(rec.losses[: n // 2]) / (n // 2))
    path = rec.plot_losses(tmp_path / "losses.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_loss_plot_marks_what_it_cannot_draw() -> None:
    """A user trial: after the loss went NaN the curve just stopped, and skipped steps were not shown."""
    from mixprec.callbacks import Recorder

    rec = Recorder()
    rec.losses, rec.skipped = [2.3, 1.9, math.nan, math.inf, math.nan], [True, False, True, True, True]
    rec.loss_scales, rec.epochs = [512.0, 256.0, 128.0, 64.0, 32.0], []
    labels = [t.get_text() for t in rec.loss_figure().axes[0].get_legend().get_texts()]
    assert "loss inf/NaN (3 steps, not drawn)" in labels and "step skipped (4)" in labels
    rec.losses, rec.skipped = [2.3, 1.9], [False, False]
    labels = [t.get_text() for t in rec.loss_figure().axes[0].get_legend().get_texts()]
    assert not any("NaN" in label or "skipped" in label for label in labels)


def test_progress_prints_fastais_results_table() -> None:
    from rich.console import Console

    buffer = io.StringIO()
    data = mixprec.digits(seed=0)
    torch.manual_seed(0)
    learn = Learner(data, mixprec.build_model("mlp", data, n_hidden=32), metrics=[accuracy],
                    console=Console(file=buffer, width=120))
    learn.fit(2)
    lines = buffer.getvalue().strip().splitlines()
    assert lines[0].split() == ["epoch", "train_loss", "valid_loss", "accuracy", "time"]
    rows = [line.split() for line in lines[1:]]
    assert [r[0] for r in rows] == ["0", "1"]
    for row, result in zip(rows, learn.recorder.epochs, strict=True):
        assert float(row[1]) == pytest.approx(result.train_loss, abs=1e-6)
        assert float(row[3]) == pytest.approx(result.metric("accuracy"), abs=1e-6)


def test_a_step_cancelled_before_the_scaler_saw_it_is_not_updated() -> None:
    """A callback ordered before MixedPrecision may cancel the step (CancelStepException); the scaler then
    has no inf check for that iteration and must not be updated, as a plain fp32 run is unaffected."""
    from mixprec.callbacks import CancelStepException

    class SkipOdd(Callback):
        order = 0

        def on_backward_end(self) -> None:
            if self.learn.iteration % 2 == 1:
                raise CancelStepException()

    data = mixprec.digits(batch_size=256, seed=0)
    skipper = SkipOdd()
    learn = Learner(data, mixprec.build_model("cnn", data), silent=True, callbacks=[skipper]).to_fp16()
    learn.fit(1)
    steps = len(data.train)
    assert learn.scaler is not None
    assert len(learn.scaler.scale_history()) == (steps + 1) // 2  # one update per step the scaler checked


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_mixprec_callback_for_follows_the_opt_level_table(level: str) -> None:
    from mixprec.amp import OPT_LEVELS
    from mixprec.callbacks import AutocastMixedPrecision, mixprec_callback_for

    props = OPT_LEVELS[level]
    cb = mixprec_callback_for(props)
    if level == "O0":
        assert cb is None
    elif level == "O1":
        assert isinstance(cb, AutocastMixedPrecision) and cb.dynamic and cb.loss_scale == 2.0**16
    else:
        assert isinstance(cb, MixedPrecision)
        assert cb.master_weights == props.master_weights and cb.keep_bn_fp32 == props.keep_batchnorm_fp32
        assert cb.dynamic == (level == "O2") and cb.loss_scale == (2.0**16 if level == "O2" else 1.0)


def test_amp_o2_masters_start_from_the_fp32_weights() -> None:
    """Both interfaces seed O2 masters from the weights before rounding, not from their fp16 rounding."""
    model = torch.nn.Linear(16, 4)
    fp32 = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _, opt = mixprec.initialize(model, opt, opt_level="O2", verbosity=0)
    try:
        for master, before in zip(opt.master_views(), fp32, strict=True):
            assert torch.equal(master, before)
    finally:
        mixprec.amp.reset()


class _V1Output(Callback):
    """fastai v1's way to change the output: take it as a keyword, return the new one in a dict."""

    def on_loss_begin(self, last_output, **kwargs):  # noqa: ANN001, ANN003, ANN201
        return {"last_output": last_output * 0}


class _V1Stop(Callback):
    def on_epoch_end(self, **kwargs):  # noqa: ANN003, ANN201
        return {"stop_training": True}


class _V1ClassEvent(Callback):
    @classmethod
    def on_epoch_end(cls, last_metrics):  # noqa: ANN001, ANN206
        return None


def test_a_fastai_v1_event_signature_is_refused_when_added_and_named() -> None:
    needle = r"_V1Output.on_loss_begin needs \(last_output\)"
    with pytest.raises(mixprec.ConfigError, match=needle) as e:
        _cnn_learner(callbacks=[_V1Output()])
    assert "last_output -> self.pred" in str(e.value) and "self.learn" in str(e.value)
    with pytest.raises(mixprec.ConfigError, match=r"_V1ClassEvent.on_epoch_end needs \(last_metrics\)"):
        _cnn_learner(callbacks=[_V1ClassEvent()])  # a classmethod's cls is not counted, its argument is


def test_events_callable_without_arguments_are_accepted() -> None:
    """``**kwargs``, ``*args``, defaults, a staticmethod: the loop's call works, so nothing is refused."""

    class Lenient(Callback):
        def on_batch_begin(self, **kwargs) -> None: ...  # noqa: ANN003
        def on_batch_end(self, *args, **kwargs) -> None: ...  # noqa: ANN002, ANN003
        def on_epoch_end(self, verbose: bool = False) -> None: ...

        @staticmethod
        def on_train_begin() -> None: ...

        def on_step_end(self):  # noqa: ANN201
            return self  # not a v1 dict: ignored, as fastai v2 ignores it

    learn = _cnn_learner(callbacks=[Lenient()])
    learn.fit(1)
    assert len(learn.recorder.losses) > 0


def test_a_refused_callback_leaves_no_callback_of_that_fit_attached() -> None:
    learn = _cnn_learner()
    before = [type(cb).__name__ for cb in learn.callbacks]
    with pytest.raises(mixprec.ConfigError, match="fastai v1's event signature"):
        learn.fit_one_cycle(1, callbacks=[_V1Output()])
    assert [type(cb).__name__ for cb in learn.callbacks] == before  # no OneCycleScheduler left behind


def test_a_returned_v1_dict_is_refused_not_dropped() -> None:
    learn = _cnn_learner(callbacks=[_V1Stop()])
    with pytest.raises(mixprec.ConfigError, match=r"_V1Stop.on_epoch_end returned \{'stop_training': True\}"):
        learn.fit(1)
    assert learn.epoch == 0  # it stopped at the end of the first epoch, not after training on


def test_a_v1_dict_from_on_train_end_still_lets_mixed_precision_restore_the_model() -> None:
    class V1End(Callback):
        order = 0  # before MixedPrecision's on_train_end (order 100), which casts the model back

        def on_train_end(self, **kwargs):  # noqa: ANN003, ANN201
            return {"done": True}

    learn = _cnn_learner(callbacks=[V1End()]).to_fp16()
    with pytest.raises(mixprec.ConfigError, match="on_train_end returned"):
        learn.fit(1)
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in learn.model.modules())


def test_the_v2_way_of_the_same_change_works() -> None:
    class ZeroOutput(Callback):
        def on_loss_begin(self) -> None:
            self.learn.pred = self.pred * 0

    learn = _cnn_learner(callbacks=[ZeroOutput()])
    learn.fit(1)
    n_classes = 10  # zero logits: every class equally likely, the loss is log(10) at every batch
    assert all(abs(loss - torch.log(torch.tensor(n_classes)).item()) < 1e-5 for loss in learn.recorder.losses)
