"""mixprec.half_relu: ReLU of an emulated half activation gives torch's own output and gradient bit for
bit, eager and compiled, and a compiled step no longer stores a bool mask for its backward."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.half_compute import half_compute
from mixprec.half_relu import half_relu

HALVES = (torch.float16, torch.bfloat16)
SPECIAL = [0.0, -0.0, 1.5, -2.0, float("inf"), float("-inf"), float("nan"), 1e-8, -1e-8]


def _input(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor(SPECIAL), torch.randn(64, generator=g)]).to(dtype)
    return x.requires_grad_()


@pytest.mark.parametrize("dtype", HALVES)
def test_output_and_gradient_equal_torch_relu_bit_for_bit(dtype: torch.dtype) -> None:
    x, ref_x = _input(dtype), _input(dtype)
    grad = torch.randn(x.shape).to(dtype)
    out = half_relu((x,), {}, dtype, "cpu")
    assert out is not None and type(out.grad_fn).__name__ == "_HalfReluBackward"
    ref = torch.relu(ref_x)
    out.backward(grad)
    ref.backward(grad)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))  # bits: -0.0 and NaN included
    assert torch.equal(x.grad.view(torch.int16), ref_x.grad.view(torch.int16))


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("dtype", HALVES)
def test_the_compiled_backward_equals_torchs_bit_for_bit(dtype: torch.dtype) -> None:
    # The compiled branch builds its mask from out.float(): ±0, ±inf, NaN and tiny values included.
    x, ref_x = _input(dtype), _input(dtype)
    grad = torch.randn(x.shape).to(dtype)
    torch.compile(lambda t: half_relu((t,), {}, dtype, "cpu"), fullgraph=True)(x).backward(grad)
    torch.relu(ref_x).backward(grad)
    assert torch.equal(x.grad.view(torch.int16), ref_x.grad.view(torch.int16))


def _half(**kw: Any) -> torch.Tensor:
    return torch.ones(3, dtype=torch.bfloat16, **kw)


@pytest.mark.parametrize(("args", "kwargs"), [
    ((_half(),), {}),  # no gradient needed
    ((torch.ones(3, requires_grad=True),), {}),  # fp32
    ((_half(requires_grad=True),), {"inplace": True}),  # F.relu passes inplace as a keyword
    ((_half(device="meta", requires_grad=True),), {}),  # not the region's device
])
def test_what_it_leaves_to_torch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    assert half_relu(args, kwargs, torch.bfloat16, "cpu") is None


def test_no_gradient_mode_leaves_it_to_torch() -> None:
    x = _half(requires_grad=True)
    with torch.no_grad():
        assert half_relu((x,), {}, torch.bfloat16, "cpu") is None
    with torch.inference_mode():
        assert half_relu((x,), {}, torch.bfloat16, "cpu") is None
    assert half_relu((), {"input": x}, torch.bfloat16, "cpu") is not None  # torch.relu(input=x)


@pytest.mark.usefixtures("clean_registry")
def test_a_policy_rule_for_relu_wins(arithmetic: Callable[[str], None]) -> None:
    arithmetic("emulated")
    mixprec.policy.register_float_function(F, "relu")
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        out = F.relu(x)
    assert out.dtype is torch.float32  # the registered rule, not this module's bf16 ReLU


def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).to(dtype)


@pytest.mark.parametrize("dtype", HALVES)
def test_regions_route_relu_through_it_only_where_gemms_are_emulated(
    dtype: torch.dtype, arithmetic: Callable[[str], None]
) -> None:
    x = torch.randn(4, 8)
    for mode, expected in (("emulated", "_HalfReluBackward"), ("native", "ReluBackward0")):
        arithmetic(mode)
        with half_compute("cpu", dtype):  # an O2 / to_fp16 model
            hidden = _mlp(dtype)[:2](x.to(dtype))
        assert type(hidden.grad_fn).__name__ == expected, mode
        with mixprec.autocast("cpu", dtype=dtype):  # O1: an fp32 model, its GEMMs lowered
            hidden = torch.nn.Sequential(nn.Linear(8, 32), nn.ReLU())(x)
        assert hidden.dtype is dtype and type(hidden.grad_fn).__name__ == expected, mode
        with half_compute("cpu", dtype):
            inplace = F.relu(_mlp(dtype)[0](x.to(dtype)), inplace=True)
        assert type(inplace.grad_fn).__name__ != "_HalfReluBackward"


def _torch_at_least(major: int, minor: int) -> bool:
    return tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (major, minor)


def _saved_by_compiled_step(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """What the Inductor-compiled forward saves for backward, seen by a saved-tensors hook at run time (on
    the second call: the first compiles)."""
    def run(x: torch.Tensor) -> torch.Tensor:
        with half_compute("cpu", torch.bfloat16):  # inside the compiled code, as initialize(O2) does
            return model(x)

    compiled = torch.compile(run)
    compiled(x).float().sum().backward()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        compiled(x).float().sum().backward()
    return saved


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_emulated_step_saves_no_mask_and_keeps_torchs_gradients(
    arithmetic: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    arithmetic("emulated")
    x = torch.randn(16, 8).bfloat16()
    model = _mlp(torch.bfloat16)
    saved = _saved_by_compiled_step(model, x)
    assert saved and not any(t.dtype is torch.bool for t in saved), [t.dtype for t in saved]
    # The reference: the same compiled step with torch's own ReLU (the region no longer routes it here)
    reference = _mlp(torch.bfloat16)
    monkeypatch.setattr(sys.modules["mixprec.half_compute"], "RELU_NAMES", frozenset())
    torch._dynamo.reset()
    old_saved = _saved_by_compiled_step(reference, x)
    # torch up to 2.13 saves ReLU's bool mask there (what this module removes); torch 2.14's partitioner
    # saves none either, and the gradients below are the contract left
    newer = _torch_at_least(2, 14)
    assert any(t.dtype is torch.bool for t in old_saved) or newer
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        if not newer:
            assert torch.equal(p.grad, q.grad)
        else:  # 2.14.1 compiles the two weight-gradient GEMMs apart: 16 of 128 elements 1 bf16 ulp off
            torch.testing.assert_close(p.grad, q.grad, rtol=2**-7, atol=0)


@pytest.mark.parametrize("dtype", HALVES)
def test_o1_relu_output_matches_torch_autocast(dtype: torch.dtype, arithmetic: Callable[[str], None]) -> None:
    # The drop-in contract: under mixprec.autocast the routed ReLU gives what torch.autocast gives for the
    # same fp32 model (dtype; values within the half rounding of the GEMM before it).
    arithmetic("emulated")
    torch.manual_seed(0)
    net, x = nn.Sequential(nn.Linear(8, 32), nn.ReLU()), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=dtype):
        reference = net(x)
    with mixprec.autocast("cpu", dtype=dtype):
        ours = net(x)
    assert type(ours.grad_fn).__name__ == "_HalfReluBackward"
    assert ours.dtype is reference.dtype
    torch.testing.assert_close(ours.float(), reference.float(), rtol=2 ** -7, atol=1e-3)
