"""Per-op cast policies for autocast regions, as plain data.

A :class:`Policy` says, per device type and autocast dtype, what happens to each op inside an autocast
region (:class:`Action`):

* ``lower``   -- cast floating inputs to the region's dtype (fp16/bf16): GEMMs and convolutions, whose
  half-precision kernels accumulate in fp32 and run several times faster.
* ``fp32``    -- cast floating inputs to float32: ops whose result leaves the half range or loses precision
  (exp/log/pow, softmax, norms, long sums, losses).
* ``promote`` -- cast floating inputs to the widest floating input dtype: ops taking several tensors that
  must agree (cat, stack, addcmul, ...).
* ``banned``  -- raise: ops that are unsafe under autocast (binary_cross_entropy under fp16).
* ``native``  -- no casts at all; the op runs in the dtypes it is given (what every unlisted op does).

The package, one concept per module: ``rules`` (Action, OpRule, DeviceTable), ``devices`` (DeviceSpec),
``names`` (:func:`op_name`), ``tables`` (the op tables as pure data), ``cast_policy`` (the Policy type),
``presets`` (``torch``, ``torch-native``, ``apex``), ``registry`` (apex-style global registrations),
``diff`` and ``render`` (rich tables). It imports nothing of the cast engine, which reads it.
"""

from __future__ import annotations

from mixprec.errors import PolicyError
from mixprec.policy.cast_policy import Policy
from mixprec.policy.devices import DEVICES, DeviceSpec, device_spec
from mixprec.policy.diff import PolicyDiff, diff
from mixprec.policy.names import PY_ALIASES, op_name
from mixprec.policy.presets import APEX, DEFAULT_POLICY, PRESETS, TORCH, TORCH_NATIVE, get_preset
from mixprec.policy.registry import (
    clear_registrations,
    effective_policy,
    lookup,
    register_float_function,
    register_half_function,
    register_promote_function,
    registered_rules,
    registry_version,
)
from mixprec.policy.rules import Action, DeviceTable, OpRule, Source

__all__ = [
    # data model
    "Action",
    "Source",
    "OpRule",
    "DeviceTable",
    "DeviceSpec",
    "Policy",
    "PolicyDiff",
    "PolicyError",
    # device facts and presets
    "DEVICES",
    "device_spec",
    "TORCH",
    "TORCH_NATIVE",
    "APEX",
    "DEFAULT_POLICY",
    "PRESETS",
    "get_preset",
    # queries
    "op_name",
    "PY_ALIASES",
    "lookup",
    "diff",
    # apex-style global registration
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "registered_rules",
    "registry_version",
    "clear_registrations",
    "effective_policy",
]
