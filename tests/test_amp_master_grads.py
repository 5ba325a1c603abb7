"""``mixprec.initialize(..., "O2", master_grads=False)``: O2 + Adam at 16 bytes per parameter (issue 10).

References: the same O2 run with persistent fp32 master gradients (the chunked step runs torch's fused
kernel on the same fp32 values, so the two agree bit for bit), and the bytes of the live tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch._dynamo
from torch import nn

import mixprec
from mixprec import amp
from mixprec.errors import ConfigError

pytestmark = pytest.mark.usefixtures("fresh_amp_state", "fresh_dynamo")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))


def _train(steps: int = 4, clip: float | None = None, **kwargs: object) -> tuple[nn.Module, object]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = mixprec.initialize(model, opt, "O2", dtype=torch.bfloat16, verbosity=0, **kwargs)
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 4, (16,), generator=g)
        with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
            scaled.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(amp.master_params(opt), clip)
        opt.step()
        opt.zero_grad()
    return model, opt


def test_o2_without_master_grads_trains_exactly_as_with_them_in_16_bytes_per_parameter(
    live_bytes: Callable[..., int],
) -> None:
    ref_model, ref_opt = _train()
    model, opt = _train(master_grads=False)
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(ref_opt.master_views(), opt.master_views(), strict=True):
        assert torch.equal(a, b)
    # gradients still held after the last backward: the resting peak. Step counts add 4 bytes per tensor.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for m in ref_opt.master_params():
        m.grad = torch.zeros_like(m)
    for p in ref_model.parameters():
        p.grad = torch.zeros_like(p)
    n = sum(p.numel() for p in model.parameters())
    assert live_bytes(model, opt) / n == pytest.approx(16, abs=0.02)
    assert live_bytes(ref_model, ref_opt) / n == pytest.approx(20, abs=0.02)


def test_apex_clipping_reaches_the_gradients_the_step_reads() -> None:
    # amp.master_params(opt) must name tensors whose gradients the step uses, or a clip silently does nothing
    ref_model, _ = _train(clip=1e-3)
    model, _ = _train(clip=1e-3, master_grads=False)
    unclipped, _ = _train(master_grads=False)
    # clipped in bf16 (the model's gradients) instead of fp32: equal to within bf16 rounding of the update
    for a, b, c in zip(ref_model.parameters(), model.parameters(), unclipped.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=2**-7, atol=2**-7)
        assert not torch.equal(b, c)


def test_the_compiled_step_through_initialize_trains_like_the_uncompiled_one() -> None:
    ref_model, _ = _train(master_grads=False)
    model, opt = _train(master_grads=False, compile_step=True)
    assert opt.keeps_master_grads is False
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=2**-7, atol=1e-5)  # fp32 order differences, then bf16 rounding


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"dtype": torch.float16, "master_grads": False}, "unscaled in fp16|flushing the small ones"),
        ({"opt_level": "O1", "master_grads": False}, "keeps no fp32 master weights"),
        ({"compile_step": True}, "master_grads=False"),
    ],
)
def test_combinations_that_cannot_work_are_refused(kwargs: dict, needle: str) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    settings = {"opt_level": "O2", "verbosity": 0, **kwargs}
    with pytest.raises(ConfigError, match=needle):
        mixprec.initialize(model, opt, **settings)
