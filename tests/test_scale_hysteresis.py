"""Hysteresis by default follows DeepSpeed's DynamicLossScaler (issue 9, "Scaler"): the reference below is
written from DeepSpeed's documented ``update_scale`` rule, not from mixprec's code."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from mixprec.scaler import GradScaler


@dataclass
class DeepSpeedReference:
    """DeepSpeed ``DynamicLossScaler(init_scale, scale_factor=2, scale_window, min_scale=1, delayed_shift,
    consecutive_hysteresis=False)``: on overflow, if the hysteresis counter is at 1 the scale is divided
    (not below min_scale), else the counter drops by one; either way the overflow iteration is remembered.
    On a clean iteration the scale is multiplied once every ``scale_window`` iterations counted from the last
    overflow, and only then is the counter restored to ``delayed_shift``."""

    scale: float
    window: int
    delayed_shift: int
    min_scale: float = 1.0
    it: int = 0
    last_overflow: int = -1

    def __post_init__(self) -> None:
        self.hysteresis = self.delayed_shift

    def update(self, overflow: bool) -> float:
        if overflow:
            if self.delayed_shift == 1 or self.hysteresis == 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.hysteresis -= 1
            self.last_overflow = self.it
        elif (self.it - self.last_overflow) % self.window == 0:
            self.hysteresis = self.delayed_shift
            self.scale *= 2
        self.it += 1
        return self.scale


def _iterate(scaler: GradScaler, p: nn.Parameter, opt: torch.optim.Optimizer, overflow: bool) -> float:
    scaler.scale(p.sum()).backward()
    if overflow:
        p.grad[0] = float("inf")  # type: ignore[index]
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return scaler.get_scale()


def _scales(overflows: list[bool], **kwargs: float) -> list[float]:
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1e-3)
    scaler = GradScaler("cpu", **kwargs)  # type: ignore[arg-type]
    return [_iterate(scaler, p, opt, overflow) for overflow in overflows]


def test_persistent_overflow_keeps_halving_once_the_allowance_is_spent() -> None:
    """The issue's numbers: DeepSpeed/Megatron/apex give 1024, 512, 256, 128, 64 (mixprec 0.x halved only
    every second step: 1024, 512, 512, 256, 256)."""
    scales = _scales([True] * 6, init_scale=2048.0, hysteresis=2, growth_interval=1000)
    assert scales[1:] == [1024.0, 512.0, 256.0, 128.0, 64.0]
    old = _scales(
        [True] * 6, init_scale=2048.0, hysteresis=2, growth_interval=1000, hysteresis_rule="consecutive"
    )
    assert old[1:] == [1024.0, 1024.0, 512.0, 512.0, 256.0]


@settings(max_examples=25, deadline=None)
@given(
    overflows=st.lists(st.booleans(), min_size=1, max_size=30),
    hysteresis=st.integers(1, 4),
    window=st.integers(1, 4),
)
def test_default_rule_matches_deepspeed(overflows: list[bool], hysteresis: int, window: int) -> None:
    ref = DeepSpeedReference(scale=2.0**10, window=window, delayed_shift=hysteresis)
    expected = [ref.update(o) for o in overflows]
    assert _scales(overflows, init_scale=2.0**10, hysteresis=hysteresis, growth_interval=window) == expected


@pytest.mark.parametrize("rule", ["deepspeed", "consecutive"])
def test_hysteresis_survives_state_dict(rule: str) -> None:
    """The allowance left is part of the state: a resumed run continues as the uninterrupted one."""
    seq = [True, False, True, True, False, True, True, True]
    full = _scales(seq, init_scale=2.0**10, hysteresis=3, growth_interval=100, hysteresis_rule=rule)  # type: ignore[arg-type]
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1e-3)
    first = GradScaler("cpu", init_scale=2.0**10, hysteresis=3, growth_interval=100, hysteresis_rule=rule)  # type: ignore[arg-type]
    second = GradScaler("cpu")
    for i, overflow in enumerate(seq):
        if i == 4:
            second.load_state_dict(first.state_dict())
        _iterate(first if i < 4 else second, p, opt, overflow)
    assert second.get_scale() == full[-1]
