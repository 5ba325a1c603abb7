"""mixprec.half_saving_gemms: emulated linear, matrix products and convolutions save half activations as
they are, and compute exactly what the generic emulation computes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.emulation import emulated
from mixprec.half_compute import half_compute

HALF = [torch.bfloat16, torch.float16]




def _generic(func: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda *args, **kwargs: func(*args, **kwargs)  # not func itself: emulated()'s generic path


def _activation(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(a half activation, not a leaf; the fp32 leaf it comes from)."""
    leaf = torch.randn(*shape, requires_grad=True)
    return leaf.to(dtype).relu(), leaf


def _half_param(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape).to(dtype).requires_grad_()


Case = tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...], dict[str, Any], list[torch.Tensor]]


def _case(form: str, dtype: torch.dtype) -> Case:
    """(function, arguments, keyword arguments, the leaves whose gradients to compare) for one way a model
    calls a GEMM."""
    torch.manual_seed(3)
    if form == "linear, half model":  # O2: a half activation (not a leaf) and half parameters
        x, leaf = _activation((4, 5, 16), dtype)
        w, b = _half_param(6, 16, dtype=dtype), _half_param(6, dtype=dtype)
        return F.linear, (x, w, b), {}, [leaf, w, b]
    w = torch.randn(6, 16, requires_grad=True)
    if form == "linear, fp32 input, no bias":  # O1: autocast rounds an fp32 activation
        x = torch.randn(8, 16, requires_grad=True)
        return F.linear, (x, w), {}, [x, w]
    if form == "linear, data input":  # no input gradient
        b = torch.randn(6, requires_grad=True)
        return F.linear, (torch.randn(8, 16), w, b), {}, [w, b]
    if form == "matmul, attention scores":  # q @ k^T of half activations, 4-d
        (q, lq), (k, lk) = _activation((2, 3, 5, 8), dtype), _activation((2, 3, 5, 8), dtype)
        return torch.matmul, (q, k.transpose(-2, -1)), {}, [lq, lk]
    if form == "bmm, activation times parameter":  # a half parameter is saved as its fp32 upcast
        (a, la), p = _activation((3, 5, 8), dtype), _half_param(3, 8, 4, dtype=dtype)
        return torch.bmm, (a, p), {}, [la, p]
    if form == "conv2d, half model":  # O2 CNN: strided, padded, grouped, with bias
        (x, leaf), w2 = _activation((2, 4, 9, 9), dtype), _half_param(6, 2, 3, 3, dtype=dtype)
        b2 = _half_param(6, dtype=dtype)
        return F.conv2d, (x, w2, b2), {"stride": 2, "padding": 1, "groups": 2}, [leaf, w2, b2]
    if form == "conv1d, fp32 input":  # O1: autocast rounds an fp32 activation; dilation, no bias
        x, w1 = torch.randn(2, 3, 12, requires_grad=True), torch.randn(5, 3, 3, requires_grad=True)
        return F.conv1d, (x, w1), {"dilation": 2}, [x, w1]
    if form == "matmul, matrix times vector":  # not a product of matrices: the generic path
        (a, la), (v, lv) = _activation((5, 16), dtype), _activation((16,), dtype)
        return torch.matmul, (a, v), {}, [la, lv]
    if form == "matmul, broadcast batch":  # a 3-d stack times one matrix: the generic path
        (a, la), p = _activation((3, 5, 16), dtype), _half_param(16, 4, dtype=dtype)
        return torch.matmul, (a, p), {}, [la, p]
    x = torch.randn(8, 16, requires_grad=True)  # "mm, fp32": O1's rounding of fp32 operands
    return torch.mm, (x, w.t()), {}, [x, w]


FORMS = ["linear, half model", "linear, fp32 input, no bias", "linear, data input",
         "matmul, attention scores", "bmm, activation times parameter", "mm, fp32", "conv2d, half model",
         "conv1d, fp32 input", "matmul, matrix times vector", "matmul, broadcast batch"]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("form", FORMS)
