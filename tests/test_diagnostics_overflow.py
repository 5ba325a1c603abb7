"""mixprec.diagnostics.overflow: non-finite gradients by name, the first module whose output overflowed."""

from __future__ import annotations

import re
from collections import OrderedDict

import pytest
import torch
from torch import nn

from mixprec.diagnostics import overflow
from mixprec.diagnostics.overflow import (
    NonfiniteTracer,
    finite_flags,
    nonfinite_grads,
    nonfinite_report,
    tensor_range,
    trace_nonfinite,
)
from mixprec.errors import ConfigError

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]
FP16_MAX = torch.finfo(torch.float16).max


def _model(device: str = "cpu") -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict([
        ("layer1", nn.Linear(8, 16)),
        ("act1", nn.ReLU()),
        ("layer2", nn.Linear(16, 16)),
        ("act2", nn.ReLU()),
        ("layer3", nn.Linear(16, 16)),
        ("head", nn.Linear(16, 4)),
    ])).to(device)


def _input(device: str = "cpu") -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to(device)


def _plant_overflow(model: nn.Sequential) -> None:
    # layer3's outputs reach ~1e5 > 65504, while its weights (<= 7.5e3) and every earlier output stay
    # well inside fp16's range.
    with torch.no_grad():
        model.layer2.weight.mul_(10.0)
        model.layer3.weight.mul_(3e4)


@pytest.mark.parametrize("device", DEVICES)
def test_tracer_names_the_layer_that_overflowed_in_fp16(device: str) -> None:
    model = _model(device)
    _plant_overflow(model)
    reference = model.layer3(model[:4](_input(device))).abs().max().item()  # fp32: finite, > fp16 max
    assert reference > FP16_MAX
    half = model.half()
    with trace_nonfinite(half) as tracer:
        half(_input(device).half())
    event = tracer.event
    assert event is not None and event.module == "layer3" and event.module_type == "Linear"
    assert event.inputs_finite and not event.outputs[0].finite and event.outputs[0].dtype == torch.float16
    assert event.fp32_outputs is not None and event.fp32_outputs[0].finite
    # The fp32 re-run used the fp16 weights and inputs upcast, so it differs from the reference only by
    # their rounding.
    assert event.fp32_outputs[0].max_abs == pytest.approx(reference, rel=1e-2)
    text = event.explain()
    assert "layer3" in text and "overflowed in float16" in text and "65504" in text
    # The fp32 maximum once, named as fp32's (it read "(max |x| 1.28e+05 > 65504); in fp32 max |x| was
    # 1.28e+05"), and the count of infs the half output holds (reference: the half model's own output).
    fp32_max = f"{event.fp32_outputs[0].max_abs:.3g}"
    assert text.count(fp32_max) == 1 and f"fp32 re-run is finite with max |x| {fp32_max}, above" in text
    n_inf = int(half[:5](_input(device).half()).isinf().sum())
    assert f"overflowed in float16 ({n_inf:,} inf)" in text
    assert "mixprec.keep_fp32(module)" in text  # the fix named as a user calls it (a trial's ask)
    assert "layer3" in tracer.report()
    assert half.layer3.weight.dtype == torch.float16  # the re-run used a copy


def test_tracer_under_autocast() -> None:
    model = _model()
    _plant_overflow(model)
    with torch.autocast("cpu", dtype=torch.float16), trace_nonfinite(model) as tracer:
        model(_input())
    assert tracer.event is not None and tracer.event.module == "layer3"
    assert tracer.event.fp32_outputs is not None and tracer.event.fp32_outputs[0].finite


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_inf_planted_in_a_weight_is_not_a_precision_problem(dtype: torch.dtype) -> None:
    model = _model().to(dtype)
    with torch.no_grad():
        model.layer2.weight[0, 0] = float("inf")
    with trace_nonfinite(model) as tracer:
        model(_input().to(dtype))
    event = tracer.event
    assert event is not None and event.module == "layer2"
    assert event.fp32_outputs is not None and not event.fp32_outputs[0].finite
    assert "fp32 too" in event.explain()


def test_non_finite_made_between_modules_is_reported_as_such() -> None:
    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.log(self.a(x) * 0 - 1))  # log(-1) = NaN, outside any module

    model = Parent()
    with trace_nonfinite(model) as tracer:
        model(torch.randn(2, 4))
    assert tracer.event is not None and tracer.event.module == "b"
    # no fp32 re-run: the input was non-finite already, fp32 would only repeat it
    assert not tracer.event.inputs_finite and tracer.event.fp32_outputs is None
    said = tracer.event.explain()
    assert "received non-finite input" in said
    assert "between a (Linear)'s output and b (Linear)'s input" in said and "<model> (Parent)" in said


