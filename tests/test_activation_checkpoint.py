"""Activation checkpointing inside mixprec regions (issue 9): gradients with and without checkpointing."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

from mixprec import policy as P
from mixprec.activation_checkpoint import checkpoint, checkpoint_context
from mixprec.autocast import autocast
from mixprec.half_compute import half_compute

Region = Callable[[], AbstractContextManager[object]]

# Regions with a Python layer: emulated fp16 GEMMs, a custom policy, a half model's arithmetic.
REGIONS: dict[str, tuple[Region, torch.dtype | None]] = {
    "autocast fp16": (lambda: autocast("cpu", torch.float16), None),
    "autocast bf16 apex": (lambda: autocast("cpu", torch.bfloat16, policy=P.APEX), None),
    "half_compute fp16": (lambda: half_compute("cpu", torch.float16), torch.float16),
}

RUNS: dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
    "mixprec checkpoint": lambda block, x: checkpoint(block, x),
    "torch checkpoint + context_fn": lambda block, x: torch.utils.checkpoint.checkpoint(
        block, x, use_reentrant=False, context_fn=checkpoint_context
    ),
}


def _block(dtype: torch.dtype | None) -> nn.Module:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))
    return block.to(dtype) if dtype is not None else block


def _grads(
    block: nn.Module, x: torch.Tensor, region: Region, run: Callable[[torch.Tensor], torch.Tensor]
) -> list[torch.Tensor]:
    block.zero_grad(set_to_none=True)
    x.grad = None
    with region():
        y = run(x)
    y.float().square().mean().backward()  # backward (and so the recompute) outside the region
    assert x.grad is not None
    return [x.grad] + [p.grad for p in block.parameters() if p.grad is not None]


@pytest.mark.parametrize("run_name", list(RUNS))
@pytest.mark.parametrize("region_name", list(REGIONS))
def test_checkpointed_gradients_equal_the_plain_ones(region_name: str, run_name: str) -> None:
    region, model_dtype = REGIONS[region_name]
    block = _block(model_dtype)
    x = torch.randn(8, 16, dtype=model_dtype or torch.float32, requires_grad=True)
    plain = _grads(block, x, region, block)
    checkpointed = _grads(block, x, region, lambda t: RUNS[run_name](block, t))
    assert len(plain) == len(checkpointed) == 7  # the input and 6 parameters
    for a, b in zip(plain, checkpointed, strict=True):
        assert torch.equal(a, b)  # the recompute ran the same kernels in the same dtypes


def test_mixprecs_checkpoint_takes_the_reentrant_kind_too() -> None:
    """Refused before torch's reentrant recompute was covered (it gave other gradients)."""
    block = _block(None)
    x = torch.randn(8, 16, requires_grad=True)
    region: Region = lambda: autocast("cpu", torch.float16)  # noqa: E731
    plain = _grads(block, x, region, block)
    got = _grads(block, x, region, lambda t: checkpoint(block, t, use_reentrant=True))
    for a, b in zip(plain, got, strict=True):
        assert torch.equal(a, b)


def _torch_checkpoint(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """torch's checkpoint as a user calls it, given nothing of mixprec's."""
    return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)


TORCH_RUNS: dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
    "checkpoint": _torch_checkpoint,
    # Hugging Face's gradient_checkpointing_enable() default
    "reentrant": lambda block, x: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True),
    "checkpoint_sequential": lambda block, x: torch.utils.checkpoint.checkpoint_sequential(
        block, 2, x, use_reentrant=False),
}


@pytest.mark.parametrize(("run_name", "backward_inside"),
                         [("checkpoint", False), ("checkpoint", True), ("checkpoint_sequential", False),
                          ("reentrant", False), ("reentrant", True)])
