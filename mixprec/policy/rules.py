"""The entries of a cast policy: what an autocast region does with one op (:class:`OpRule`), and one
device's ordered list of them (:class:`DeviceTable`)."""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mixprec.errors import PolicyError
from mixprec.policy.devices import device_spec

__all__ = ["Action", "DeviceTable", "OpRule", "Source"]


class Action(str, enum.Enum):
    """What an autocast region does with an op's floating-point inputs."""

    LOWER = "lower"
    FP32 = "fp32"
    PROMOTE = "promote"
    BANNED = "banned"
    NATIVE = "native"


class Source(str, enum.Enum):
    """Where a rule comes from: torch's own table, a documented mixprec deviation, or a user."""

    TORCH = "torch"
    MIXPREC = "mixprec"
    USER = "user"


@dataclass(frozen=True)
class OpRule:
    """One table entry: ``op`` gets ``action`` under the listed autocast dtypes (empty: all of them)."""

    op: str
    action: Action
    dtypes: tuple[torch.dtype, ...] = ()
    source: Source = Source.TORCH
    reason: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.op, str) or not self.op:
            raise PolicyError(f"OpRule.op must be a non-empty op name, got {self.op!r}", "use op_name(fn)")
        object.__setattr__(self, "action", Action(self.action))
        object.__setattr__(self, "source", Source(self.source))
        object.__setattr__(self, "dtypes", tuple(self.dtypes))
        for dtype in self.dtypes:
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise PolicyError(
                    f"OpRule({self.op!r}).dtypes must hold floating torch dtypes, got {dtype!r}",
                    "use torch.float16 or torch.bfloat16",
                )
        # Every deliberate deviation from torch's table must say why, where it is declared.
        if self.source is Source.MIXPREC and not self.reason:
            raise PolicyError(f"OpRule({self.op!r}) deviates from torch but has no reason", "add reason=...")

    def applies_to(self, dtype: torch.dtype) -> bool:
        return not self.dtypes or dtype in self.dtypes

    @property
    def is_deviation(self) -> bool:
        """True when this entry is not torch's own behaviour (a mixprec or user choice)."""
        return self.source is not Source.TORCH


@dataclass(frozen=True)
class DeviceTable:
    """The ordered rules of one device type; a later rule for the same op and dtype wins."""

    device_type: str
    rules: tuple[OpRule, ...]

    def __post_init__(self) -> None:
        device_spec(self.device_type)
        object.__setattr__(self, "rules", tuple(self.rules))

    @functools.cached_property
    def _index(self) -> dict[torch.dtype, dict[str, OpRule]]:
        index: dict[torch.dtype, dict[str, OpRule]] = {}
        for dtype in device_spec(self.device_type).autocast_dtypes:
            index[dtype] = {rule.op: rule for rule in self.rules if rule.applies_to(dtype)}
        return index

    def rules_for(self, dtype: torch.dtype) -> Mapping[str, OpRule]:
        """op name -> winning rule under ``dtype``."""
        index = self._index.get(dtype)
        if index is None:
            spec = device_spec(self.device_type)
            raise PolicyError(
                f"{self.device_type} autocast does not support {dtype}",
                f"use one of {', '.join(str(d) for d in spec.autocast_dtypes)}",
            )
        return index

    def ops(self) -> tuple[str, ...]:
        """Every op name listed, in first-appearance order."""
        return tuple(dict.fromkeys(rule.op for rule in self.rules))