def test_a_container_that_only_passes_the_value_on_is_not_named_as_its_maker() -> None:
    """A trial's CapsNet: the NaN its forward made reached decoder.0 through the Sequential decoder, and the
    report named the code in "the forward of decoder (Sequential)", the first receiver's parent. The maker
    is the innermost forward that ran from a's output to decoder.0's input: the model's, or the block's."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.decoder = nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.ReLU())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.decoder(h / (h - h))  # 0/0, in this forward

    model = nn.Sequential(nn.Linear(4, 4), Block())
    with trace_nonfinite(model) as tracer:
        model(torch.randn(2, 4))
    assert tracer.event is not None and tracer.event.module == "1.decoder.0.0"
    assert "by code in the forward of 1 (Block)" in tracer.event.explain()
    with trace_nonfinite(model) as tracer:  # made before any module returned: the model's own forward
        model(torch.full((2, 4), float("nan")))
    assert "before 0 (Linear)" in tracer.event.explain() and "<model> (Sequential)" in tracer.event.explain()


def test_a_module_that_had_returned_is_not_named_as_the_maker() -> None:
    """A review: the model called encoder, made the NaN itself, then called encoder.norm; the report named
    encoder's forward, which had ended."""

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.lin(x))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = Encoder()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.encoder(x)
            return self.encoder.norm(h / (h - h))

    model = Model()
    with trace_nonfinite(model) as tracer:
        model(torch.randn(2, 4))
    assert tracer.event is not None and tracer.event.module == "encoder.norm"
    assert "by code in the forward of <model> (Model)" in tracer.event.explain()


def test_finite_forward_reports_nothing_and_hooks_are_removed() -> None:
    model = _model()
    with NonfiniteTracer(model) as tracer:
        model(_input())
    assert tracer.event is None and tracer.checked == len(list(model.modules()))
    assert "No non-finite" in tracer.report()
    assert all(not m._forward_hooks for m in model.modules())
    with pytest.raises(ConfigError, match="nn.Module"):
        NonfiniteTracer(lambda x: x)  # type: ignore[arg-type]


def test_tensor_range_counts_and_finite_extremes() -> None:
    r = tensor_range(torch.tensor([1.0, -3.0, float("inf"), float("nan"), float("-inf")]).half())
    assert (r.min, r.max, r.n_inf, r.n_nan, r.max_abs) == (-3.0, 1.0, 2, 1, 3.0)
    empty = tensor_range(torch.tensor([float("nan")]))
    assert empty.min is None and empty.max_abs is None and "no finite value" in str(empty)


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_grads_names_and_counts(device: str) -> None:
    model = _model(device)
    grad = torch.zeros(16, 16, device=device)
    grad[0, :3] = float("inf")
    grad[1, 0] = float("-inf")
    grad[2, :2] = float("nan")
    model.layer2.weight.grad = grad
    model.head.bias.grad = torch.ones(4, device=device)
    bad = nonfinite_grads(model)
    # Reference: torch's own counts on the one gradient we poisoned.
    assert [(b.name, b.n_inf, b.n_nan, b.numel) for b in bad] == [
        ("layer2.weight", int(grad.isinf().sum()), int(grad.isnan().sum()), grad.numel())
    ]
    assert "layer2.weight: 4 inf, 2 NaN of 256" in nonfinite_report(model)
    model.layer2.weight.grad = None
    assert nonfinite_grads(model) == [] and nonfinite_report(model) == "All gradients are finite."


def test_nonfinite_grads_after_an_overflowing_scaled_backward() -> None:
    model = _model()
    (model(_input()).sum() * 3e38).backward()  # the loss scale overflows the fp32 gradients
    bad = {b.name: b for b in nonfinite_grads(model.named_parameters())}
    expected = {n for n, p in model.named_parameters() if not p.grad.isfinite().all()}
    assert set(bad) == expected and expected


@pytest.mark.parametrize("device", DEVICES)
def test_finite_flags_agree_with_torch(device: str) -> None:
    tensors = [
        torch.tensor([1.0, float("inf")], device=device).half(),
        torch.ones(3, device=device, dtype=torch.bfloat16),
        torch.tensor([float("nan")], device=device, dtype=torch.float64),
        torch.arange(4, device=device),  # integers are always finite
        torch.empty(0, device=device),
        torch.tensor(2.0),  # a CPU scalar beside device tensors, like an optimizer's step counter
    ]
    assert finite_flags(tensors) == [bool(torch.isfinite(t).all()) for t in tensors]
    assert finite_flags([]) == []


