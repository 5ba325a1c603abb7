"""mixprec.diagnostics.tables: the diagnostics' tables print as text with the built-in print (a user
trial's print(trace.table()) showed '<rich.table.Table object at 0x...>'), as rich renders them."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console
from torch import nn

import mixprec
from mixprec.diagnostics.cast_trace import CastTrace
from mixprec.diagnostics.gradients import analyze_grads
from mixprec.diagnostics.memory import memory_breakdown, memory_table
from mixprec.diagnostics.tables import TEXT_WIDTH


def _tables() -> list[object]:
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 8)
    with CastTrace() as trace:
        with mixprec.autocast("cpu", torch.float16):
            model(x).float().sum().backward()
    report = analyze_grads([(n, p.grad) for n, p in model.named_parameters()], scales=(1024.0,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    breakdown = memory_breakdown(model, opt, (x, torch.tensor([0, 1, 0])), "O2", estimate=True)
    return [trace.table(), trace.casts_table(), report.table(), memory_table([breakdown])]


@pytest.mark.parametrize("which", range(4))
def test_print_shows_a_table_as_rich_renders_it(which: int, capsys: pytest.CaptureFixture[str]) -> None:
    table = _tables()[which]
    print(table)
    printed = capsys.readouterr().out
    console = Console(file=io.StringIO(), width=TEXT_WIDTH, color_system=None, record=True)
    console.print(table)
    assert "object at 0x" not in printed
    assert printed.rstrip("\n") == console.export_text().rstrip("\n") and printed.count("\n") >= 4