@pytest.mark.parametrize("region_name", list(REGIONS))
def test_torchs_checkpoint_without_context_fn_recomputes_under_the_region(
    region_name: str, run_name: str, backward_inside: bool
) -> None:
    """As under torch.autocast, whose state torch's checkpoint restores: a mixprec.autocast or half_compute
    region's Python layer is re-entered for the recompute too (before, torch raised CheckpointError after
    the region had closed). With the backward inside the region: the same gradients."""
    region, model_dtype = REGIONS[region_name]
    block = _block(model_dtype)
    x = torch.randn(8, 16, dtype=model_dtype or torch.float32, requires_grad=True)
    plain = _grads(block, x, region, block)
    block.zero_grad(set_to_none=True)
    x.grad = None
    with region():
        y = TORCH_RUNS[run_name](block, x)
        if backward_inside:
            y.float().square().mean().backward()
    if not backward_inside:
        y.float().square().mean().backward()
    got = [x.grad] + [p.grad for p in block.parameters()]
    assert len(got) == len(plain) == 7
    for a, b in zip(plain, got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_region_entered_inside_the_segment_is_left_to_the_segments_own_code(reentrant: bool) -> None:
    """The recompute re-enters only the regions in force when the segment started: one the segment enters
    itself would otherwise cover all of it. Here both are fp16 (torch's autocast state, which torch
    restores for the recompute, cannot tell them apart); the inner one's policy runs gelu in fp32."""
    block = _block(None)
    inner_policy = P.TORCH.with_fp32("gelu")

    def segment(t: torch.Tensor) -> torch.Tensor:
        with autocast("cpu", torch.float16, policy=inner_policy):  # the first op changed is in here
            h = block[1](block[0](t))
        return block[3](nn.functional.gelu(block[2](h)))  # the outer region: gelu as torch runs it

    x = torch.randn(8, 16, requires_grad=True)
    outer: Region = lambda: autocast("cpu", torch.float16)  # noqa: E731
    plain = _grads(block, x, outer, segment)
    checkpointed = _grads(block, x, outer, lambda t: torch.utils.checkpoint.checkpoint(
        segment, t, use_reentrant=reentrant))
    for a, b in zip(plain, checkpointed, strict=True):
        assert torch.equal(a, b)


def test_a_checkpoint_mixprec_cannot_reach_into_warns_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's checkpoint internals are private: where they are not the shape mixprec knows, the segment
    is named with the fix, before torch's CheckpointError in the backward."""
    from mixprec import activation_checkpoint

    monkeypatch.setattr(activation_checkpoint, "_segment_frame", lambda pack: None)
    block, x = _block(None), torch.randn(4, 16, requires_grad=True)
    fix = "context_fn=mixprec.checkpoint_context"
    with autocast("cpu", torch.float16), pytest.warns(UserWarning, match=fix):
        _torch_checkpoint(block, x)
    with autocast("cpu", torch.float16), warnings.catch_warnings():
        warnings.simplefilter("error")  # given the context, nothing to warn about
        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=checkpoint_context)


# A custom policy under CPU bf16 (native in the suite): the Python layer changes gelu alone, to fp32.
# One policy object: entered twice, its region is one cached object.
GELU_FP32_POLICY = P.TORCH.with_fp32("gelu")
GELU_FP32: Region = lambda: autocast("cpu", torch.bfloat16, policy=GELU_FP32_POLICY)  # noqa: E731


def _equal_grads(params: list[torch.Tensor], x: torch.Tensor, region: Region,
                 plain: Callable[[torch.Tensor], torch.Tensor],
                 checkpointed: Callable[[torch.Tensor], torch.Tensor]) -> None:
    def grads(run: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor | None]:
        for p in [x, *params]:
            p.grad = None
        with region():
            y = run(x)
        y.float().square().mean().backward()
        return [x.grad] + [p.grad for p in params]

    want, got = grads(plain), grads(checkpointed)
    assert all(w is not None for w in want)
    for a, b in zip(want, got, strict=True):
        assert b is not None and torch.equal(a, b)


def _nested_segments(kind: Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]
                     ) -> None:
    """lin2(inner(x)), checkpointed twice over with ``kind``: the only op the layer changes (gelu) runs in
    the inner segment, against the same unchecked."""
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(16, 64), nn.Linear(64, 16)

    def inner(t: torch.Tensor) -> torch.Tensor:
        g = nn.functional.gelu(lin1(t))
        return g + g * 0.37

    x = torch.randn(32, 16, requires_grad=True)
    _equal_grads([*lin1.parameters(), *lin2.parameters()], x, GELU_FP32, lambda t: lin2(inner(t)),
                 lambda t: kind(lambda u: lin2(kind(inner, u)), t))


def test_an_outer_segment_whose_changed_ops_are_all_in_a_nested_one_is_covered_too() -> None:
    """Only the inner segment's top hook is seen when gelu runs; the outer one's recompute ran without the
    layer, and its bf16 input to lin2 differed in value, not in dtype: other gradients, no error."""
    _nested_segments(_torch_checkpoint)


