"""The Learner's mixed precision is built from a Recipe: to_fp16/to_bf16 are the presets of mixprec.recipe
(defaults written once, there), to_recipe takes any preset, and each trains as its recipe says."""

from __future__ import annotations

import pytest
import torch

import mixprec
from mixprec.callbacks import AutocastMixedPrecision, Callback, MixedPrecision, callback_for
from mixprec.errors import ConfigError
from mixprec.learner import Learner
from mixprec.master import MasterWeights
from mixprec.recipe import RECIPES, Recipe

pytestmark = pytest.mark.usefixtures("one_thread")


def _learner() -> Learner:
    data = mixprec.synthetic(n=256, input_shape=(16,), n_classes=4, batch_size=64, seed=0)
    torch.manual_seed(0)
    return Learner(data, mixprec.build_model("mlp", data, n_hidden=16), silent=True)


@pytest.mark.parametrize(("switch", "preset"), [("to_fp16", "fp16"), ("to_bf16", "bf16")])
def test_to_fp16_and_to_bf16_are_the_fastai_presets(switch: str, preset: str) -> None:
    mp = getattr(_learner(), switch)().mp_cb
    assert isinstance(mp, MixedPrecision) and mp.recipe == RECIPES[preset]


@pytest.mark.parametrize(("name", "kind"), [("O1", AutocastMixedPrecision), ("O2", MixedPrecision),
                                            ("O3", MixedPrecision), ("fp16-static", MixedPrecision)])
def test_to_recipe_takes_any_half_preset(name: str, kind: type) -> None:
    learn = _learner().to_recipe(name)
    assert type(learn.mp_cb) is kind and learn.mp_cb.recipe == RECIPES[name]
    assert type(callback_for(Recipe.from_opt_level("O1"))) is AutocastMixedPrecision


def test_an_fp32_recipe_removes_mixed_precision() -> None:
    learn = _learner().to_fp16().to_recipe("fp32")
    assert learn.mp_cb is None and not any(isinstance(c, MixedPrecision) for c in learn.callbacks)
    with pytest.raises(ConfigError, match="is fp32"):
        MixedPrecision(recipe=RECIPES["O0"])


class _Watch(Callback):
    order = 1000

    def on_step_end(self) -> None:
        self.opt_type = type(self.opt)
        self.dtypes = {p.dtype for p in self.learn.model.parameters()}


@pytest.mark.parametrize(
    ("name", "masters", "dtypes"),
    [("O2", True, {torch.float16}), ("O3", False, {torch.float16}), ("O1", False, {torch.float32})],
)
def test_each_recipe_trains_as_it_says(name: str, masters: bool, dtypes: set[torch.dtype]) -> None:
    learn = _learner().to_recipe(name)
    watch = _Watch()
    learn.fit(steps=2, callbacks=[watch])
    assert (watch.opt_type is MasterWeights) == masters
    assert watch.dtypes == dtypes  # the mlp has no BatchNorm: every parameter in the model dtype
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())  # restored after the fit
    assert learn.recorder.loss_scales[0] == RECIPES[name].scale.init_scale


class _NaNBatch(Callback):
    """Batch 2 is NaN (one corrupt sample would do); records BatchNorm's buffers around that iteration."""

    order = -50  # before MixedPrecision casts the batch

    def __init__(self) -> None:
        self.before: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []

    def _buffers(self) -> list[torch.Tensor]:
        return [b.detach().clone() for b in self.learn.model.buffers()]

    def on_batch_begin(self) -> None:
        if self.training and self.iteration == 2:
            self.before = self._buffers()
            self.learn.xb = torch.full_like(self.xb, float("nan"))

    def on_batch_end(self) -> None:
        if self.training and self.iteration == 2:
            self.after = self._buffers()


@pytest.mark.parametrize("name", ["fp16", "O2"])
def test_a_skipped_step_leaves_batchnorm_statistics_as_they_were(name: str) -> None:
    data = mixprec.digits(batch_size=256, seed=0)
    torch.manual_seed(0)
    learn = Learner(data, mixprec.build_model("cnn", data), silent=True).to_recipe(name)
    nan = _NaNBatch()
    learn.fit(steps=4, callbacks=[nan])
    assert learn.recorder.skipped == [False, False, True, False]
    assert nan.before and all(torch.equal(a, b) for a, b in zip(nan.before, nan.after, strict=True))
    assert all(torch.isfinite(b).all() for b in learn.model.buffers())  # not NaN for the rest of the run


class _MasterGradsSpy(Callback):
    kept: bool | None = None

    def on_step_end(self) -> None:
        self.kept = self.opt.keeps_master_grads


