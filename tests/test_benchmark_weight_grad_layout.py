"""benchmarks/weight_grad_layout.py's column-major linear computes autograd's gradients (the timings
themselves are not tested): a faster layout that computed something else would time nothing worth having."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def layout():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import weight_grad_layout
    finally:
        sys.path.remove(str(BENCHMARKS))
    return weight_grad_layout


@pytest.mark.parametrize("store", ["column-major", "row-major"])
def test_the_transposed_input_linear_gives_autograds_gradients(layout, store: str) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(6, 10).double()
    fast = nn.Linear(6, 10).double()
    fast.load_state_dict(ref.state_dict())
    if store == "column-major":
        layout.column_major(fast)
        assert fast.weight.stride() == (1, 10)
    else:  # row-major weight through the same backward: its gradient is copied back to W's layout
        fast.forward = lambda x: layout.TransposedInputLinear.apply(x, fast.weight, fast.bias)
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    x_ref, x_fast = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(3, 5, 10, dtype=torch.float64)
    out_ref, out_fast = ref(x_ref), fast(x_fast)
    torch.testing.assert_close(out_fast, out_ref)
    out_ref.backward(g)
    out_fast.backward(g)
    pairs = ((x_fast.grad, x_ref.grad), (fast.weight.grad, ref.weight.grad), (fast.bias.grad, ref.bias.grad))
    for a, b in pairs:
        torch.testing.assert_close(a, b)
    # the gradient arrives in the weight's own layout (no copy by AccumulateGrad for the column-major one)
    assert fast.weight.grad.stride() == fast.weight.stride()
