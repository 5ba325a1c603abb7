"""mixprec.emulation: half-precision GEMM numerics (fp16 and bf16) against exact references, eager and
compiled, on either arithmetic whatever the CPU (forced through MIXPREC_HALF_ARITHMETIC)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec import autocast, half_compute
from mixprec.diagnostics import CastTrace
from mixprec.emulation import COMPILED_ROUNDING, _CompiledRound, emulated, emulates, round_to_half
from mixprec.formats import dtype_label
from mixprec.policy import TORCH_NATIVE


def test_round_to_half_is_ieee_round_to_nearest_even() -> None:
    # 1 + 2**-11 lies halfway between fp16's 1 and 1 + 2**-10: ties go to the even significand (1).
    # 1 + 3 * 2**-11 lies halfway between 1 + 2**-10 and 1 + 2**-9: ties go to 1 + 2**-9.
    x = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-11, 70000.0, 2.0**-25])
    got = round_to_half(x)
    assert got.dtype == torch.float32
    assert got.tolist() == [1.0, 1 + 2.0**-9, float("inf"), 0.0]  # 70000 > fp16 max; 2**-25 ties to 0
    assert round_to_half(torch.tensor([3], dtype=torch.int64)).dtype == torch.int64  # non-floats untouched


def _bit_patterns() -> torch.Tensor:
    """fp32 values of every class: random bit patterns (NaNs with payloads, subnormals, both signs), each
    half format's subnormal and overflow edges, exact ties, and spans of decades."""
    torch.manual_seed(1)
    edges = [float("inf"), float("-inf"), float("nan"), 65504.0, 65519.99, 65520.0, -65520.0, 2.0**-14,
             2.0**-24, 2.0**-25, 3 * 2.0**-25, -(2.0**-25), 0.0, -0.0, 1e-45, -1e-45, 3.4028235e38,
             -3.4028235e38, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8]
    return torch.cat([
        torch.randint(-(2**31), 2**31 - 1, (200_000,), dtype=torch.int32).view(torch.float32),
        torch.randn(50_000) * 10.0 ** torch.randint(-45, 39, (50_000,)).float(),
        torch.rand(50_000) * 2.0**-13,
        torch.tensor(edges),
    ])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_rounding_equals_torchs_cast(dtype: torch.dtype) -> None:
    # Compiled code rounds by arithmetic (a cast pair would be elided); eager code by
    # torch's casts. Both must give the same bits forward and backward, every class of fp32 value.
    x = _bit_patterns()
    assert _same_bits(COMPILED_ROUNDING[dtype](x), x.to(dtype).float())
    assert _same_bits(torch.compile(COMPILED_ROUNDING[dtype], fullgraph=True)(x), x.to(dtype).float())
    x = x.clone().requires_grad_()
    g = torch.randn_like(x) * 1e-6
    (grad_eager,) = torch.autograd.grad(round_to_half(x, dtype), x, g)
    (grad_bits,) = torch.autograd.grad(_CompiledRound.apply(x, dtype), x, g)
    assert _same_bits(grad_eager, grad_bits)
    assert not torch.equal(grad_eager, g)  # the gradient was rounded, not passed through


def test_emulated_mm_is_exact_products_rounded_once() -> None:
    # fp16 x fp16 products are exact in fp32 and these sums too (small integers times 2**-8), so the
    # emulated GEMM must equal the float64 GEMM of the fp16-rounded inputs, rounded once to fp16.
    torch.manual_seed(0)
    a = torch.randint(-8, 9, (8, 16)).float() / 256 + 2.0**-13  # the offset is lost to fp16 rounding
    b = torch.randint(-8, 9, (16, 4)).float() / 256
    got = emulated(torch.mm, (a, b), {})
    ref = (a.half().double() @ b.half().double()).half()
    assert got.dtype == torch.float16
    assert torch.equal(got, ref)


def test_emulated_writes_out_and_returns_it() -> None:
    a, b = torch.randint(-3, 4, (4, 8)).float(), torch.randint(-3, 4, (8, 2)).float()  # exact sums
    out = torch.empty(4, 2, dtype=torch.float16)
    assert emulated(torch.mm, (a, b), {"out": out}) is out
    assert torch.equal(out, (a.half().double() @ b.half().double()).half())


# ---- bf16 as fp16: every GEMM of the family, through autocast and half_compute --------------------------

