"""Activation checkpointing inside mixprec regions (issue 9): gradients with and without checkpointing."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

from mixprec import policy as P
from mixprec.activation_checkpoint import checkpoint, checkpoint_context
from mixprec.autocast import autocast
from mixprec.errors import AutocastError
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


def test_reentrant_checkpointing_under_a_python_layer_is_refused() -> None:
    block, x = _block(None), torch.randn(4, 16, requires_grad=True)
    with autocast("cpu", torch.float16), pytest.raises(AutocastError, match="use_reentrant=False"):
        checkpoint(block, x, use_reentrant=True)
    with autocast("cpu", torch.bfloat16):  # torch's tables alone: torch restores them, both kinds work
        assert torch.equal(checkpoint(block, x, use_reentrant=True), block(x))
