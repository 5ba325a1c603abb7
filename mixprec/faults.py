"""Fault injection: put inf/NaN into gradients or activations at chosen or random steps, to check that a
mixed-precision training loop survives what fp16 overflow does to it.

Why: an fp16 overflow is rare and depends on the data, so a loop that mishandles it (steps on an inf
gradient, writes NaN into the fp32 masters or into Adam's moments, never lets the scale recover) passes
every short test. Injecting the fault on purpose makes the rare path run on every test.

Two places a fault can enter, each a hook that removes itself:

* ``inject_grad_faults(param_or_module, ...)``: a tensor hook on one parameter writes inf/NaN into one
  element of its gradient during the backward passes the schedule picks. That is what an overflow in one
  layer's backward looks like to the scaler: one non-finite element among finite ones.
* ``inject_activation_faults(module, ...)``: a forward hook writes inf/NaN into one element of the
  module's output on the forward calls the schedule picks. The non-finite value then flows through the
  rest of the forward, the loss and every gradient behind it, as an overflowing activation would.

A schedule counts calls (backward passes of that parameter, or training-mode forward calls of that module)
from 0, and fires at the indices in ``at`` and at a ``rate`` fraction of the others. Whether index i fires
depends only on ``(seed, i)``, never on how many indices were asked before, so a resumed run (set
``calls``) fires at the same steps as an uninterrupted one.

``nonfinite_optimizer_state(optimizer)`` lists the parameters and optimizer-state tensors (masters,
momentum, Adam moments) that hold inf/NaN: after a correctly skipped step it is empty.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from mixprec.diagnostics.overflow import finite_flags
from mixprec.errors import ConfigError

__all__ = [
    "FaultKind",
    "FaultSchedule",
    "FaultInjection",
    "inject_grad_faults",
    "inject_activation_faults",
    "nonfinite_optimizer_state",
]


class FaultKind(str, Enum):
    """The non-finite value a fault writes."""

    INF = "inf"
    NEG_INF = "-inf"
    NAN = "nan"


# kind -> the value written (a table, so adding a kind is one line)
_VALUES: dict[FaultKind, float] = {
    FaultKind.INF: float("inf"),
    FaultKind.NEG_INF: float("-inf"),
    FaultKind.NAN: float("nan"),
}

# Mixes the call index into the seed so that neighbouring (seed, index) pairs draw unrelated numbers;
# any large odd constant does.
_INDEX_STRIDE = 1_000_003


@dataclass(frozen=True)
class FaultSchedule:
    """Which calls (0-based) get a fault: every index in ``at``, and each other index with probability
    ``rate``, decided by ``(seed, index)`` alone."""

    at: frozenset[int] = field(default_factory=frozenset)
    rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ConfigError(
                f"rate must be in [0, 1], got {self.rate!r}.", "e.g. rate=0.05 for 5% of the steps."
            )
        if any(not isinstance(i, int) or i < 0 for i in self.at):
            raise ConfigError(
                f"at must hold non-negative step indices, got {sorted(self.at, key=str)!r}.",
                "count calls from 0, e.g. at={3, 10}.",
            )

    def fires(self, index: int) -> bool:
        if index in self.at:
            return True
        return self.rate > 0.0 and random.Random(self.seed * _INDEX_STRIDE + index).random() < self.rate

    def indices(self, n: int) -> list[int]:
        """The indices below ``n`` that fire (to know in advance which steps a run will skip)."""
        return [i for i in range(n) if self.fires(i)]


class FaultInjection:
    """A live injection: counts calls, records where it fired, removes its hook on ``remove()`` or on
    leaving a ``with`` block. Set ``calls`` to resume counting from a checkpointed step."""

    def __init__(self, schedule: FaultSchedule, kind: FaultKind, element: int) -> None:
        self.schedule = schedule
        self.kind = kind
        self.element = element
        self.calls = 0
        self.fired: list[int] = []
        self._handle: RemovableHandle | None = None

    def _next(self) -> bool:
        """Advance the call counter; True when this call gets a fault."""
        index = self.calls
        self.calls += 1
        if self.schedule.fires(index):
            self.fired.append(index)
            return True
        return False

    def _poison(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` with one element set to the fault value (a copy: autograd may still need ``t``)."""
        out = t.clone()
        flat = out.view(-1)
        flat[self.element % flat.numel()] = _VALUES[self.kind]
        return out

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __enter__(self) -> FaultInjection:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()


def _schedule(at: Iterable[int], rate: float, seed: int) -> FaultSchedule:
    return FaultSchedule(frozenset(at), rate, seed)


def _first_trainable(target: nn.Module | torch.Tensor) -> torch.Tensor:
    if isinstance(target, torch.Tensor):
        param = target
    else:
        param = next((p for p in target.parameters() if p.requires_grad), None)  # type: ignore[assignment]
    if param is None or not param.requires_grad:
        raise ConfigError(
            "inject_grad_faults needs a parameter that requires grad.",
            "pass a parameter (model[0].weight) or a module that has trainable parameters.",
        )
    return param


def inject_grad_faults(
    target: nn.Module | torch.Tensor,
    *,
    at: Iterable[int] = (),
    rate: float = 0.0,
    seed: int = 0,
    kind: FaultKind | str = FaultKind.INF,
    element: int = 0,
) -> FaultInjection:
    """Write ``kind`` into element ``element`` of ``target``'s gradient (a parameter, or a module's first
    trainable parameter) on the backward passes the schedule picks. Counts backward passes through that
    parameter, micro-batches included. The value enters before gradient accumulation and before DDP's
    all-reduce, as a real overflow would."""
    param = _first_trainable(target)
    injection = FaultInjection(_schedule(at, rate, seed), FaultKind(kind), element)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return injection._poison(grad) if injection._next() else grad

    injection._handle = param.register_hook(hook)
    return injection


def inject_activation_faults(
    module: nn.Module,
    *,
    at: Iterable[int] = (),
    rate: float = 0.0,
    seed: int = 0,
    kind: FaultKind | str = FaultKind.INF,
    element: int = 0,
    training_only: bool = True,
) -> FaultInjection:
    """Write ``kind`` into element ``element`` of ``module``'s output (the first tensor of a tuple) on the
    forward calls the schedule picks. With ``training_only`` (default) forwards in eval mode are neither
    counted nor poisoned, so validation does not shift the schedule."""
    injection = FaultInjection(_schedule(at, rate, seed), FaultKind(kind), element)

    def hook(mod: nn.Module, args: Any, output: Any) -> Any:
        if training_only and not mod.training:
            return None
        if not injection._next():
            return None
        if isinstance(output, torch.Tensor):
            return injection._poison(output)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (injection._poison(output[0]), *output[1:])
        raise ConfigError(
            f"{type(mod).__name__} returned {type(output).__name__}; activation faults need a tensor output.",
            "hook a submodule that returns a tensor (e.g. a Linear or an activation).",
        )

    injection._handle = module.register_forward_hook(hook)
    return injection


def nonfinite_optimizer_state(optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the optimized tensors (fp32 masters under ``MasterWeights``) and optimizer-state tensors
    (momentum buffers, Adam moments) that contain inf or NaN; empty when all are finite. The flags are
    computed on the tensors' devices and fetched together: one host-device sync per device. Still a check
    for tests and debugging, not for every step."""
    named: list[tuple[str, torch.Tensor]] = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            named.append((f"param_groups[{g}].params[{i}]", p))
            for name, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    named.append((f"state[param_groups[{g}].params[{i}]][{name!r}]", value))
    flags = finite_flags([t for _, t in named])
    return [label for (label, _), finite in zip(named, flags, strict=True) if not finite]