def test_tensor_range_of_fp64_and_empty_tensors() -> None:
    x = torch.tensor([1e300, -2.5, float("inf")], dtype=torch.float64)  # beyond fp32: kept in fp64
    r = tensor_range(x)
    assert (r.min, r.max, r.n_inf, r.n_nan, r.dtype) == (x[1].item(), x[0].item(), 1, 0, torch.float64)
    empty = tensor_range(torch.empty(0, 3, dtype=torch.float16))
    assert (empty.min, empty.max, empty.n_inf, empty.n_nan, empty.shape) == (None, None, 0, 0, (0, 3))


def test_finite_outputs_are_not_ranged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranges are built only for the event: a finite forward checks one flag per output."""
    calls: list[torch.Tensor] = []
    original = overflow.tensor_range
    monkeypatch.setattr(overflow, "tensor_range", lambda t: calls.append(t) or original(t))
    model = _model()
    with trace_nonfinite(model) as tracer:
        model(_input())
    assert tracer.event is None and calls == []
    _plant_overflow(model)
    half = model.half()
    with trace_nonfinite(half, compare_fp32=False) as tracer:
        half(_input().half())
    assert tracer.event is not None and tracer.event.module == "layer3" and len(calls) == 2  # input, output


def test_tracer_reads_outputs_nested_in_dicts() -> None:
    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> dict[str, object]:
            h = self.body(x)
            return {"ids": torch.arange(2), "out": [h, h.log()]}  # log of negatives: NaN, made in forward

    model = Heads()
    with trace_nonfinite(model, compare_fp32=False) as tracer:
        model(-torch.ones(2, 4) * 100)
    assert tracer.event is not None and tracer.event.module == "" and tracer.event.module_type == "Heads"
    assert [r.dtype for r in tracer.event.outputs] == [torch.float32, torch.float32]
    assert not tracer.event.outputs[1].finite


def test_o3_adam_is_blamed_on_the_optimizer_update_not_on_log0() -> None:
    """The newcomer's trap: O3 + Adam writes NaN into the fp16 weights on its first step; the tracer must
    point at the weights (and the optimizer), not at the forward's arithmetic."""
    import warnings

    import mixprec

    torch.manual_seed(0)
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # initialize warns about exactly this
        model, opt = mixprec.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-3), "O3",
                                        verbosity=0)  # fmt: skip
    try:
        with mixprec.scale_loss(model(_input()).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        with trace_nonfinite(model) as tracer:
            model(_input())
    finally:
        mixprec.amp.reset()
    event = tracer.event
    assert event is not None and event.nonfinite_state
    assert "earlier optimizer step" in event.explain() and "log(0)" not in event.explain()


# ------------------------------------------------------------------------------------------- backward
def _output_grads(model: nn.Sequential, x: torch.Tensor, loss_scale: float) -> dict[str, torch.Tensor]:
    """The reference: each module's output gradient, read with plain tensor hooks."""
    grads: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda m, a, out, n=n: out.register_hook(
        lambda g, n=n: grads.setdefault(n, g.clone())) and None) for n, m in model.named_children()]
    (model(x).float().sum() * loss_scale).backward()
    for h in handles:
        h.remove()
    model.zero_grad()
    return grads


def _traced_backward(model: nn.Sequential, x: torch.Tensor, loss_scale: float) -> NonfiniteTracer:
    with trace_nonfinite(model, loss_scale=loss_scale) as tracer:
        loss = model(x).float().sum() * loss_scale
    loss.backward()  # after the block: the hooks live on the forward's outputs
    return tracer


def test_a_backward_that_overflows_at_the_loss_is_traced_to_the_first_gradient() -> None:
    model, x = _model().half(), _input().half()
    ref = _output_grads(model, x, 1e6)  # d(sum)/d(out) = 1e6, above fp16's 65504: inf (IEEE-754)
    assert torch.isinf(ref["head"]).all()
    tracer = _traced_backward(model, x, 1e6)
    assert tracer.event is None  # the forward was finite
    event = tracer.backward_event
    assert event is not None and (event.module, event.after) == ("head", None)
    assert event.grad.n_inf == ref["head"].numel()
    assert "loss scale 1e+06 overflowed float16" in tracer.report()


def test_a_backward_that_overflows_inside_is_traced_between_two_modules() -> None:
    model, x = _model().half(), _input().half()
    with torch.no_grad():
        model.head.weight.mul_(8.0)  # d/d(layer3 out) = head.weight^T @ g: up to 4 x 2 x 6e4, past 65504
    ref = _output_grads(model, x, 6e4)  # the output's gradient, 6e4, still fits fp16
    assert torch.isfinite(ref["head"]).all() and not torch.isfinite(ref["layer3"]).all()
    tracer = _traced_backward(model, x, 6e4)
    event = tracer.backward_event
    assert event is not None and (event.module, event.after) == ("layer3", "head (Linear)")
    assert "up to head (Linear)" in event.explain()


