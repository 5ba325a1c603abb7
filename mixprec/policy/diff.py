"""Where two policies disagree, cell by cell (:func:`diff`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.errors import PolicyError
from mixprec.policy.cast_policy import Policy
from mixprec.policy.devices import device_spec
from mixprec.policy.render import diff_table, render_text
from mixprec.policy.rules import Action, OpRule

__all__ = ["PolicyDiff", "diff"]


@dataclass(frozen=True)
class PolicyDiff:
    """Where two policies disagree: (device, dtype, op, action in a, action in b) plus setting changes."""

    a: str
    b: str
    ops: tuple[tuple[str, torch.dtype, str, Action, Action], ...]
    settings: tuple[tuple[str, object, object], ...]

    def __bool__(self) -> bool:
        return bool(self.ops or self.settings)

    def __rich__(self) -> Any:
        return diff_table(self)

    def render(self, width: int = 120) -> str:
        return render_text(diff_table(self), width)


def diff(a: Policy, b: Policy) -> PolicyDiff:
    """Every (device, dtype, op) whose action differs between ``a`` and ``b``, and changed settings."""
    ops: list[tuple[str, torch.dtype, str, Action, Action]] = []
    devices = dict.fromkeys([t.device_type for t in a.tables] + [t.device_type for t in b.tables])
    for device in devices:
        for dtype in device_spec(device).autocast_dtypes:
            rules_a = _rules_or_empty(a, device, dtype)
            rules_b = _rules_or_empty(b, device, dtype)
            for op in sorted(rules_a.keys() | rules_b.keys()):
                act_a = rules_a[op].action if op in rules_a else Action.NATIVE
                act_b = rules_b[op].action if op in rules_b else Action.NATIVE
                if act_a is not act_b:
                    ops.append((device, dtype, op, act_a, act_b))
    settings = tuple(
        (name, getattr(a, name), getattr(b, name))
        for name in ("fp32_modules", "emulate_fp16")
        if getattr(a, name) != getattr(b, name)
    )
    return PolicyDiff(a.name, b.name, tuple(ops), settings)


def _rules_or_empty(policy: Policy, device: str, dtype: torch.dtype) -> Mapping[str, OpRule]:
    try:
        return policy.table(device).rules_for(dtype)
    except PolicyError:
        return {}
