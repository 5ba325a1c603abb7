"""Which gradients went inf/NaN, and which module's forward made the first non-finite value.

Two tools, both opt-in, so a training loop pays nothing for them until something goes wrong:

- :func:`nonfinite_grads` (after the scaler skipped a step): for every parameter whose ``.grad`` holds
  inf or NaN, its name and counts. One pass over the gradients and a single host-device sync; call it
  when ``scaler.last_step_skipped`` (or your own check) says there was an overflow, not on every step.
- :class:`NonfiniteTracer` (a context manager around a forward pass): forward hooks on every module
  check each output; the first module whose output contains inf/NaN is recorded with the ranges of its
  inputs and outputs, and (``compare_fp32=True``) the same module is re-run on fp32 copies of its
  weights and inputs, which tells a half-precision overflow ("max 7.1e4 > 65504, fp32 is fine") from a
  genuine bug (NaN in fp32 too). Each hook syncs with the device: use it to diagnose, not to train.

Hooks fire when a module's forward *returns*, children before their parent, so the first module that
reports a non-finite output is the innermost one that made it; if its inputs were already non-finite, the
value came from code between modules (a functional op in the parent's ``forward``), and the report says so.
(Input ranges are read after the forward: a module that overwrites its input in place, such as
``ReLU(inplace=True)``, shows its output there.)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from mixprec.errors import ConfigError
from mixprec.tensor_args import iter_tensors, map_tensors

__all__ = [
    "NonfiniteEvent",
    "NonfiniteGrad",
    "NonfiniteTracer",
    "TensorRange",
    "finite_flags",
    "nonfinite_grads",
    "nonfinite_report",
    "tensor_range",
    "trace_nonfinite",
]


# ---------------------------------------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NonfiniteGrad:
    """A parameter whose gradient holds inf or NaN."""

    name: str
    n_inf: int
    n_nan: int
    numel: int
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{self.name}: {self.n_inf:,} inf, {self.n_nan:,} NaN of {self.numel:,} ({self.dtype})"


def _named(source: nn.Module | Iterable[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    if isinstance(source, nn.Module):
        return list(source.named_parameters())
    return list(source)


def _per_device(tensors: Sequence[Tensor], stat: Callable[[Tensor], Tensor]) -> list[Any]:
    """``stat(t).tolist()`` for every tensor, in order. The stats are computed on each tensor's device and
    fetched together: one host-device sync per device, not one per tensor."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    results: list[Any] = [None] * len(tensors)
    for indices in by_device.values():
        fetched = torch.stack([stat(tensors[i]) for i in indices]).tolist()  # the device's one sync
        for i, value in zip(indices, fetched, strict=True):
            results[i] = value
    return results


def finite_flags(tensors: Sequence[Tensor]) -> list[bool]:
    """For each tensor, whether all its values are finite (integer tensors always are). One host-device
    sync per device the tensors are on."""
    return [bool(flag) for flag in _per_device(tensors, lambda t: torch.isfinite(t.detach()).all())]


def nonfinite_grads(source: nn.Module | Iterable[tuple[str, Tensor]]) -> list[NonfiniteGrad]:
    """Parameters of ``source`` (a model, or ``(name, param)`` pairs) whose ``.grad`` holds inf or NaN.

    Counts are computed on the gradients' devices and fetched together: one host-device sync per device.
    Parameters without a gradient are skipped. Empty list: every gradient is finite.
    """
    named = [(n, p.grad) for n, p in _named(source) if p.grad is not None]
    counts = _per_device([g for _, g in named], lambda g: torch.stack([g.isinf().sum(), g.isnan().sum()]))
    return [
        NonfiniteGrad(name, n_inf, n_nan, g.numel(), g.dtype)
        for (name, g), (n_inf, n_nan) in zip(named, counts, strict=True)
        if n_inf or n_nan
    ]


