"""The named policies: ``torch`` (the default), ``torch-native`` and ``apex``, built from the op tables."""

from __future__ import annotations

import types
from collections.abc import Mapping

from mixprec.errors import PolicyError
from mixprec.policy.cast_policy import Policy
from mixprec.policy.rules import DeviceTable, OpRule
from mixprec.policy.tables import APEX_EXTRA_FP32, MIXPREC_CPU_DEVIATIONS, TORCH_CPU, TORCH_CUDA

__all__ = ["APEX", "DEFAULT_POLICY", "PRESETS", "TORCH", "TORCH_NATIVE", "get_preset"]


def _without_redundant(base: tuple[OpRule, ...], extra: tuple[OpRule, ...]) -> tuple[OpRule, ...]:
    """``extra`` minus entries that ``base`` already gives the same action for every dtype."""
    same = {(r.op, r.action) for r in base if not r.dtypes}
    return tuple(r for r in extra if (r.op, r.action) not in same)


TORCH_NATIVE = Policy(
    name="torch-native",
    tables=(DeviceTable("cpu", TORCH_CPU), DeviceTable("cuda", TORCH_CUDA)),
    description="exactly torch.autocast's op tables (torch 2.13), no deviations",
)

TORCH = Policy(
    name="torch",
    tables=(DeviceTable("cpu", TORCH_CPU + MIXPREC_CPU_DEVIATIONS), DeviceTable("cuda", TORCH_CUDA)),
    description="torch.autocast's op tables, plus binary_cross_entropy banned under fp16 on CPU too",
)

APEX = Policy(
    name="apex",
    tables=(
        DeviceTable("cpu", TORCH.table("cpu").rules + _without_redundant(TORCH_CPU, APEX_EXTRA_FP32)),
        DeviceTable("cuda", TORCH_CUDA + _without_redundant(TORCH_CUDA, APEX_EXTRA_FP32)),
    ),
    description="the default plus apex O1's extra fp32 ops (softmax, reductions, norms, losses) and gelu",
)

# The default: torch's behaviour, so code moving from torch.autocast sees the same dtypes.
DEFAULT_POLICY = TORCH

PRESETS: Mapping[str, Policy] = types.MappingProxyType({p.name: p for p in (TORCH, TORCH_NATIVE, APEX)})


def get_preset(name: str) -> Policy:
    """The preset called ``name``; raises PolicyError naming the presets."""
    try:
        return PRESETS[name]
    except KeyError:
        raise PolicyError(f"unknown policy preset {name!r}", f"use one of {sorted(PRESETS)}") from None