def test_a_bf16_recipe_without_master_grads_trains_as_with_them() -> None:
    # The Learner builds its MasterWeights from the recipe. master_grads=False (16 bytes per parameter with
    # Adam) runs torch's fused kernel on the same fp32 values: unclipped, the weights agree bit for bit.
    # Clipped, the clip scales the bf16 gradients the step reads instead of fp32 copies: within bf16
    # rounding of the clipped run with master gradients, and away from the unclipped one.
    recipe, lean = RECIPES["bf16"], RECIPES["bf16"].replace(master_grads=False)
    runs, kept = {}, {}
    for key, r, clip in (("fp32 grads", recipe, None), ("half grads", lean, None),
                         ("fp32 grads, clipped", recipe, 0.05), ("half grads, clipped", lean, 0.05)):
        learn, spy = _learner().to_recipe(r, clip=clip), _MasterGradsSpy()
        learn.fit(steps=4, callbacks=[spy])
        runs[key], kept[key] = [p.detach().clone() for p in learn.model.parameters()], spy.kept
    assert kept == {"fp32 grads": True, "half grads": False, "fp32 grads, clipped": True,
                    "half grads, clipped": False}
    for a, b in zip(runs["fp32 grads"], runs["half grads"], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(runs["fp32 grads, clipped"], runs["half grads, clipped"], strict=True):
        torch.testing.assert_close(b, a, rtol=2**-7, atol=2**-7)
    assert not all(torch.equal(a, b) for a, b in zip(runs["half grads"], runs["half grads, clipped"],
                                                       strict=True))


class _Observe(Callback):
    """Mid-fit (before MixedPrecision's on_train_end casts the model back): the optimizer the fit steps,
    its footprint, and its fp32 masters' values as the fit ends."""

    order = 50

    def __init__(self) -> None:
        self.opt: object = None
        self.per_param = 0.0
        self.values: list[torch.Tensor] = []

    def on_step_end(self) -> None:
        from mixprec.low_precision import footprint

        self.opt = self.learn.opt
        self.per_param = footprint(self.learn.opt).per_param

    def on_train_end(self) -> None:
        opt = self.learn.opt
        masters = opt.master_values() if hasattr(opt, "master_values") else opt.master_views()
        self.values = [v.detach().clone() for v in masters]


def test_a_split_recipe_trains_the_learner_on_split_masters_and_ends_on_their_fp32_values() -> None:
    """The reference: the same fit with O2's fp32 MasterWeights; the fit's end gives the model its
    masters' exact fp32 values (not the bf16 weights')."""
    from mixprec.low_precision import LowPrecisionOptimizer

    o2 = Recipe.from_opt_level("O2", torch.bfloat16)
    runs = {}
    for split in (False, True):
        learn = _learner().to_recipe(o2.replace(split_masters=split))
        seen = _Observe()
        learn.fit(2, lr=1e-2, callbacks=[seen])
        assert all(p.dtype == torch.float32 for p in learn.model.parameters())
        assert all(torch.equal(p, v) for p, v in zip(learn.model.parameters(), seen.values, strict=True))
        runs[split] = (seen, [p.detach().clone() for p in learn.model.parameters()])
    (o2_seen, o2_weights), (split_seen, split_weights) = runs[False], runs[True]
    assert isinstance(split_seen.opt, LowPrecisionOptimizer) and isinstance(o2_seen.opt, MasterWeights)
    assert split_seen.per_param == pytest.approx(14.0)  # bf16 weight, grad, low half, Adam's fp32 moments
    for a, b in zip(split_weights, o2_weights, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # the same masters, to a few fp32 ulps


class _SaveFirstLoadLast(Callback):
    """Saves ``model.state_dict()`` after the first epoch and loads it back after the last (a best epoch's
    weights), with the masters' fp32 values when saved."""

    order = 50

    def __init__(self, epochs: int) -> None:
        self.epochs, self.saved, self.masters = epochs, {}, []

    def on_epoch_end(self) -> None:
        from mixprec.amp import split_master_values

        if self.epoch == 0:
            self.saved = {k: v.clone() for k, v in self.learn.model.state_dict().items()}
            values = split_master_values(self.learn.opt, set(self.learn.model.parameters()))
            self.masters = [values[id(p)] for p in self.learn.model.parameters()]
        if self.epoch == self.epochs - 1:
            self.learn.model.load_state_dict(self.saved)


def test_a_split_fit_saves_and_loads_the_model_on_its_exact_fp32_masters() -> None:
    """Mid-fit, the model's state dict held the bf16 weights and a load set only them: the best epoch's
    weights came back within half a bf16 spacing, with the last epoch's low halves. Now as after
    initialize: the state dict is the masters, and loading it back ends the fit on them exactly."""
    split = Recipe.from_opt_level("O2", torch.bfloat16).replace(split_masters=True)
    learn = _learner().to_recipe(split)
    cb = _SaveFirstLoadLast(epochs=2)
    learn.fit(2, lr=1e-2, callbacks=[cb])
    names = [n for n, _ in learn.model.named_parameters()]
    assert any(not torch.equal(m, m.bfloat16().float()) for m in cb.masters)  # low halves to lose
    assert all(torch.equal(cb.saved[n], m) for n, m in zip(names, cb.masters, strict=True))
    assert all(torch.equal(p, m) for p, m in zip(learn.model.parameters(), cb.masters, strict=True))


def test_a_split_recipe_refuses_batchnorm_kept_fp32_before_the_fit_casts_the_model() -> None:
    data = mixprec.synthetic(n=128, input_shape=(8,), n_classes=4, batch_size=32, seed=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    split = Recipe.from_opt_level("O2", torch.bfloat16).replace(split_masters=True)
    learn = Learner(data, model, silent=True).to_recipe(split)
    with pytest.raises(ConfigError, match="keep_batchnorm_fp32=False"):
        learn.fit(1)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    learn.to_recipe(split.replace(keep_batchnorm_fp32=False)).fit(1)  # bf16 BatchNorm: trains
    assert all(p.dtype == torch.float32 for p in model.parameters())  # cast back at the fit's end


def test_a_fit_refused_for_split_masters_leaves_the_weights_it_was_given() -> None:
    """After a split fit, weights loaded into the model and a fit refused (its optimizer holds a tensor the
    cast leaves fp32): the refusal came after the cast, and the fit's end rebuilt the loaded weights with
    the previous fit's low halves. Now it comes first and the model keeps exactly what was loaded."""
    split = Recipe.from_opt_level("O2", torch.bfloat16).replace(split_masters=True)
    learn = _learner().to_recipe(split)
    learn.fit(1, lr=1e-2)
    torch.manual_seed(1)
    loaded = {k: torch.randn_like(v) for k, v in learn.model.state_dict().items()}
    learn.model.load_state_dict(loaded)
    temperature = torch.nn.Parameter(torch.ones(()))  # not the model's: stays fp32
    learn.opt_func = lambda params, lr: torch.optim.AdamW([*params, temperature], lr=lr)
    with pytest.raises(ConfigError, match="no fp32 parameter of the model"):
        learn.fit(1, lr=1e-2)
    assert all(torch.equal(v, loaded[k]) for k, v in learn.model.state_dict().items())


class _EditFrozen(Callback):
    """Mid-fit, writes a new value into one frozen parameter (as a user's callback may): that value, not
    the kept original, is what the fit's end must leave."""

    def on_step_end(self) -> None:
        if self.learn.iteration == 1:
            with torch.no_grad():
                self.learn.model[1].bias.fill_(0.5)


@pytest.mark.parametrize("recipe", [RECIPES["fp16"], RECIPES["bf16"],
                                    Recipe.from_opt_level("O2", torch.bfloat16).replace(split_masters=True),
                                    RECIPES["O3"]], ids=["to_fp16", "to_bf16", "split masters", "O3"])
def test_a_fit_leaves_frozen_parameters_and_constant_buffers_exactly_as_they_were(recipe: Recipe) -> None:
    """A fit casts the whole model to half; what no optimizer trains (a frozen first layer, a constant
    buffer) went back rounded to the half dtype (4 in 8 bf16 bits of precision lost, for good) before the
    fit's end gave back the kept fp32 originals."""
    data = mixprec.synthetic(n=256, input_shape=(16,), n_classes=4, batch_size=64, seed=0)
    torch.manual_seed(0)
    model = mixprec.build_model("mlp", data, n_hidden=16)
    model.register_buffer("table", torch.randn(7) / 3)  # not exact in any half dtype
    for p in model[1].parameters():
        p.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_func = lambda ps, lr: torch.optim.AdamW([p for p in ps if p.requires_grad], lr=lr)  # noqa: E731
    learn = Learner(data, model, silent=True, opt_func=opt_func).to_recipe(recipe)
    learn.fit(1)
    after = model.state_dict()
    assert all(after[k].dtype == torch.float32 for k in before)
    for k in ("1.weight", "1.bias", "table"):
        assert torch.equal(after[k], before[k]), k
    assert not torch.equal(after["3.weight"], before["3.weight"])  # the trained layer trained
    # the default optimizer holds the frozen layer too (fastai's): with or without masters, the same
    Learner(data, model, silent=True).to_recipe(recipe).fit(1)
    for k in ("1.weight", "1.bias", "table"):
        assert torch.equal(model.state_dict()[k], before[k]), k
    learn.fit(1, callbacks=[_EditFrozen()])  # a frozen value changed mid-fit is kept as changed
    assert torch.equal(model[1].bias, torch.full_like(model[1].bias, 0.5))
    assert torch.equal(model[1].weight, before["1.weight"])


def test_the_callbacks_repr_names_a_split_layout_the_presets_words_do_not() -> None:
    o2 = Recipe.from_opt_level("O2", torch.bfloat16)
    assert "split" not in repr(MixedPrecision(recipe=o2))
    assert "int16 low half" in repr(MixedPrecision(recipe=o2.replace(split_masters=True)))
