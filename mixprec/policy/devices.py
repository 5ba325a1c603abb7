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
    # Whether fp16 GEMMs on this device type are at least as fast as fp32 ones, as a static fact; what
    # mixprec actually does on this machine is mixprec.hardware's decision (emulation.emulates).
    fast_fp16_gemm: bool


# CPU: torch's fp16 GEMMs run at 0.3-57 GFLOP/s depending on operand layout against ~150 for fp32 and
# ~600 for bf16 (AVX-512 BF16) on the reference machine, so fp16 GEMMs are emulated there.
# CUDA: tensor cores run fp16 x fp16 with fp32 accumulation natively.
DEVICES: Mapping[str, DeviceSpec] = types.MappingProxyType(
    {
        "cpu": DeviceSpec("cpu", (torch.bfloat16, torch.float16), fast_fp16_gemm=False),
        "cuda": DeviceSpec("cuda", (torch.float16, torch.bfloat16), fast_fp16_gemm=True),
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
