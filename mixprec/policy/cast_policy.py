"""The :class:`Policy` type: a named, immutable set of per-device op tables plus module rules."""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mixprec.errors import PolicyError
from mixprec.policy.devices import device_spec
from mixprec.policy.names import CALLED_INSIDE, op_name
from mixprec.policy.render import policy_table, render_text
from mixprec.policy.rules import Action, DeviceTable, OpRule, Source
from mixprec.policy.tables import TORCH_TABLES

__all__ = ["Policy"]

# Policy.compile_key -> the policy, for as long as it lives (a weak map: policies made in a loop are freed).
_BY_COMPILE_KEY: weakref.WeakValueDictionary[str, Policy] = weakref.WeakValueDictionary()
_KEY_NUMBERS = itertools.count()


def _module_key(module: type | str) -> str:
    if isinstance(module, str):
        if not module:
            raise PolicyError("an fp32 module entry is an empty string", "pass a class or a class name")
        return module
    if isinstance(module, type) and issubclass(module, torch.nn.Module):
        return f"{module.__module__}.{module.__qualname__}"
    raise PolicyError(
        f"fp32 module entries must be nn.Module subclasses or class names, got {module!r}",
        "to keep one module instance in fp32 use mixprec.autocast.keep_fp32(module)",
    )


@functools.cache
def _torch_rules_for(device_type: str, dtype: torch.dtype) -> Mapping[str, OpRule]:
    return DeviceTable(device_type, TORCH_TABLES[device_type]).rules_for(dtype)


_Derive = Callable[..., "Policy"]


def _deriving(action: Action, doc: str) -> _Derive:
    """A ``with_<action>(*ops, device_type=None, dtypes=(), reason="")`` method: the one way to derive."""

    def method(
        self: Policy,
        *ops: object,
        device_type: str | None = None,
        dtypes: tuple[torch.dtype, ...] = (),
        reason: str = "",
    ) -> Policy:
        return self.with_action(action, *ops, device_type=device_type, dtypes=dtypes, reason=reason)

    method.__name__ = method.__qualname__ = f"with_{action.value}"
    method.__doc__ = doc
    return method


