"""GradientMonitor keeps a bounded history (issue 14 item 10): a monitor left on for a long run must not
grow without end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.diagnostics import GradientMonitor
from mixprec.errors import ConfigError


def _backward(model: nn.Module) -> None:
    model.zero_grad()
    F.cross_entropy(model(torch.randn(4, 6)), torch.randint(0, 3, (4,))).backward()


def test_the_monitor_keeps_the_latest_reports_only() -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    monitor = GradientMonitor(model, every=2, max_reports=3)
    for _ in range(11):
        _backward(model)
        monitor.after_backward()
    analysed = list(range(1, 12, 2))  # every 2nd call, counted from 1: 1, 3, ..., 11
    assert [call for call, _ in monitor.reports] == analysed[-3:]
    assert monitor.calls == 11 and monitor.latest is monitor.reports[-1][1]


def test_the_default_history_is_bounded_and_the_bound_positive() -> None:
    model = nn.Linear(6, 3)
    assert 1 <= GradientMonitor(model).max_reports < float("inf")
    with pytest.raises(ConfigError, match="max_reports"):
        GradientMonitor(model, max_reports=0)
