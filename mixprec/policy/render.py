"""Policies and policy diffs as rich tables (what ``rich.print(policy)`` and ``mixprec`` commands show)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from mixprec.formats import dtype_label
from mixprec.policy.devices import device_spec
from mixprec.policy.rules import Action

if TYPE_CHECKING:
    from mixprec.policy.cast_policy import Policy
    from mixprec.policy.diff import PolicyDiff

__all__ = ["diff_table", "policy_table", "render_text"]

_ACTION_STYLES = {
    Action.LOWER: "green",
    Action.FP32: "cyan",
    Action.PROMOTE: "yellow",
    Action.BANNED: "bold red",
    Action.NATIVE: "dim",
}
_ACTION_ORDER = {action: i for i, action in enumerate(Action)}


def _styled(action: Action) -> str:
    return f"[{_ACTION_STYLES[action]}]{action.value}[/]"


def policy_table(policy: Policy) -> Any:
    """One row per op, one column per (device, dtype); deviations from torch starred, with their reasons."""
    from rich.table import Table

    columns = [(t.device_type, d) for t in policy.tables for d in device_spec(t.device_type).autocast_dtypes]
    title = f"cast policy {policy.name!r}" + (f": {policy.description}" if policy.description else "")
    table = Table(title=title)
    table.add_column("op")
    for device, dtype in columns:
        table.add_column(f"{device} {dtype_label(dtype)}")
    table.add_column("why it differs from torch", overflow="fold", ratio=1)
    ops = dict.fromkeys(op for t in policy.tables for op in t.ops())

    def sort_key(op: str) -> tuple[int, str]:
        first = min(_ACTION_ORDER[policy.action(op, d, dt)] for d, dt in columns)
        return first, op

    for op in sorted(ops, key=sort_key):
        cells = []
        reasons = []
        for device, dtype in columns:
            rule = policy.table(device).rules_for(dtype).get(op)
            mark = "*" if rule and rule.is_deviation else ""
            cells.append(_styled(rule.action if rule else Action.NATIVE) + mark)
            if rule and rule.is_deviation and rule.reason and rule.reason not in reasons:
                reasons.append(rule.reason)
        table.add_row(op, *cells, "; ".join(reasons))
    for module in policy.fp32_modules:
        table.add_row(f"module {module}", *["fp32*"] * len(columns), "policy fp32_modules entry")
    return table


def diff_table(diff: PolicyDiff) -> Any:
    """One row per changed (device, dtype, op) cell, then one per changed setting."""
    from rich.table import Table

    table = Table(title=f"policy diff: {diff.a} -> {diff.b}", show_lines=False)
    for col in ("device", "dtype", "op", diff.a, diff.b):
        table.add_column(col)
    for device, dtype, op, act_a, act_b in diff.ops:
        table.add_row(device, dtype_label(dtype), op, _styled(act_a), _styled(act_b))
    for setting, val_a, val_b in diff.settings:
        table.add_row("*", "*", setting, str(val_a), str(val_b))
    return table


def render_text(renderable: Any, width: int) -> str:
    """``renderable`` as plain text, ``width`` columns wide."""
    from rich.console import Console

    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text()
