"""The Learner's fp16 and bf16 paths with a torch.compile'd model (issue 9): training runs compiled, and
lands where the eager run lands.

Not bitwise: Inductor fuses a GEMM's bias add and activation into one kernel that keeps the fp32
accumulator and rounds to half once, where eager rounds after each op; that moves activations by about one
half-precision ulp (fp16 2**-11, bf16 2**-8 relative). Measured over these 4 steps: losses within 4e-6
(fp16) and weights within 2e-5 (fp16); the bounds below allow a few ulps of the larger bf16 ulp."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec.learner import Learner

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = {"fp16": 1e-3, "bf16": 1e-2}  # a few ulps of each format's relative precision, on O(1) values


def _train(precision: str, compiled: bool) -> tuple[list[float], list[torch.Tensor]]:
    data = mixprec.synthetic(n=256, input_shape=(16,), n_classes=4, batch_size=64, seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    learn = Learner(data, torch.compile(model) if compiled else model, silent=True)
    getattr(learn, f"to_{precision}")()
    learn.fit(steps=4)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return learn.recorder.losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_learner_trains_a_compiled_model_like_the_eager_one(precision: str) -> None:
    eager_losses, eager_weights = _train(precision, compiled=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    losses, weights = _train(precision, compiled=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the forward really was compiled
    tol = TOLERANCE[precision]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=tol, atol=0)
    for w, e in zip(weights, eager_weights, strict=True):
        torch.testing.assert_close(w, e, rtol=tol, atol=tol)