def nonfinite_report(source: nn.Module | Iterable[tuple[str, Tensor]]) -> str:
    """A printable report of :func:`nonfinite_grads`."""
    bad = nonfinite_grads(source)
    if not bad:
        return "All gradients are finite."
    lines = [f"{len(bad)} parameter(s) with non-finite gradients:"]
    lines += [f"  {b}" for b in bad]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# forward tracing
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRange:
    """Range of a floating tensor: min/max over its finite values, and how many are inf or NaN."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    min: float | None  # None: no finite value
    max: float | None
    n_inf: int
    n_nan: int

    @property
    def finite(self) -> bool:
        return self.n_inf == 0 and self.n_nan == 0

    @property
    def max_abs(self) -> float | None:
        if self.min is None or self.max is None:
            return None
        return max(abs(self.min), abs(self.max))

    def __str__(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        span = f"[{self.min:.3g}, {self.max:.3g}]" if self.min is not None else "no finite values"
        bad = f", {self.n_inf:,} inf, {self.n_nan:,} NaN" if not self.finite else ""
        return f"{_dtype_name(self.dtype)} {shape}: finite range {span}{bad}"


def tensor_range(t: Tensor) -> TensorRange:
    """The :class:`TensorRange` of ``t`` (computed in fp32/fp64, so a half tensor's range is exact).

    One host-device sync: the counts and the finite extremes are stacked in float64 (exact for counts below
    2^53 and for every fp32 value) and read together. Non-finite values are replaced by +-inf for the
    extremes, so no data-dependent masked copy is made.
    """
    x = t.detach()
    x = x.double() if x.dtype == torch.float64 else x.float()
    if x.numel() == 0:
        return TensorRange(t.dtype, tuple(t.shape), None, None, 0, 0)
    finite = x.isfinite()
    n_inf, n_nan, lo, hi = torch.stack([
        x.isinf().sum().double(),
        x.isnan().sum().double(),
        torch.where(finite, x, math.inf).min().double(),  # +inf when no value is finite
        torch.where(finite, x, -math.inf).max().double(),
    ]).tolist()
    if not math.isfinite(lo):
        return TensorRange(t.dtype, tuple(t.shape), None, None, int(n_inf), int(n_nan))
    return TensorRange(t.dtype, tuple(t.shape), lo, hi, int(n_inf), int(n_nan))


def _floating(value: Any) -> list[Tensor]:
    """The floating tensors in nested lists, tuples and dicts (the shapes of module arguments and outputs)."""
    return [t for t in iter_tensors(value) if t.is_floating_point()]


def _to_fp32(t: Tensor) -> Tensor:
    return t.detach().float() if t.is_floating_point() else t


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class NonfiniteEvent:
    """The first module whose forward output held inf/NaN, and what went in and came out."""

    module: str  # qualified name in the traced model ("" -> the model itself, shown by its class)
    module_type: str
    inputs: tuple[TensorRange, ...]
    outputs: tuple[TensorRange, ...]
    fp32_outputs: tuple[TensorRange, ...] | None = None  # the same forward on fp32 copies
    fp32_error: str | None = None  # why the fp32 re-run failed, if it did
    nonfinite_state: tuple[str, ...] = ()  # the module's own parameters/buffers that already held inf/NaN

    @property
    def inputs_finite(self) -> bool:
        return all(r.finite for r in self.inputs)

    @property
    def label(self) -> str:
        return f"{self.module or '<model>'} ({self.module_type})"

    def explain(self) -> str:
        """One or two sentences: what overflowed, in which dtype, and what fp32 says about it."""
        if not self.inputs_finite:
            return (f"{self.label} received non-finite input: the inf/NaN was made before it, outside any "
                    "module's forward (in the batch itself, or by code in the parent module's forward).")
        out = next(r for r in self.outputs if not r.finite)
        what = _kind(out)
        if self.nonfinite_state:
            bad = ", ".join(self.nonfinite_state)
            return (
                f"{self.label} output {what} in {_dtype_name(out.dtype)}, and is non-finite in fp32 too: "
                f"its own weights already held inf/NaN ({bad}), written by an earlier optimizer step, not by "
                "this forward. Typical causes: an fp16 optimizer update without fp32 masters (O3 or pure "
                "fp16 with Adam: eps=1e-8 rounds to 0 in fp16), or a step that was not skipped on overflow. "
                "mixprec.faults.nonfinite_optimizer_state(optimizer) shows which state went bad; use fp32 "
                "master weights (O2, to_fp16)."
            )
        if self.fp32_outputs is None:
            reason = f"; fp32 re-run failed: {self.fp32_error}" if self.fp32_error else ""
            return f"{self.label} output {what} in {_dtype_name(out.dtype)}{reason}."
        ref = self.fp32_outputs[self.outputs.index(out)] if len(self.fp32_outputs) == len(self.outputs) \
            else self.fp32_outputs[0]
        if not ref.finite:
            return (f"{self.label} output {what} in {_dtype_name(out.dtype)}, and is non-finite in fp32 too "
                    f"({ref.n_inf:,} inf, {ref.n_nan:,} NaN): not a precision problem -- look for log(0), "
                    "0/0, sqrt of a negative, or inputs/weights that are already huge.")
        limit = _max_of(out.dtype)
        ref_max = ref.max_abs or 0.0
        if limit is not None and ref_max > limit:
            # ref_max is the fp32 re-run's: the half output holds inf where it overflowed, so it has no max.
            name = _dtype_name(out.dtype)
            return (f"{self.label} output overflowed in {name} ({_counts(out)}): its fp32 re-run is finite "
                    f"with max |x| {ref_max:.3g}, above {name}'s max {limit:.6g}. Keep this module in fp32, "
                    "or scale its input down.")
        return (f"{self.label} output {what} in {_dtype_name(out.dtype)} although its fp32 output fits "
                f"(max |x| {ref_max:.3g}): an intermediate value inside the module overflowed. Run the "
                "module in fp32, or rewrite it to keep intermediates small (e.g. subtract the max before "
                "exp).")

    def report(self) -> str:
        lines = [f"first non-finite output: {self.label}"]
        lines += [f"  input {i}:  {r}" for i, r in enumerate(self.inputs)]
        lines += [f"  output {i}: {r}" for i, r in enumerate(self.outputs)]
        if self.fp32_outputs is not None:
            lines += [f"  fp32 re-run output {i}: {r}" for i, r in enumerate(self.fp32_outputs)]
        lines.append("  " + self.explain())
        return "\n".join(lines)


def _counts(r: TensorRange) -> str:
    parts = [f"{r.n_inf:,} inf" if r.n_inf else "", f"{r.n_nan:,} NaN" if r.n_nan else ""]
    return ", ".join(p for p in parts if p)


def _kind(r: TensorRange) -> str:
    return f"went non-finite ({_counts(r)})"


def _max_of(dtype: torch.dtype) -> float | None:
    return torch.finfo(dtype).max if dtype.is_floating_point else None


def _nonfinite_state(module: nn.Module) -> tuple[str, ...]:
    """The module's own floating parameters and buffers that hold inf/NaN (only read for the event)."""
    named = [*module.named_parameters(), *module.named_buffers()]
    named = [(n, t) for n, t in named if t.is_floating_point()]
    flags = finite_flags([t.detach() for _, t in named])
    return tuple(n for (n, _), ok in zip(named, flags, strict=True) if not ok)


class NonfiniteTracer:
    """Context manager: forward hooks on every module of ``model`` that find the first non-finite output.

    ``with NonfiniteTracer(model) as tracer: model(x)`` then ``tracer.event`` (a :class:`NonfiniteEvent`,
    or None if all outputs were finite) and ``print(tracer.report())``. ``compare_fp32`` re-runs the
    offending module once on fp32 copies (its weights are copied: memory of one module). Hooks are
    removed on exit; after the first event the remaining hooks return at once.
    """

    def __init__(self, model: nn.Module, compare_fp32: bool = True) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(f"NonfiniteTracer traces an nn.Module, got {type(model).__name__}.",
                              "pass the model whose forward you want to check.")
        self.model = model
        self.compare_fp32 = compare_fp32
        self.event: NonfiniteEvent | None = None
        self.checked = 0  # module outputs checked
        self._handles: list[RemovableHandle] = []
        self._paused = False

    def __enter__(self) -> NonfiniteTracer:
        self.event = None
        self.checked = 0
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if self.event is not None or self._paused:
                return
            self.checked += 1
            produced = _floating(output)
            if all(finite_flags(produced)):  # the common case: one flag per output, one sync per device
                return
            outputs = tuple(tensor_range(t) for t in produced)  # ranges only for the event
            inputs = tuple(tensor_range(t) for t in _floating((args, kwargs)))
            fp32, error = self._rerun_fp32(module, args, kwargs) if self.compare_fp32 else (None, None)
            state = _nonfinite_state(module)
            self.event = NonfiniteEvent(name, type(module).__name__, inputs, outputs, fp32, error, state)

        return hook

    def _rerun_fp32(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[TensorRange, ...] | None, str | None]:
        # A float copy, so the model's own weights are not touched; autocast off, so fp32 means fp32.
        self._paused = True  # the copy carries our hooks (and its children's): keep them quiet
        try:
            reference = copy.deepcopy(module).float()
            device_type = next((t.device.type for t in _floating((args, kwargs))), "cpu")
            with torch.no_grad(), torch.autocast(device_type, enabled=False):
                out = reference(*map_tensors(_to_fp32, args), **map_tensors(_to_fp32, kwargs))
            return tuple(tensor_range(t) for t in _floating(out)), None
        except Exception as err:  # a diagnostic must not crash the run it diagnoses
            return None, f"{type(err).__name__}: {err}"
        finally:
            self._paused = False

    def report(self) -> str:
        if self.event is None:
            return f"No non-finite module output ({self.checked} outputs checked)."
        return self.event.report()


def trace_nonfinite(model: nn.Module, compare_fp32: bool = True) -> NonfiniteTracer:
    """``with trace_nonfinite(model) as t: model(x)``, then ``print(t.report())``; see NonfiniteTracer."""
    return NonfiniteTracer(model, compare_fp32)

