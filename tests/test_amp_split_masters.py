"""``mixprec.initialize(..., "O2", dtype=torch.bfloat16, split_masters=True)``: O2's fp32 masters held as
the bf16 weights plus int16 low halves (LowPrecisionOptimizer "split").

References: O2's MasterWeights (the same fp32 masters in fp32 tensors; the split step's native loop rounds
its sqrt correctly where torch's CPU sqrt is one ulp off now and then, so a few fp32 ulps apart), the
same wrapper built by hand as docs/low-precision.md's recipe does (bit for bit), and the exact fp32 values
the model was cast from."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import mixprec
from mixprec.errors import ConfigError
from mixprec.low_precision import LowPrecisionOptimizer, footprint

pytestmark = pytest.mark.usefixtures("fresh_amp_state")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 4,
           poison: Callable[[int, nn.Module], None] | None = None) -> None:
    for i, (x, y) in enumerate(_batches(steps)):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        with mixprec.scale_loss(loss, opt) as scaled:
            scaled.backward()
            if poison is not None:
                poison(i, model)
        opt.step()


def _initialize(model: nn.Module, **options: object) -> tuple[nn.Module, torch.optim.Optimizer]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "initialize was called again"
        return mixprec.initialize(model, opt, "O2", dtype=torch.bfloat16, verbosity=0, **options)


def test_split_masters_are_o2s_masters_in_14_bytes_per_parameter() -> None:
    o2_model, o2 = _initialize(_model())
    _train(o2_model, o2)
    want = [m.detach().clone() for m in o2.master_views()]  # type: ignore[attr-defined]
    mixprec.amp.reset()
    model, opt = _initialize(_model(), split_masters=True)
    assert isinstance(opt, LowPrecisionOptimizer)
    _train(model, opt)
    for got, ref in zip(opt.master_values(), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)  # a few fp32 ulps of values ~0.1-1
    assert footprint(opt).per_param == pytest.approx(14.0)  # bf16 weight 2 + grad 2 + low 2 + Adam 8


def test_split_masters_are_the_hand_built_recipe_bit_for_bit() -> None:
    """docs/low-precision.md's recipe before this option: O2 without masters, then the wrapper seeded with
    the fp32 weights."""
    model = _model()
    fp32 = {p: p.detach().clone() for p in model.parameters()}
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model, plain = mixprec.initialize(model, plain, "O2", dtype=torch.bfloat16, master_weights=False,
                                          verbosity=0)
    by_hand = LowPrecisionOptimizer(plain, "split", initial={p: fp32[q] for p, q in
                                                              zip(model.parameters(), fp32, strict=True)})
    for (x, y) in _batches(4):
        by_hand.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        by_hand.step()
    want = [v.clone() for v in by_hand.master_values()]
    mixprec.amp.reset()
    ours_model, ours = _initialize(_model(), split_masters=True)
    _train(ours_model, ours)
    for got, ref in zip(ours.master_values(), want, strict=True):  # type: ignore[attr-defined]
        assert torch.equal(got, ref)


def test_an_overflowing_step_is_skipped_and_keeps_the_low_halves() -> None:
    model, opt = _initialize(_model(), split_masters=True)
    _train(model, opt, steps=2)
    before = [v.clone() for v in opt.master_values()]  # type: ignore[attr-defined]

    def poison(i: int, m: nn.Module) -> None:
        m[0].weight.grad[0, 0] = float("nan")  # bf16's static scale of 1 still checks every step

    _train(model, opt, steps=1, poison=poison)
    assert all(torch.equal(a, b) for a, b in zip(before, opt.master_values(), strict=True))  # type: ignore[attr-defined]
    _train(model, opt, steps=1)
    assert not all(torch.equal(a, b) for a, b in zip(before, opt.master_values(), strict=True))  # type: ignore[attr-defined]


def test_restore_gives_the_model_its_exact_fp32_masters() -> None:
    model, opt = _initialize(_model(), split_masters=True)
    _train(model, opt)
    values = [v.clone() for v in opt.master_values()]  # type: ignore[attr-defined]
    assert any(not torch.equal(v, p.float()) for v, p in zip(values, model.parameters(), strict=True))
    mixprec.amp.restore(model)
    for p, v in zip(model.parameters(), values, strict=True):
        assert p.dtype == torch.float32 and torch.equal(p, v)  # not the bf16 weights' values


def test_the_banner_says_split_masters() -> None:
    lines = mixprec.apex_properties.banner(
        mixprec.recipe.Recipe.from_opt_level("O2", torch.bfloat16).replace(split_masters=True), 1)
    assert lines[-1] == ("mixprec master step: split_masters=True (the fp32 masters held as the bf16 weights "
                         "+ int16 low halves)")


@pytest.mark.parametrize(
    ("opt_level", "options", "needle"),
    [
        ("O1", {}, "keeps no fp32 master weights"),
        ("O3", {}, "keeps no fp32 master weights"),
        ("O2", {"master_weights": False}, "keeps no fp32 master weights"),
        ("O2", {"dtype": torch.float16}, "not an fp32's top half"),
        ("O2", {"master_grads": False}, "master_grads=False/compile_step=True"),
    ],
)
def test_split_masters_outside_o2_bf16_is_refused_with_what_is_missing(
    opt_level: str, options: dict, needle: str
) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    settings = {"dtype": torch.bfloat16, **options}
    with pytest.raises(ConfigError, match=needle):
        mixprec.initialize(model, opt, opt_level, split_masters=True, verbosity=0, **settings)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # refused before anything changed


def test_a_model_with_batchnorm_is_refused_before_it_is_cast_and_trains_with_bf16_batchnorm() -> None:
    """O2 keeps BatchNorm's parameters fp32, which the split layout cannot hold: the wrapper refused them
    after initialize had already cast the model. Now the refusal comes first and names the fix."""
    def bn_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))

    model = bn_model()
    with pytest.raises(ConfigError, match="keep_batchnorm_fp32=False"):
        _initialize(model, split_masters=True)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # untouched
    model, opt = _initialize(bn_model(), split_masters=True, keep_batchnorm_fp32=False)
    before = [v.clone() for v in opt.master_values()]  # type: ignore[attr-defined]
    _train(model, opt, steps=2)
    assert all(not torch.equal(a, b) for a, b in zip(before, opt.master_values(), strict=True))  # type: ignore[attr-defined]


def test_a_module_marked_keep_fp32_is_refused_before_the_cast_naming_the_mark() -> None:
    model = _model()
    mixprec.keep_fp32(model[2])
    with pytest.raises(ConfigError, match="Linear is marked with mixprec.keep_fp32"):
        _initialize(model, split_masters=True)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # untouched


def test_restore_of_two_models_of_one_initialize_gives_each_its_own_masters() -> None:
    """restore read every split optimizer's values, also a model already restored (fp32 again), and the
    second restore failed on its weights' size."""
    torch.manual_seed(0)
    a, b = nn.Linear(8, 8), nn.Linear(8, 4)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b)]
    (a, b), opts = mixprec.initialize([a, b], opts, "O2", dtype=torch.bfloat16, split_masters=True,
                                      verbosity=0)
    x = torch.randn(16, 8)
    for _ in range(2):
        for o in opts:
            o.zero_grad()
        with mixprec.scale_loss(b(a(x)).float().square().mean(), opts) as scaled:
            scaled.backward()
        for o in opts:
            o.step()
    want = [[v.clone() for v in o.master_values()] for o in opts]
    for model, values in zip((a, b), want, strict=True):
        mixprec.amp.restore(model)
        assert all(torch.equal(p, v) for p, v in zip(model.parameters(), values, strict=True))


