"""What a (policy, device, dtype) region needs from the Python layer, computed once and cached.

A plan holds the effective policy (the preset with the user's registrations on top), whether half GEMMs
are emulated (:func:`mixprec.emulation.emulates`, from :mod:`mixprec.hardware`), and the Python-level
names of only the ops whose action differs from torch's own autocast. Plans, and the
:class:`~mixprec.region.Region` objects built from them, are cached, so entering the same region every
step costs a dict lookup and gives the same objects (compiled code that reads them then keeps its
guards and does not recompile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.emulation import emulates
from mixprec.policy.cast_policy import Policy
from mixprec.policy.names import python_names
from mixprec.policy.registry import effective_policy, registry_version
from mixprec.policy.rules import Action
from mixprec.policy.tables import RECURRENT_OPS
from mixprec.region import Region

__all__ = ["Plan", "plan", "region_for"]


@dataclass(frozen=True)
class Plan:
    policy: Policy
    emulate: bool
    actions: dict[str, Action]


_PLANS: dict[tuple[int, int, str, torch.dtype, bool], tuple[Policy, Plan]] = {}
_REGIONS: dict[tuple[int, bool], tuple[Plan, Region]] = {}
_CACHE_MAX = 64  # policies are usually a few long-lived presets; bound the caches for the rest


def plan(policy: Policy, device_type: str, dtype: torch.dtype) -> Plan:
    """The cached plan of ``policy`` (with the current registrations) on (device_type, dtype)."""
    # The hardware's answer is part of the key: MIXPREC_HALF_ARITHMETIC may change between regions.
    allow = dtype is not torch.float16 or policy.emulate_fp16  # emulate_fp16=False: torch's fp16 kernels
    emulate = emulates(device_type, dtype, allow)
    key = (id(policy), registry_version(), device_type, dtype, emulate)
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is policy:
        return hit[1]
    effective = effective_policy(policy)
    changed = effective.overrides(device_type, dtype)
    if emulate:
        rules = effective.table(device_type).rules_for(dtype)
        for op, rule in rules.items():
            if rule.action is Action.LOWER:
                changed[op] = Action.LOWER
        # recurrent layers without a rule of their own run in fp32 (RECURRENT_OPS: why); a rule wins
        changed |= {op: Action.FP32 for op in RECURRENT_OPS if op not in rules}
    actions = {name: action for op, action in changed.items() for name in python_names(op)}
    made = Plan(effective, emulate, actions)
    if len(_PLANS) >= _CACHE_MAX:
        _PLANS.clear()
    _PLANS[key] = (policy, made)
    return made


def region_for(made: Plan, device_type: str, dtype: torch.dtype, cache_enabled: bool) -> Region:
    """The one enabled :class:`Region` of ``made`` (a plan is for one device and dtype)."""
    key = (id(made), cache_enabled)
    hit = _REGIONS.get(key)
    if hit is not None and hit[0] is made:
        return hit[1]
    region = Region(device_type, dtype, True, cache_enabled, made.policy, made.emulate, made.actions)
    if len(_REGIONS) >= _CACHE_MAX:
        _REGIONS.clear()
    _REGIONS[key] = (made, region)
    return region
