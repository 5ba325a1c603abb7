"""apex-style global registrations (``register_half_function`` & co.), layered over any policy.

The registry is module-level and mutable, kept apart from the frozen presets: :func:`effective_policy`
applies it on top of whatever policy a region uses. A registered user function is wrapped; the wrapper
asks the cast engine (:func:`mixprec.cast_handlers.call_registered`) to run it under the current region's
rule for it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from mixprec.errors import PolicyError
from mixprec.policy.cast_policy import Policy
from mixprec.policy.devices import device_spec
from mixprec.policy.names import MIXPREC_OP_ATTR, is_torch_callable, op_name
from mixprec.policy.presets import DEFAULT_POLICY
from mixprec.policy.rules import Action, OpRule, Source

__all__ = [
    "Runner",
    "clear_registrations",
    "effective_policy",
    "install_runner",
    "lookup",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "registered_rules",
    "registry_version",
]


# How a registered function runs: (registered name, function, args, kwargs) -> result.
Runner = Callable[[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]


def _plain_call(key: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return fn(*args, **kwargs)


class _Registry:
    """The user's global registrations, in order; layered over any policy by :func:`effective_policy`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: dict[str, OpRule] = {}
        self.version = 0  # bumped on every change so cached region plans know to rebuild
        self.runner: Runner = _plain_call  # replaced by the cast engine on import

    def add(self, rule: OpRule) -> None:
        with self._lock:
            self._rules.pop(rule.op, None)  # re-registration moves the op to the end: latest wins
            self._rules[rule.op] = rule
            self.version += 1

    def rules(self) -> tuple[OpRule, ...]:
        return tuple(self._rules.values())

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self.version += 1


_REGISTRY = _Registry()
_REGISTER_NAMES = {
    Action.LOWER: "register_half_function",
    Action.FP32: "register_float_function",
    Action.PROMOTE: "register_promote_function",
}


def install_runner(runner: Runner) -> None:
    """Make ``runner`` run every registered function (the cast engine calls this once, on import)."""
    _REGISTRY.runner = runner


def registered_rules() -> tuple[OpRule, ...]:
    """The user's global registrations, oldest first."""
    return _REGISTRY.rules()


def registry_version() -> int:
    """A counter bumped on every registration change (cached region plans compare it)."""
    return _REGISTRY.version


def clear_registrations() -> None:
    """Forget every register_* registration (attributes patched on user modules stay wrapped but inert)."""
    _REGISTRY.clear()


def _register(action: Action, target: object, name: str | None) -> Any:
    who = _REGISTER_NAMES[action]
    if name is None:
        if not callable(target):
            raise PolicyError(f"{who}(fn) needs a function, got {target!r}", f"or use {who}(module, 'name')")
        return _register_callable(action, target, who)
    if not isinstance(name, str) or not hasattr(target, name):
        raise PolicyError(
            f"{who}({getattr(target, '__name__', target)!r}, {name!r}): no attribute {name!r} there",
            "pass the module (or class) that defines the function, and its exact name",
        )
    attr = getattr(target, name)
    if is_torch_callable(attr) or target is torch.Tensor:
        # torch functions are matched by op name in every spelling (torch.X, F.X, Tensor.X), the way
        # torch's dispatcher sees one aten op; torch itself is never patched.
        _REGISTRY.add(OpRule(op_name(name), action, source=Source.USER, reason=f"{who}"))
        return None
    setattr(target, name, _register_callable(action, attr, who, key=f"{target.__name__}.{name}"))
    return None


def _register_callable(action: Action, fn: Any, who: str, key: str | None = None) -> Any:
    key = key or op_name(fn)
    _REGISTRY.add(OpRule(key, action, source=Source.USER, reason=who))
    inner = getattr(fn, "__wrapped__", fn) if getattr(fn, MIXPREC_OP_ATTR, None) else fn

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return _REGISTRY.runner(key, inner, args, kwargs)

    setattr(wrapper, MIXPREC_OP_ATTR, key)
    return wrapper


def register_half_function(module_or_fn: Any, name: str | None = None) -> Any:
    """Run a function in half precision inside autocast regions (apex's ``register_half_function``).

    ``register_half_function(module, "name")`` registers ``module.name``: torch functions by op name,
    other modules' functions by wrapping the attribute. ``@register_half_function`` decorates your own.
    A registered function's floating tensor arguments are cast and its body runs with autocast off.
    """
    return _register(Action.LOWER, module_or_fn, name)


def register_float_function(module_or_fn: Any, name: str | None = None) -> Any:
    """Run a function in fp32 inside autocast regions (apex's ``register_float_function``)."""
    return _register(Action.FP32, module_or_fn, name)


def register_promote_function(module_or_fn: Any, name: str | None = None) -> Any:
    """Run a function in its widest floating input dtype (apex's ``register_promote_function``)."""
    return _register(Action.PROMOTE, module_or_fn, name)


def effective_policy(policy: Policy | None = None) -> Policy:
    """``policy`` (default: DEFAULT_POLICY) with the global registrations applied on top."""
    base = DEFAULT_POLICY if policy is None else policy
    if not isinstance(base, Policy):
        raise PolicyError(
            f"policy must be a mixprec.policy.Policy, got {type(base).__name__}",
            "use a preset such as mixprec.policy.get_preset('torch'), or one derived from it",
        )
    rules = _REGISTRY.rules()
    return base.with_rules(*rules) if rules else base


def lookup(
    op: object,
    device_type: str = "cpu",
    dtype: torch.dtype | None = None,
    policy: Policy | None = None,
) -> OpRule | None:
    """What ``policy`` (with the user's registrations) does with ``op`` under (device_type, dtype).

    Returns the deciding :class:`OpRule`, or None when the op is unlisted (it runs in its input dtypes).
    ``dtype`` defaults to torch's current autocast dtype for the device.
    """
    if dtype is None:
        dtype = torch.get_autocast_dtype(device_spec(device_type).device_type)
    return effective_policy(policy).rule(op, device_type, dtype)