class _Larc:
    """apex's LARC's shape (tests/test_amp.py has the full one): the optimizer in ``.optim``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optim = optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optim.param_groups

    def step(self) -> None:
        self.optim.step()


@pytest.mark.parametrize("split", [True, False])
def test_broadcast_masters_sends_what_completes_the_masters_also_channels_last_and_behind_larc(
    split: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 takes rank 0's bytes (the collective stood in for: one process here). A channels_last
    conv's weights and low halves are not one contiguous view (view(-1) failed); a LARC-style wrapper
    made broadcast_masters a silent no-op."""
    from mixprec import distributed

    def build(seed: int) -> tuple[nn.Module, object]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 2))
        model = model.to(memory_format=torch.channels_last)
        larc = _Larc(torch.optim.AdamW(model.parameters(), lr=1e-2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return mixprec.initialize(model, larc, "O2", dtype=torch.bfloat16, split_masters=split,
                                      verbosity=0)

    def values(opt: object) -> list[torch.Tensor]:
        inner = opt.optim  # type: ignore[attr-defined]
        return [v.clone() for v in (inner.master_values() if split else inner.master_views())]

    sent: list[torch.Tensor] = []
    monkeypatch.setattr(distributed.dist, "broadcast", lambda flat, src: sent.append(flat.clone()))
    _, rank0 = build(0)
    distributed.broadcast_masters(rank0)  # rank 0: its bytes go out
    monkeypatch.setattr(distributed.dist, "broadcast", lambda flat, src: flat.copy_(sent[0]))
    model1, rank1 = build(1)
    assert not all(torch.equal(a, b) for a, b in zip(values(rank0), values(rank1), strict=True))
    distributed.broadcast_masters(rank1)  # rank 1: takes them
    assert len(sent) == 1
    assert all(torch.equal(a, b) for a, b in zip(values(rank0), values(rank1), strict=True))
    assert model1[0].weight.is_contiguous(memory_format=torch.channels_last)  # its layout kept


def test_a_scheduler_built_before_initialize_does_not_warn_when_the_first_step_is_skipped() -> None:
    """apex's order (optimizer, scheduler, then initialize) and a first step skipped for a NaN: the split
    wrapper returned without the wrapped optimizer's step, and torch warned that the scheduler stepped
    first."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.9**i)
    model, opt = mixprec.initialize(model, opt, "O2", dtype=torch.bfloat16, split_masters=True, verbosity=0)

    def poison(i: int, m: nn.Module) -> None:
        m[0].weight.grad[0, 0] = float("nan")

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _train(model, opt, steps=1, poison=poison)
        schedule.step()
        _train(model, opt, steps=1)
        schedule.step()


def test_an_optimizer_the_split_layout_cannot_step_is_refused_before_the_model_is_cast() -> None:
    model = _model()
    opt = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ConfigError, match="LBFGS"):
        mixprec.initialize(model, opt, "O2", dtype=torch.bfloat16, split_masters=True, verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert getattr(model, "_mixprec_opt_level", None) is None  # initialize can be called again


def test_a_sparse_gradient_table_is_refused_before_the_model_is_cast() -> None:
    """O2 keeps an EmbeddingBag(sparse=True) fp32 (its own master), which the split layout cannot hold: the
    wrapper's refusal came after the cast, naming neither the table nor the fix."""
    model = nn.Sequential(nn.EmbeddingBag(20, 8, mode="sum", sparse=True), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"(?s)EmbeddingBag built with sparse=True.*split_masters=False"):
        mixprec.initialize(model, opt, "O2", dtype=torch.bfloat16, split_masters=True, verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def _bits_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b, strict=True))


def test_the_model_state_dict_holds_the_exact_fp32_masters_not_the_bf16_weights() -> None:
    model, opt = _initialize(_model(), split_masters=True)
    _train(model, opt)
    saved = model.state_dict()
    masters = opt.master_values()  # type: ignore[attr-defined]
    assert all(v.dtype == torch.float32 for v in saved.values())  # apex O2's contract: fp32 tensors
    assert _bits_equal(list(saved.values()), masters)
    assert not _bits_equal(list(saved.values()), [p.float() for p in model.parameters()])  # not rounded
    mixprec.amp.restore(model)  # the same values an fp32 model gets back
    assert _bits_equal(list(saved.values()), [p.detach() for p in model.parameters()])


def test_fp32_weights_loaded_after_initialize_are_the_masters_as_if_loaded_before() -> None:
    """Reference: the same fp32 weights loaded into the fp32 model before initialize (the masters start
    at them exactly). Before, the load wrote only the bf16 weights and each master kept its old low half.
    The weights include ties between two bf16 values (the split layout rounds those away from zero)."""
    pretrained = {k: v + 0.01 * torch.randn_like(v) for k, v in _model().state_dict().items()}
    one = torch.tensor(1.0 + 2.0**-8)  # halfway between bf16's 1.0 and 1.0078125
    pretrained["0.bias"][:2] = torch.stack([one, -one])
    before = _model()
    before.load_state_dict(pretrained)
    ref_model, ref = _initialize(before, split_masters=True)
    assert _bits_equal(ref.master_values(), list(pretrained.values()))  # type: ignore[attr-defined]
    _train(ref_model, ref)
    model, opt = _initialize(_model(), split_masters=True)
    _train(model, opt, steps=1)  # low halves of a trained model, which the load must not keep
    model.load_state_dict(pretrained)
    assert _bits_equal(opt.master_values(), list(pretrained.values()))  # type: ignore[attr-defined]
    assert model[0].bias[0].item() == 1.0078125 and model[0].bias[1].item() == -1.0078125  # away from 0
    opt.state.clear()  # Adam's moments and step counts as a new run's
    _train(model, opt)
    assert _bits_equal(opt.master_values(), ref.master_values())  # type: ignore[attr-defined]


@pytest.mark.parametrize("model_first", [True, False])
def test_a_checkpoint_resumes_bit_for_bit_whichever_state_is_loaded_first(model_first: bool) -> None:
    """The model's state now carries the exact masters and the optimizer's the same low halves: either
    order gives the saved pairs (a load that kept the new model's low halves, or split the model's rounded
    weights, would lose them in one of the two)."""
    model, opt = _initialize(_model(), split_masters=True)
    _train(model, opt, steps=2)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})  # torch's hold live moments
    _train(model, opt, steps=2)
    want = [v.clone() for v in opt.master_values()]  # type: ignore[attr-defined]
    torch.manual_seed(5)  # another start: nothing of it may survive the loads
    resumed, ropt = _initialize(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)),
                                split_masters=True)
    loads = [lambda: resumed.load_state_dict(saved["model"]), lambda: ropt.load_state_dict(saved["opt"])]
    for load in loads if model_first else loads[::-1]:
        load()
    _train(resumed, ropt, steps=2)
    assert _bits_equal(ropt.master_values(), want)  # type: ignore[attr-defined]