def test_a_finite_backward_reports_what_it_checked() -> None:
    model = _model()
    tracer = _traced_backward(model, _input(), 1.0)
    assert tracer.backward_event is None and tracer.grads_checked == len(list(model.children()))
    assert tracer.report().endswith(f"nor gradient w.r.t. one ({tracer.grads_checked} checked).")


def test_an_overflow_with_large_weights_says_the_run_may_be_diverging() -> None:
    """A user trial: at lr=50 (diverging in fp32 too: weights 3.6e6) the advice was only "keep this module in
    fp32"; an input scaled up, with ordinary weights, keeps that advice alone."""
    model = _model()
    _plant_overflow(model)  # layer3's weights up to ~7.5e3
    half = model.half()
    with trace_nonfinite(half) as tracer:
        half(_input().half())
    assert tracer.event is not None and tracer.event.weight_max is not None
    weight_max = half.layer3.weight.abs().max().item()
    assert f"max |w| {weight_max:.3g}" in tracer.event.explain() and "diverging" in tracer.event.explain()
    plain = _model()
    with torch.no_grad():
        plain.layer1.weight.mul_(50.0)  # up to ~18: large for an initialisation, ordinary for trained weights
    plain = plain.half()
    with trace_nonfinite(plain) as tracer:
        plain(_input().half() * 3e3)  # an input scaled up: layer1's output reaches ~2e5
    assert tracer.event is not None and "overflowed in float16" in tracer.event.explain()
    assert "diverging" not in tracer.event.explain()


def test_a_non_finite_loss_after_a_finite_forward_is_said_to_come_from_after_the_model() -> None:
    """A user trial: model(x) * 1e5 made the loss NaN; the report only hedged "or the loss is inf/NaN"."""
    model, x = _model().half(), _input().half()
    tracer = _traced_backward(model, x, 1e6)
    assert tracer.event is None
    assert re.search(r"Every module output of the forward was finite \(\d+ checked\)", tracer.report())


class _MaskedAttention(nn.Module):
    """Attention scores plus an additive causal mask (-inf above the diagonal), as nn.Transformer's."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = self.proj(x)
        scores = (q @ q.transpose(-2, -1)).float() + mask  # the sum overflows fp16, the mask is -inf
        return (scores.softmax(-1).to(x.dtype) @ x) * q.pow(2).sum(-1, keepdim=True)


def test_an_additive_mask_is_not_taken_for_the_overflow() -> None:
    """A user trial (a causal nn.Transformer): the mask's intentional -inf was reported as the non-finite
    input that explained the output, and the fp32 re-run that finds the real overflow was skipped."""
    model = _MaskedAttention().half()
    with torch.no_grad():
        model.proj.weight.mul_(400)
    x = torch.randn(5, 8).half()
    mask = torch.nn.Transformer.generate_square_subsequent_mask(5)
    with trace_nonfinite(model) as tracer:
        model(x, mask)
    event = tracer.event
    assert event is not None and event.module == ""
    assert event.inputs[1].mask_like and "-inf (a mask?)" in str(event.inputs[1])
    assert event.fp32_outputs is not None and "received non-finite input" not in event.explain()
    with trace_nonfinite(model) as tracer:
        model(x, torch.full((5, 5), float("nan")))  # NaN is no mask: still said to come from outside
    assert tracer.event is not None and "received non-finite input" in tracer.event.explain()


class _PaddedAttention(nn.Module):
    """A padding mask of fp32's finfo.min cast to the half model's dtype: -inf, one row masked everywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = _MaskedAttention()

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(5, 5).masked_fill(pad, torch.finfo(torch.float32).min).to(x.dtype)
        return self.attn(x, mask)


def test_a_mask_that_masks_a_whole_row_is_named_as_the_cause() -> None:
    """A review: with -inf taken for a mask, a fully masked row (NaN in fp32 too) was "not a precision
    problem -- look for log(0)"; the mask made in the parent's forward is the cause. And a tensor that is
    all -inf (an overflow) is no mask."""
    torch.manual_seed(0)
    model = _PaddedAttention().half()
    pad = torch.zeros(5, 5, dtype=torch.bool)
    pad[2] = True
    with trace_nonfinite(model) as tracer:
        model(torch.randn(5, 8).half(), pad)
    assert tracer.event is not None and tracer.event.module == "attn"
    text = tracer.event.explain()
    assert "holds -inf (a mask?)" in text and "finfo(torch.float32).min" in text and "<model>" in text
    assert not tensor_range(torch.full((3,), float("-inf"))).mask_like