@dataclass(frozen=True)
class Policy:
    """A named, immutable cast policy: one :class:`DeviceTable` per device type, plus module rules.

    ``fp32_modules`` holds class names (``"LayerNorm"``) or qualified names (``"torch.nn.LayerNorm"``);
    modules of those classes run entirely in fp32 inside an autocast region. ``emulate_fp16`` lets mixprec
    emulate half GEMMs where :mod:`mixprec.hardware` finds no fast kernels for them; set it False to get
    torch's own kernels there. Derive variants with :meth:`with_action` (or its per-action spellings
    ``with_lower``, ``with_fp32``, ``with_promote``, ``with_banned``, ``with_native``) and the other
    ``with_*`` methods; they return new policies.
    """

    name: str
    tables: tuple[DeviceTable, ...]
    fp32_modules: tuple[str, ...] = ()
    emulate_fp16: bool = True
    description: str = field(default="", compare=False)
    # Names this policy in compiled code (see from_compile_key); unique per instance, set on creation.
    compile_key: str = field(init=False, default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", tuple(self.tables))
        object.__setattr__(self, "fp32_modules", tuple(_module_key(m) for m in self.fp32_modules))
        seen = [t.device_type for t in self.tables]
        if len(seen) != len(set(seen)):
            raise PolicyError(f"Policy {self.name!r} has two tables for one device ({seen})", "merge them")
        self._register()

    def _register(self) -> None:
        key = f"{self.name}#{next(_KEY_NUMBERS)}"
        object.__setattr__(self, "compile_key", key)
        _BY_COMPILE_KEY[key] = self

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (pickle, deepcopy) is another instance: it gets a key of its own."""
        self.__dict__.update(state)
        self._register()

    @staticmethod
    def from_compile_key(key: str) -> Policy:
        """The live policy whose :attr:`compile_key` is ``key``. Compiled code names a policy by this string:
        torch.compile before torch 2.13 cannot hand a frozen dataclass to a function it runs eagerly while
        tracing ("can't reconstruct arbitrary frozen dataclass instances"), but it can hand a string."""
        return _BY_COMPILE_KEY[key]

    # ---- queries -------------------------------------------------------------------------------------

    def table(self, device_type: str) -> DeviceTable:
        for table in self.tables:
            if table.device_type == device_type:
                return table
        device_spec(device_type)  # unknown device type: the clearer error
        raise PolicyError(
            f"policy {self.name!r} has no table for {device_type!r}",
            f"add one with policy.with_table(DeviceTable({device_type!r}, rules)), or use policy.TORCH",
        )

    def rule(self, op: object, device_type: str, dtype: torch.dtype) -> OpRule | None:
        """The rule that decides ``op`` under (device_type, dtype), or None when the op is unlisted."""
        return self.table(device_type).rules_for(dtype).get(op_name(op))

    def action(self, op: object, device_type: str, dtype: torch.dtype) -> Action:
        """What happens to ``op``'s inputs: its rule's action, or ``Action.NATIVE`` when unlisted."""
        rule = self.rule(op, device_type, dtype)
        return Action.NATIVE if rule is None else rule.action

    def deviations(self) -> tuple[tuple[str, OpRule], ...]:
        """(device_type, rule) for every entry that is not torch's own behaviour."""
        return tuple((t.device_type, r) for t in self.tables for r in t.rules if r.is_deviation)

    def overrides(self, device_type: str, dtype: torch.dtype) -> dict[str, Action]:
        """Ops whose action differs from torch's dispatcher-level autocast under (device_type, dtype).

        Only these need a Python-level layer; everything else torch.autocast already does itself.
        """
        mine = self.table(device_type).rules_for(dtype)
        torch_own = _torch_rules_for(device_type, dtype)
        changed: dict[str, Action] = {}
        for op in mine.keys() | torch_own.keys():
            ours = mine[op].action if op in mine else Action.NATIVE
            theirs = torch_own[op].action if op in torch_own else Action.NATIVE
            if ours is not theirs:
                changed[op] = ours
        return changed

    # ---- derivation ----------------------------------------------------------------------------------

    def with_rules(self, *rules: OpRule, device_type: str | None = None) -> Policy:
        """Append rules (they win over earlier ones) to one device's table, or to every table."""
        inside = next((r.op for r in rules if r.source is Source.USER and r.op in CALLED_INSIDE), None)
        if inside is not None:  # a rule that would never act
            raise PolicyError(
                f"a rule for {inside!r} would never act: torch calls it from C++ inside another function, "
                "below the Python calls mixprec's layer handles (torch's autocast decides it by its own "
                "table).",
                f"write the rule for {CALLED_INSIDE[inside]}, the function your code calls.",
            )
        targets = {t.device_type for t in self.tables} if device_type is None else {device_type}
        if device_type is not None:
            self.table(device_type)  # validates
        tables = tuple(
            replace(t, rules=t.rules + tuple(rules)) if t.device_type in targets else t for t in self.tables
        )
        return replace(self, tables=tables)

    def with_action(
        self,
        action: Action | str,
        *ops: object,
        device_type: str | None = None,
        dtypes: tuple[torch.dtype, ...] = (),
        reason: str = "",
    ) -> Policy:
        """Give ``ops`` ``action`` on one device (or all), under ``dtypes`` (empty: every dtype)."""
        rules = tuple(
            OpRule(op_name(op), Action(action), dtypes=dtypes, source=Source.USER, reason=reason)
            for op in ops
        )
        return self.with_rules(*rules, device_type=device_type)

    with_lower = _deriving(Action.LOWER, "Run ``ops`` in the region's half-precision dtype.")
    with_fp32 = _deriving(Action.FP32, "Run ``ops`` in float32.")
    with_promote = _deriving(Action.PROMOTE, "Run ``ops`` in the widest floating dtype among their inputs.")
    with_banned = _deriving(
        Action.BANNED, "Make ``ops`` raise inside autocast regions (``reason`` becomes the error's advice)."
    )
    with_native = _deriving(Action.NATIVE, "Leave ``ops`` alone: they run in whatever dtypes they are given.")

    def with_fp32_modules(self, *modules: type | str) -> Policy:
        """Run every module of these classes (or class names) entirely in fp32."""
        keys = tuple(_module_key(m) for m in modules)
        return replace(self, fp32_modules=tuple(dict.fromkeys(self.fp32_modules + keys)))

    def with_emulate_fp16(self, emulate: bool) -> Policy:
        return replace(self, emulate_fp16=bool(emulate))

    def with_table(self, table: DeviceTable) -> Policy:
        others = tuple(t for t in self.tables if t.device_type != table.device_type)
        return replace(self, tables=others + (table,))

    # ---- display -------------------------------------------------------------------------------------

    def __rich__(self) -> Any:
        return policy_table(self)

    def render(self, width: int = 140) -> str:
        """The policy as a text table (what ``rich.print(policy)`` shows)."""
        return render_text(policy_table(self), width)