def test_the_state_dict_hooks_come_off_with_restore() -> None:
    model, opt = _initialize(_model(), split_masters=True)
    _train(model, opt, steps=1)
    mixprec.amp.restore(model)
    values = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(values)  # an fp32 model now: the values as they are, not split
    assert _bits_equal([p.detach() for p in model.parameters()], list(values.values()))


def test_a_checkpoint_of_bf16_weights_loaded_after_the_optimizers_state_keeps_its_low_halves() -> None:
    """From a review: a checkpoint written before the model's state held the masters (the bf16 weights, as
    fp32) and loaded optimizer-first lost every low half to the model's load. A value that is the weight
    the model holds already keeps its low half; one that is not (model first) is taken exactly."""
    model, opt = _initialize(_model(), split_masters=True)
    _train(model, opt, steps=2)
    old = copy.deepcopy({"model": {k: p.detach().float() for k, p in model.named_parameters()},
                         "opt": opt.state_dict()})
    want = [v.clone() for v in opt.master_values()]  # type: ignore[attr-defined]
    for model_first in (False, True):
        torch.manual_seed(5)
        resumed, ropt = _initialize(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)),
                                    split_masters=True)
        if model_first:
            resumed.load_state_dict(old["model"])
        ropt.load_state_dict(old["opt"])
        if not model_first:
            resumed.load_state_dict(old["model"])
        assert _bits_equal(ropt.master_values(), want), f"model_first={model_first}"  # type: ignore[attr-defined]
    _train(resumed, ropt, steps=1)
    values = {k: torch.randn_like(v).bfloat16().float() for k, v in old["model"].items()}  # bf16 weights
    resumed.load_state_dict(values)  # after a step (pretrained, say): the masters, exactly, low halves 0
    assert _bits_equal(ropt.master_values(), list(values.values()))  # type: ignore[attr-defined]


