"""MasterWeights.step under torch.compile: the compiled step gives the eager step's masters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.master import MasterWeights


def _train(compiled: bool, flat: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).bfloat16()
    opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), flat=flat)
    step = torch.compile(opt.step) if compiled else opt.step
    for i in range(2):
        g = torch.Generator().manual_seed(i)
        model(torch.randn(8, 4, generator=g).bfloat16()).float().pow(2).mean().backward()
        step()
        opt.zero_grad()
    return [m.clone() for m in opt.master_views()]


@pytest.mark.parametrize("flat", [True])  # flat: views of one buffer, the harder case for Dynamo
def test_compiled_step_equals_eager(flat: bool) -> None:
    """SGD with momentum is two elementwise operations per value, fused or not: Inductor may contract a
    multiply-add into an FMA (one rounding instead of two), so equal within fp32's rounding."""
    torch._dynamo.reset()
    for a, b in zip(_train(False, flat), _train(True, flat), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
