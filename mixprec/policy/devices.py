"""Platform facts about each device type that shape what autocast can and should do there."""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mixprec.errors import PolicyError

__all__ = ["DEVICES", "DeviceSpec", "device_spec"]


@dataclass(frozen=True)
class DeviceSpec:
    """Platform facts about a device type that shape what autocast can and should do there."""

    device_type: str
    autocast_dtypes: tuple[torch.dtype, ...]


# Whether half GEMMs run natively or emulated on this machine is mixprec.hardware's decision, per device
# and dtype (emulation.emulates), not a static fact of the device type.
DEVICES: Mapping[str, DeviceSpec] = types.MappingProxyType(
    {
        "cpu": DeviceSpec("cpu", (torch.bfloat16, torch.float16)),
        "cuda": DeviceSpec("cuda", (torch.float16, torch.bfloat16)),
    }
)


def device_spec(device_type: str) -> DeviceSpec:
    """The :class:`DeviceSpec` for ``device_type``; raises PolicyError naming the known device types."""
    spec = DEVICES.get(device_type)
    if spec is None:
        raise PolicyError(
            f"unknown device type {device_type!r} for autocast",
            f"use one of {sorted(DEVICES)} (a device *type*: 'cuda', not 'cuda:0')",
        )
    return spec