def test_a_param_group_added_after_initialize_saves_and_loads_its_masters() -> None:
    """From a review: the hooks took their parameters once, at initialize; a group added later (a layer
    unfrozen) was saved as its bf16 weights and loaded into the high halves only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    model, opt = mixprec.initialize(model, torch.optim.AdamW(model[0].parameters(), lr=1e-2), "O2",
                                    dtype=torch.bfloat16, split_masters=True, verbosity=0)
    opt.add_param_group({"params": list(model[2].parameters())})
    _train(model, opt, steps=3)
    saved = model.state_dict()
    assert _bits_equal([saved["2.weight"], saved["2.bias"]], opt.master_values(list(model[2].parameters())))
    values = {k: torch.randn_like(v) for k, v in saved.items()}
    model.load_state_dict(values)
    assert _bits_equal(opt.master_values(), list(values.values()))  # type: ignore[attr-defined]


def test_an_old_checkpoint_of_two_models_with_one_optimizer_resumes_optimizer_first() -> None:
    """From a review: the first model's load marked every low half as met, and the second model's bf16
    weights then set low halves of 0. Each weight's low half now awaits that weight's own load."""
    def build(seed: int) -> tuple[list[nn.Module], torch.optim.Optimizer]:
        torch.manual_seed(seed)
        a, b = nn.Linear(8, 8), nn.Linear(8, 4)
        opt = torch.optim.AdamW([*a.parameters(), *b.parameters()], lr=1e-2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return mixprec.initialize([a, b], opt, "O2", dtype=torch.bfloat16, split_masters=True,
                                      verbosity=0)

    (a, b), opt = build(0)
    x = torch.randn(16, 8)
    for _ in range(2):
        opt.zero_grad()
        with mixprec.scale_loss(b(a(x)).float().square().mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    old = copy.deepcopy({"a": {k: p.detach().float() for k, p in a.named_parameters()},
                         "b": {k: p.detach().float() for k, p in b.named_parameters()},
                         "opt": opt.state_dict()})
    want = [v.clone() for v in opt.master_values()]  # type: ignore[attr-defined]
    (a2, b2), opt2 = build(5)
    opt2.load_state_dict(old["opt"])
    a2.load_state_dict(old["a"])
    b2.load_state_dict(old["b"])
    assert _bits_equal(opt2.master_values(), want)  # type: ignore[attr-defined]