def test_a_segment_whose_changed_ops_run_under_a_users_saved_tensors_hook_is_covered() -> None:
    torch.manual_seed(0)
    lin, w = nn.Linear(16, 16), torch.randn(16, requires_grad=True)

    def segment(t: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu():  # the top hook when gelu runs is this one
            h = nn.functional.gelu(lin(t))
        return h * w

    x = torch.randn(8, 16, requires_grad=True)
    _equal_grads([*lin.parameters(), w], x, GELU_FP32, segment, lambda t: _torch_checkpoint(segment, t))


def test_the_same_region_entered_again_inside_a_segment_leaves_the_outer_entry_as_it_was() -> None:
    """A cached region entered twice is one object: leaving the inner entry must drop the inner record
    (the outer one, dropped before, read as entered inside the segment, and nothing was re-entered)."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)

    def segment(t: torch.Tensor) -> torch.Tensor:
        with GELU_FP32():
            h = lin(t)
        return nn.functional.gelu(h) * 2

    x = torch.randn(8, 16, requires_grad=True)
    _equal_grads(list(lin.parameters()), x, GELU_FP32, segment, lambda t: _torch_checkpoint(segment, t))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_policys_fp32_modules_are_kept_in_fp32_in_the_recompute(dtype: torch.dtype) -> None:
    """Under bf16 such a policy has no op rules at all (no mode): its module hooks cover the segment."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    region: Region = lambda: autocast("cpu", dtype, policy=P.TORCH.with_fp32_modules(nn.Linear))  # noqa: E731
    x = torch.randn(8, 16, requires_grad=True)
    _equal_grads(list(block.parameters()), x, region, block, lambda t: _torch_checkpoint(block, t))


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_models_checkpointed_function_recomputes_under_its_region(opt_level: str) -> None:
    """O1's and O2's blocks re-enter the model's region by themselves; a checkpointed function that is not
    a module (a matmul with a weight) is covered as any region's segment is (before: CheckpointError)."""
    from mixprec.amp import initialize, scale_loss

    class Net(nn.Module):
        def __init__(self, checkpointed: bool) -> None:
            super().__init__()
            self.a, self.b, self.checkpointed = nn.Linear(16, 32), nn.Linear(32, 4), checkpointed

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            def f(t: torch.Tensor) -> torch.Tensor:
                return torch.softmax(t @ self.a.weight.t().to(t.dtype), -1) * 2  # fp16 GEMM, emulated
            return self.b(_torch_checkpoint(f, x) if self.checkpointed else f(x))

    runs = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        net = Net(checkpointed)
        model, opt = initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), opt_level=opt_level,
                                dtype=torch.float16)
        loss = model(torch.randn(8, 16)).float().square().mean()
        with scale_loss(loss, opt) as scaled:
            scaled.backward()
        runs.append([p.grad for p in model.parameters() if p.grad is not None])
    assert len(runs[0]) == len(runs[1]) == 3  # a.weight, b.weight, b.bias
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def _reentrant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=True)


def test_a_reentrant_segment_nested_in_a_reentrant_one_covers_the_outer_one_too() -> None:
    """The first changed op runs in the inner segment's forward; the outer one's recompute re-runs the
    inner checkpoint with a new ctx, so the outer ctx must be covered then as well."""
    _nested_segments(_reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_region_entered_under_no_grad_before_the_segment_is_re_entered(reentrant: bool) -> None:
    """A region entered with gradients off is not thereby inside a reentrant segment (which runs under
    no_grad): only the segments it was entered inside count."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)

    def segment(t: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(lin(t)) * 2

    @contextlib.contextmanager
    def entered_under_no_grad() -> Iterator[None]:
        with torch.no_grad(), GELU_FP32(), torch.enable_grad():
            yield

    x = torch.randn(8, 16, requires_grad=True)
    _equal_grads(list(lin.parameters()), x, entered_under_no_grad, segment,
                 lambda t: torch.utils.checkpoint.checkpoint(segment, t, use_reentrant=reentrant))


@pytest.mark.parametrize("reentrant", [False, True])
def test_half_compute_entered_again_inside_a_segment_keeps_the_outer_entry(reentrant: bool) -> None:
    """half_compute's mode is one cached object: entered again inside the segment (where the first op is
    changed), its outer entry still makes it one to re-enter for the rest of the segment."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 16).half()

    def segment(t: torch.Tensor) -> torch.Tensor:
        with half_compute("cpu", torch.float16):
            h = lin(t)
        return torch.log_softmax(h * 3, -1)  # fp32 under the outer entry

    x = torch.randn(8, 16, dtype=torch.float16, requires_grad=True)
    region: Region = lambda: half_compute("cpu", torch.float16)  # noqa: E731
    _equal_grads(list(lin.parameters()), x, region, segment,
                 lambda t: torch.utils.checkpoint.checkpoint(segment, t, use_reentrant=reentrant))


@pytest.mark.usefixtures("fresh_dynamo")
def test_mixprecs_checkpoint_inside_compiled_code_checkpoints_as_torchs() -> None:
    """torch.compile takes only a context_fn of two TorchDispatchModes: mixprec's checkpoint, called in
    compiled code, raised torch's AssertionError (a user trial). There Dynamo traces the segment and its
    recompute itself, so it is torch's checkpoint: the same gradients as torch's, compiled."""
    block, x = _block(None), torch.randn(4, 16, requires_grad=True)
    results = []
    for segment in (checkpoint, lambda f, x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False)):
        compiled = torch.compile(lambda x, segment=segment: segment(block, x), backend="aot_eager")
        results.append(_grads(block, x, lambda: autocast("cpu", torch.bfloat16), compiled))
    for ours, torchs in zip(*results, strict=True):
        assert torch.equal(ours, torchs)