def test_emulated_gemms_that_save_half_inputs_equal_the_generic_emulation(
    form: str, dtype: torch.dtype
) -> None:
    results = []
    for wrap in (lambda f: f, _generic):
        func, args, kwargs, leaves = _case(form, dtype)
        out = emulated(wrap(func), args, kwargs, dtype)
        out.backward(torch.randn_like(out, dtype=torch.float32, generator=torch.Generator().manual_seed(4)))
        results.append([out, *(t.grad for t in leaves)])
    for ours, generic in zip(*results, strict=True):
        assert ours is not None and generic is not None and ours.dtype == generic.dtype
        torch.testing.assert_close(ours, generic, rtol=0, atol=0)


def _saved_storages(
    func: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...], kwargs: dict[str, Any],
    dtype: torch.dtype,
) -> dict[int, torch.dtype]:
    saved: dict[int, torch.dtype] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.dtype
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        emulated(func, args, kwargs, dtype)
    return saved


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("form", "half_inputs"), [("linear, half model", 1), ("matmul, attention scores", 2),
                                                   ("bmm, activation times parameter", 1),
                                                   ("conv2d, half model", 1)])
def test_emulated_gemms_save_half_inputs_not_their_fp32_copies(
    form: str, half_inputs: int, dtype: torch.dtype
) -> None:
    func, args, kwargs, _ = _case(form, dtype)
    activations = {t.untyped_storage().data_ptr() for t in args[:half_inputs]}
    ours = _saved_storages(func, args, kwargs, dtype)
    generic = _saved_storages(_generic(func), args, kwargs, dtype)
    assert activations <= ours.keys() and not activations & generic.keys()  # generic: their fp32 upcasts
    # A parameter's fp32 upcast is saved by both (made once per region, not again in backward).
    fp32 = [sum(d is torch.float32 for d in saved.values()) for saved in (ours, generic)]
    assert fp32[0] == fp32[1] - half_inputs


# ---- memory: a half model's activations are saved in half, as with native kernels ----------------------


def _saved_activation_bytes(model: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> int:
    """Bytes of the batch-sized tensors autograd saves in one forward (weight copies excluded by shape)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() and t.shape[0] == x.shape[0]:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with half_compute("cpu", dtype), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(saved.values())


@pytest.mark.parametrize("dtype", HALF)
def test_an_emulated_half_mlp_saves_what_native_half_kernels_save(
    arithmetic: Callable[[str], None], dtype: torch.dtype
) -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10)).to(dtype)
    x = torch.randn(8, 64).to(dtype)
    arithmetic("native")
    native = _saved_activation_bytes(model, x, dtype)
    arithmetic("emulated")
    # Linear 1 saves x and Linear 2 the ReLU's output (which ReLU saves anyway) as they are, in half; the
    # generic emulation saved their fp32 upcasts as well (4352 bytes here, not 1792)
    assert _saved_activation_bytes(model, x, dtype) == native == (8 * 64 + 8 * 48) * 2


@pytest.mark.parametrize("dtype", HALF)
def test_an_emulated_half_cnn_saves_what_native_half_kernels_save(
    arithmetic: Callable[[str], None], dtype: torch.dtype
) -> None:
    torch.manual_seed(6)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 5, 3, stride=2)).to(dtype)
    x = torch.randn(8, 3, 9, 9).to(dtype)
    arithmetic("native")
    native = _saved_activation_bytes(model, x, dtype)
    arithmetic("emulated")
    assert _saved_activation_bytes(model, x, dtype) == native == (8 * 3 * 81 + 8 * 4 * 81) * 2


@pytest.mark.parametrize(("func", "shapes"),
                         [(torch.mm, ((2, 3, 4), (2, 4, 5))), (torch.bmm, ((3, 4), (4, 5)))])
def test_calls_torch_refuses_are_refused_as_torch_refuses_them(
    func: Callable[..., torch.Tensor], shapes: tuple[tuple[int, ...], ...]
) -> None:
    args = tuple(torch.randn(*s) for s in shapes)
    with pytest.raises(RuntimeError) as theirs:
        func(*args)
    with pytest.raises(RuntimeError) as ours:
        emulated(func, args, {}, torch.bfloat16)
    assert str(ours.value) == str(theirs.value)