HALF = [torch.bfloat16, torch.float16]


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` numbers at |x| (float64), subnormal spacing below the smallest normal."""
    fi = torch.finfo(dtype)
    exponent = torch.floor(torch.log2(x.abs().clamp_min(fi.tiny)))
    return fi.eps * 2.0**exponent


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).double()


# op -> (function, inputs). Sizes keep every test under a millisecond of GEMM time.
GEMMS: dict[str, tuple[Callable[..., torch.Tensor], Callable[[], tuple[torch.Tensor, ...]]]] = {
    "mm": (torch.mm, lambda: (torch.randn(8, 64), torch.randn(64, 4))),
    "matmul": (torch.matmul, lambda: (torch.randn(3, 8, 64), torch.randn(64, 4))),
    "linear": (F.linear, lambda: (torch.randn(8, 64), torch.randn(6, 64), torch.randn(6))),
    "bmm": (torch.bmm, lambda: (torch.randn(2, 8, 64), torch.randn(2, 64, 4))),
    "addmm": (
        lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
        lambda: (torch.randn(8, 4), torch.randn(8, 64), torch.randn(64, 4)),
    ),
    "baddbmm": (torch.baddbmm, lambda: (torch.randn(2, 8, 4), torch.randn(2, 8, 64), torch.randn(2, 64, 4))),
    "conv1d": (F.conv1d, lambda: (torch.randn(2, 8, 16), torch.randn(4, 8, 3), torch.randn(4))),
    "conv2d": (F.conv2d, lambda: (torch.randn(2, 3, 9, 9), torch.randn(5, 3, 3, 3), torch.randn(5))),
}


def _assert_within_one_ulp(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], fn: Callable[..., Any],
                           dtype: torch.dtype) -> None:
    # The rounding model: inputs rounded to dtype, exact (float64) arithmetic, one rounding to dtype.
    # fp32 accumulation may move the pre-rounding value by a few fp32 ulps, so the result may land on
    # the neighbouring dtype number: at most 1 ulp away.
    ref = fn(*(_rounded(t, dtype) for t in inputs)).to(dtype).double()
    assert out.dtype == dtype
    err = (out.double() - ref).abs()
    assert bool((err <= _ulp(ref, dtype)).all()), float((err / _ulp(ref, dtype)).max())
    assert float((err == 0).double().mean()) > 0.9  # and mostly exactly the model's result


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(GEMMS))
def test_autocast_emulated_gemm_within_one_ulp_of_rounding_model(
    arithmetic: Callable[[str], None], name: str, dtype: torch.dtype
) -> None:
    arithmetic("emulated")
    fn, make = GEMMS[name]
    torch.manual_seed(0)
    inputs = make()
    with autocast("cpu", dtype):
        out = fn(*inputs)
    _assert_within_one_ulp(out, inputs, fn, dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", ["linear", "conv2d", "baddbmm"])
def test_half_compute_emulated_gemm_within_one_ulp_of_rounding_model(
    arithmetic: Callable[[str], None], name: str, dtype: torch.dtype
) -> None:
    arithmetic("emulated")
    fn, make = GEMMS[name]
    torch.manual_seed(1)
    inputs = tuple(t.to(dtype) for t in make())  # a half model: parameters and activations in dtype
    with half_compute("cpu", dtype):
        out = fn(*inputs)
    _assert_within_one_ulp(out, inputs, fn, dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_emulated_backward_is_the_emulated_gemm_of_the_right_operands(
    arithmetic: Callable[[str], None], dtype: torch.dtype
) -> None:
    arithmetic("emulated")
    torch.manual_seed(2)
    x, w = torch.randn(8, 64, requires_grad=True), torch.randn(6, 64, requires_grad=True)
    g = torch.randn(8, 6).to(dtype)
    with autocast("cpu", dtype):
        y = F.linear(x, w)
    y.backward(g)
    # dL/dx = g @ W and dL/dW = g^T @ x, each with its operands rounded and the result rounded once.
    for got, fn, operands in ((x.grad, torch.mm, (g, w.detach())), (w.grad, torch.mm, (g.T, x.detach()))):
        assert got is not None and got.dtype == torch.float32
        _assert_within_one_ulp(got.to(dtype), operands, fn, dtype)
        assert torch.equal(got.to(dtype).float(), got)  # values are dtype numbers: one rounding happened


@pytest.mark.parametrize("dtype", HALF)
def test_native_override_runs_torchs_kernels(arithmetic: Callable[[str], None], dtype: torch.dtype) -> None:
    arithmetic("native")
    a, b = torch.randn(4, 16), torch.randn(16, 3)
    with torch.autocast("cpu", dtype):
        theirs = torch.mm(a, b)
    with autocast("cpu", dtype, policy=TORCH_NATIVE):  # torch's tables, so only emulation needs a layer
        assert torch._C._len_torch_function_stack() == 0  # torch's kernels: no Python layer
        ours = torch.mm(a, b)
    assert torch.equal(ours, theirs)
    # half_compute keeps a layer for the fp32 ops of half models (issue 15), but its GEMMs are torch's:
    with half_compute("cpu", dtype), CastTrace() as trace:
        torch.mm(a.to(dtype), b.to(dtype))
    assert {r.inputs for r in trace.ops if r.op == "mm"} == {(dtype_label(dtype),) * 2}


@pytest.mark.parametrize("dtype", HALF)
def test_emulated_override_pushes_the_emulation(
    arithmetic: Callable[[str], None], dtype: torch.dtype
) -> None:
    arithmetic("emulated")
    assert emulates("cpu", dtype) and not emulates("cpu", dtype, allow=False)
    with half_compute("cpu", dtype):
        assert torch._C._len_torch_function_stack() == 1
    with autocast("cpu", dtype, policy=TORCH_NATIVE):
        assert torch._C._len_torch_function_stack() == 1


# ---- compiled code computes the same bits ---------------------------------------------------------------


def _eager_and_compiled(
    fn: Callable[..., torch.Tensor], a: torch.Tensor, b: torch.Tensor, grad: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """``fn(a, b)`` and its gradients for ``a`` and ``b``, eager and then compiled by Inductor."""
    runs = []
    for f in (fn, torch.compile(fn, backend="inductor", fullgraph=True)):
        a.grad = b.grad = None
        out = f(a, b)
        out.backward(grad)
        assert a.grad is not None and b.grad is not None
        runs.append((out.detach(), a.grad.clone(), b.grad.clone()))
    return runs[0], runs[1]


@pytest.mark.parametrize("dtype", HALF)
def test_compiled_emulation_keeps_its_input_rounding(dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    a = torch.randn(16, 32, requires_grad=True)
    b = torch.randn(32, 8, requires_grad=True)

    def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return emulated(torch.mm, (a, b), {}, dtype)

    eager, compiled = _eager_and_compiled(gemm, a, b, torch.randn(16, 8).to(dtype))
    # The case is one where the rounding matters: an fp32 GEMM rounded once differs (what Inductor
    # computed when the rounding was a plain cast pair it could fuse away).
    assert not torch.equal(eager[0], (a @ b).to(dtype))
    for e, c in zip(eager, compiled, strict=True):
        assert torch.equal(e, c)


# Known gaps, kept as strict xfails (they fail once fixed, so the mark goes): Inductor drops a cast pair it
# fuses, and these two sites still use plain casts. Rounding them by arithmetic as the fp32 inputs are made
# a small GPT's compiled bf16 step 1.4-1.9x fp32's instead of 1.2-1.3x (2026-11-26, AVX2 EPYC).
_ELIDED = pytest.mark.xfail(strict=True, reason="Inductor fuses a plain cast pair away (module docstring)")


@_ELIDED
@pytest.mark.parametrize("dtype", HALF)
def test_compiled_emulation_keeps_its_output_rounding(dtype: torch.dtype) -> None:
    # The half result read by an fp32 op Inductor fuses with the cast: the bare cast is dropped there, and
    # compiled results are the unrounded fp32 GEMM's (0.06 off in this case), forward and backward.
    torch.manual_seed(5)
    a = torch.randn(64, 64, requires_grad=True)
    b = torch.randn(64, 64, requires_grad=True)

    def gemm_then_fp32_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return emulated(torch.mm, (a, b), {}, dtype).float() * 1.0001 + 0.5

    grad = torch.linspace(-1, 1, 4096).reshape(64, 64)
    eager, compiled = _eager_and_compiled(gemm_then_fp32_op, a, b, grad)
    for e, c in zip(eager, compiled, strict=True):
        assert torch.equal(e, c)


@_ELIDED
@pytest.mark.parametrize("dtype", HALF)
def test_compiled_emulation_rounds_a_half_input_made_in_the_same_kernel(dtype: torch.dtype) -> None:
    # An fp32 value cast to half right before the GEMM (a model's input cast, an op's half output): Inductor
    # fuses that cast with the GEMM input's upcast and drops both (0.125 off in this case).
    torch.manual_seed(6)
    a, b = torch.randn(64, 64), torch.randn(64, 64)

    def cast_then_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return emulated(torch.mm, ((a * 1.0001).to(dtype), b), {}, dtype)

    compiled = torch.compile(cast_then_gemm, backend="inductor", fullgraph=True)
    assert torch.equal(cast_then_gemm(a, b), compiled(a, b))


# ---- cast cost: each weight rounded once per step ---------------------------------------------------------


class _CountCasts(TorchDispatchMode):
    """Counts the casts (aten._to_copy: the eager rounding is a pair of them) whose source is one given
    tensor."""

    def __init__(self, source: torch.Tensor) -> None:
        super().__init__()
        self.source, self.count = source, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._to_copy.default and args[0] is self.source:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _Shared(torch.nn.Module):
    """One weight, three uses per forward (a shared layer, as in ALBERT or a recurrent cell)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = torch.relu(self.lin(x))
        return x


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("region", ["autocast", "half_compute"])
def test_each_weight_is_cast_once_per_step_and_not_in_backward(
    arithmetic: Callable[[str], None], dtype: torch.dtype, region: str
) -> None:
    arithmetic("emulated")
    model, x = _Shared(), torch.randn(2, 8)
    if region == "half_compute":  # an O2 model: half weights, upcast (exactly) for the fp32 GEMM
        model, x = model.to(dtype), x.to(dtype)
    enter = {"autocast": autocast, "half_compute": half_compute}[region]
    with _CountCasts(model.lin.weight) as counter:
        for step in range(2):
            with enter("cpu", dtype):
                out = model(x)
            assert counter.count == step + 1  # forward: once, not once per use
            out.float().sum().backward()
            assert counter.count == step + 1  # backward: autograd reuses the rounded copy
