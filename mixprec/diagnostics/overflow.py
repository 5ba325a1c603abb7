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
  A backward of that forward (inside the block or after it) is traced too: each module output's gradient
  is checked as backward computes it, and the first one that holds inf/NaN is recorded
  (:class:`BackwardEvent`) with the module whose output gradient was the last finite one before it. That
  finds the usual fp16 failure, a forward that is finite and a scaled backward that overflows.

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
from torch.utils.weak import WeakIdKeyDictionary

from mixprec.errors import FP32_MIN_MASK, FP32_MIN_MASK_FIX, ConfigError
from mixprec.half_model import internal_copies
from mixprec.tensor_args import iter_tensors, map_tensors

__all__ = [
    "BackwardEvent",
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
    n_neg_inf: int = 0  # of n_inf

    @property
    def mask_like(self) -> bool:
        """Non-finite only by -inf: taken for an additive mask (a causal or padding attention mask holds
        -inf on purpose), not for a value that overflowed."""
        # a mask keeps some entries (0): a tensor that is all -inf overflowed (or was filled that way)
        return self.n_nan == 0 and 0 < self.n_inf == self.n_neg_inf and self.min is not None

    @property
    def usable(self) -> bool:
        """Finite, or a mask: an input that does not itself explain a non-finite output."""
        return self.finite or self.mask_like

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
        span = f"finite range [{self.min:.3g}, {self.max:.3g}]" if self.min is not None else "no finite value"
        bad = f", {self.n_inf:,} inf, {self.n_nan:,} NaN" if not self.finite else ""
        if self.mask_like:
            bad = f", {self.n_inf:,} -inf (a mask?)"
        return f"{_dtype_name(self.dtype)} {shape}: {span}{bad}"


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
    n_inf, n_nan, n_neg_inf, lo, hi = torch.stack([
        x.isinf().sum().double(),
        x.isnan().sum().double(),
        x.isneginf().sum().double(),
        torch.where(finite, x, math.inf).min().double(),  # +inf when no value is finite
        torch.where(finite, x, -math.inf).max().double(),
    ]).tolist()
    counts = (int(n_inf), int(n_nan), int(n_neg_inf))
    if not math.isfinite(lo):
        return TensorRange(t.dtype, tuple(t.shape), None, None, *counts)
    return TensorRange(t.dtype, tuple(t.shape), lo, hi, *counts)


def _floating(value: Any) -> list[Tensor]:
    """The floating tensors in nested lists, tuples and dicts (the shapes of module arguments and outputs)."""
    return [t for t in iter_tensors(value) if t.is_floating_point()]


def _to_fp32(t: Tensor) -> Tensor:
    return t.detach().float() if t.is_floating_point() else t


def _enclosing(name: str, after: str | None) -> str:
    """The innermost module whose forward ran all the code between ``after``'s return (the last finite
    output) and ``name``'s call: their common ancestor, above ``name`` (an ``nn.Sequential`` around ``name``
    only passes its input on: the code that made the value is its caller's). The model itself where no
    module had returned yet."""
    if after is None:
        return ""
    ours, theirs = name.split("."), after.split(".") if after else []
    common = 0
    # above both: `after` returned before the code ran, so its own forward had ended (the model called
    # encoder, made the value, then called encoder.norm: the model's forward made it)
    while common < min(len(ours), len(theirs)) - 1 and ours[common] == theirs[common]:
        common += 1
    return ".".join(ours[:common])


def _label(module: str, module_type: str) -> str:
    """How a report names a module: its qualified name (the model itself: <model>) and its class."""
    return f"{module or '<model>'} ({module_type})"


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
    after: str | None = None  # label of the last module (forward order) whose output was finite
    parent: str | None = None  # label of the module whose forward calls this one
    weight_max: float | None = None  # max |w| over the module's own floating parameters (None: it has none)

    @property
    def inputs_finite(self) -> bool:
        return all(r.usable for r in self.inputs)  # a -inf mask does not explain the output (mask_like)

    @property
    def label(self) -> str:
        return _label(self.module, self.module_type)

    def explain(self) -> str:
        """One or two sentences: what overflowed, in which dtype, and what fp32 says about it."""
        if not self.inputs_finite:
            where = (f"between {self.after}'s output and {self.label}'s input" if self.after is not None
                     else f"before {self.label}")
            by = f"code in the forward of {self.parent}" if self.parent is not None else "the caller's code"
            return (f"{self.label} received non-finite input: the inf/NaN was made {where}, outside any "
                    f"module's forward (by {by}, or it was in the batch itself).")
        out = next(r for r in self.outputs if not r.finite)
        what = _kind(out)
        if self.nonfinite_state:
            bad = ", ".join(self.nonfinite_state)
            return (
                f"{self.label} output {what} in {_dtype_name(out.dtype)}, and is non-finite in fp32 too: "
                f"its own weights already held inf/NaN ({bad}), not made by this forward: written by an "
                "earlier optimizer step (an fp16 update without fp32 masters, O3 or pure fp16 with Adam: "
                "eps=1e-8 rounds to 0 in fp16; or a step that was not skipped on overflow; "
                "mixprec.faults.nonfinite_optimizer_state(optimizer) shows which state went bad; use fp32 "
                "master weights: O2, to_fp16), or by the cast to fp16 itself (a weight beyond +-65504 "
                "becomes inf: keep that module fp32 with mixprec.keep_fp32, or use bf16)."
            )
        if self.fp32_outputs is None:
            reason = f"; fp32 re-run failed: {self.fp32_error}" if self.fp32_error else ""
            return f"{self.label} output {what} in {_dtype_name(out.dtype)}{reason}."
        ref = self.fp32_outputs[self.outputs.index(out)] if len(self.fp32_outputs) == len(self.outputs) \
            else self.fp32_outputs[0]
        masks = [i for i, r in enumerate(self.inputs) if r.mask_like]
        if not ref.finite and masks:
            made = f"by code in the forward of {self.parent}" if self.parent else "by the caller"
            return (f"{self.label} output {what} in {_dtype_name(out.dtype)}, and is non-finite in fp32 too, "
                    f"where input {masks[0]} holds -inf (a mask?): {FP32_MIN_MASK} (before this module, "
                    f"{made}). Fix: {FP32_MIN_MASK_FIX}.")
        if not ref.finite:
            return (f"{self.label} output {what} in {_dtype_name(out.dtype)}, and is non-finite in fp32 too "
                    f"({ref.n_inf:,} inf, {ref.n_nan:,} NaN): not a precision problem -- look for log(0), "
                    "0/0, sqrt of a negative, or inputs/weights that are already huge.")
        limit = _max_of(out.dtype)
        ref_max = ref.max_abs or 0.0
        if limit is not None and ref_max > limit:
            # ref_max is the fp32 re-run's: the half output holds inf where it overflowed, so it has no max.
            name = _dtype_name(out.dtype)
            text = (f"{self.label} output overflowed in {name} ({_counts(out)}): its fp32 re-run is finite "
                    f"with max |x| {ref_max:.3g}, above {name}'s max {limit:.6g}. Keep this module in fp32 "
                    "(mixprec.keep_fp32(module), before initialize/to_fp16 for a half model), or scale its "
                    "input down.")
            if self.weight_max is not None and self.weight_max > LARGE_WEIGHT:
                text += (f" But its weights are large too (max |w| {self.weight_max:.3g}; ~1 or less at "
                         "initialisation): if they grew in training, the run is diverging (a learning rate "
                         "too high), and fp32 only postpones the overflow. Check the loss curve first.")
            return text
        return (f"{self.label} output {what} in {_dtype_name(out.dtype)} although its fp32 output fits "
                f"(max |x| {ref_max:.3g}): an intermediate value inside the module overflowed. Run the "
                "module in fp32 (mixprec.keep_fp32(module), before initialize/to_fp16 for a half model), "
                "or rewrite it to keep intermediates small (e.g. subtract the max before "
                "exp).")

    def report(self) -> str:
        lines = [f"first non-finite output: {self.label}"]
        lines += [f"  input {i}:  {r}" for i, r in enumerate(self.inputs)]
        lines += [f"  output {i}: {r}" for i, r in enumerate(self.outputs)]
        if self.fp32_outputs is not None:
            lines += [f"  fp32 re-run output {i}: {r}" for i, r in enumerate(self.fp32_outputs)]
        lines.append("  " + self.explain())
        return "\n".join(lines)


@dataclass(frozen=True)
class BackwardEvent:
    """The first gradient w.r.t. a module's output that held inf/NaN, in the order backward computed
    them, and the module whose output gradient was the last finite one before it."""

    module: str
    module_type: str
    grad: TensorRange  # the gradient w.r.t. the module's output
    after: str | None  # label of the module with the last finite output gradient; None: this was the first
    loss_scale: float | None = None  # the scaler's scale at the time, when the tracer was given one

    @property
    def label(self) -> str:
        return _label(self.module, self.module_type)

    def explain(self) -> str:
        name = _dtype_name(self.grad.dtype)
        scale = f" x the loss scale {self.loss_scale:g}" if self.loss_scale is not None else ""
        limit = _max_of(self.grad.dtype)
        if self.after is None:
            return (f"the first gradient backward computed, w.r.t. {self.label}'s output, is already "
                    f"non-finite in {name} ({_counts(self.grad)}): the loss's gradient{scale} overflowed "
                    f"{name} (max {limit:.6g}) there, or the loss is inf/NaN. A GradScaler skips such a step "
                    "and lowers the scale; if it keeps happening, lower init_scale or compute the last "
                    "layer and the loss in fp32.")
        at_scale = " at this loss scale" if scale else ""
        return (f"the gradient w.r.t. {self.label}'s output went non-finite in {name} "
                f"({_counts(self.grad)}), and the one w.r.t. {self.after}'s output, computed just before it, "
                f"was finite: the backward of what the forward ran after {self.label} and up to {self.after} "
                f"(that module, and code between them) overflowed {name}{at_scale}. A GradScaler skips such "
                "a step and lowers the scale; if it keeps happening (at a scale of 1 too), keep that part in "
                "fp32: mixprec.keep_fp32(module) before initialize or to_fp16() (a half model), or compute "
                "it from .float() tensors and cast the result back.")

    def report(self) -> str:
        return "\n".join([f"first non-finite gradient: w.r.t. the output of {self.label}",
                          f"  gradient: {self.grad}", "  " + self.explain()])


def _counts(r: TensorRange) -> str:
    parts = [f"{r.n_inf:,} inf" if r.n_inf else "", f"{r.n_nan:,} NaN" if r.n_nan else ""]
    return ", ".join(p for p in parts if p)


def _kind(r: TensorRange) -> str:
    return f"went non-finite ({_counts(r)})"


def _max_of(dtype: torch.dtype) -> float | None:
    return torch.finfo(dtype).max if dtype.is_floating_point else None


# max |w| above which an overflowing module's weights are said to look diverged: initialisations keep weights
# near or below 1 (Kaiming/Xavier: ~1/sqrt(fan_in)), and trained ones rarely pass a few tens
LARGE_WEIGHT = 100.0


def _weight_max(module: nn.Module) -> float | None:
    """max |w| over the module's own floating parameters (read only for the event: one sync)."""
    own = [p.detach() for p in module.parameters(recurse=False) if p.is_floating_point() and p.numel()]
    return max(float(p.abs().max()) for p in own) if own else None


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

    A backward of the traced forward, inside the block or after it, fills ``tracer.backward_event`` (a
    :class:`BackwardEvent`, or None while every output gradient was finite); ``loss_scale`` (a number, or
    a callable such as ``scaler.get_scale``) is quoted in its explanation. The gradient hooks live on the
    forward's outputs, so they go with its graph.
    """

    def __init__(self, model: nn.Module, compare_fp32: bool = True,
                 loss_scale: float | Callable[[], float] | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(f"NonfiniteTracer traces an nn.Module, got {type(model).__name__}.",
                              "pass the model whose forward you want to check.")
        self.model = model
        self.compare_fp32 = compare_fp32
        self.loss_scale = loss_scale
        self.event: NonfiniteEvent | None = None
        self.backward_event: BackwardEvent | None = None
        self.checked = 0  # module outputs checked
        self.grads_checked = 0  # gradients w.r.t. module outputs checked
        self._handles: list[RemovableHandle] = []
        self._paused = False
        self._types: dict[str, str] = {}  # qualified name -> class name, of the model's modules
        self._last_finite: str | None = None  # forward order: the last module whose output was finite (name)
        self._last_finite_grad: str | None = None  # backward order: the same for output gradients
        # outputs given a gradient hook in this forward (a child's first); by identity, and weak: an id alone
        # is reused once a freed intermediate's Python object is gone
        self._hooked = WeakIdKeyDictionary()

    def __enter__(self) -> NonfiniteTracer:
        self.event = self.backward_event = None
        self.checked = self.grads_checked = 0
        self._last_finite = self._last_finite_grad = None
        self._hooked = WeakIdKeyDictionary()
        self._types = {n: type(m).__name__ for n, m in self.model.named_modules()}
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
            self._hook_gradients(name, produced)
            if all(finite_flags(produced)):  # the common case: one flag per output, one sync per device
                self._last_finite = name
                return
            outputs = tuple(tensor_range(t) for t in produced)  # ranges only for the event
            inputs = tuple(tensor_range(t) for t in _floating((args, kwargs)))
            # A non-finite input was made before the module: rerunning it in fp32 would only repeat that.
            rerun = self.compare_fp32 and all(r.usable for r in inputs)
            fp32, error = self._rerun_fp32(module, args, kwargs) if rerun else (None, None)
            state = _nonfinite_state(module)
            after, outer = self._last_finite, _enclosing(name, self._last_finite)
            parent = _label(outer, self._types[outer]) if name else None
            self.event = NonfiniteEvent(name, type(module).__name__, inputs, outputs, fp32, error, state,
                                        after=None if after is None else _label(after, self._types[after]),
                                        parent=parent,
                                        weight_max=_weight_max(module))

        return hook

    def _hook_gradients(self, name: str, outputs: list[Tensor]) -> None:
        """A hook on each output that backward will reach; an output a child returned is its child's."""
        for t in outputs:
            if t.requires_grad and t not in self._hooked:
                self._hooked[t] = True
                t.register_hook(self._grad_hook(name))

    def _grad_hook(self, name: str) -> Callable[[Tensor], None]:
        label = _label(name, self._types[name])

        def check(grad: Tensor) -> None:
            if self.backward_event is not None:
                return
            self.grads_checked += 1
            if finite_flags([grad])[0]:
                self._last_finite_grad = label
                return
            scale = self.loss_scale() if callable(self.loss_scale) else self.loss_scale
            scale = None if scale is None else float(scale)
            self.backward_event = BackwardEvent(name, self._types[name], tensor_range(grad),
                                                self._last_finite_grad, scale)

        return check

    def _rerun_fp32(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[TensorRange, ...] | None, str | None]:
        # A float copy, so the model's own weights are not touched; autocast off, so fp32 means fp32.
        self._paused = True  # the copy carries our hooks (and its children's): keep them quiet
        try:
            with internal_copies():  # not the user's EMA: no warning about one
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
        """The forward's event, else the backward's, else what was checked (and, after a backward, the
        parameter gradients that hold inf/NaN although every output gradient was finite)."""
        if self.event is not None:
            return self.event.report()
        if self.backward_event is not None:
            text = self.backward_event.report()
            if self.backward_event.after is None and self.checked:
                # the loss's own gradient was the first non-finite one, and no module made an inf/NaN
                text += (f"\n  Every module output of the forward was finite ({self.checked} checked): if "
                         "the loss is inf/NaN, code after the model made it (logits scaled up, log(0), a sum "
                         "over a large batch in fp16). Check torch.isfinite(loss) and the code between the "
                         "model's output and the loss.")
            return text
        text = f"No non-finite module output ({self.checked} outputs checked)"
        if not self.grads_checked:
            return text + "."
        text += f", nor gradient w.r.t. one ({self.grads_checked} checked)."
        bad = nonfinite_grads(self.model)
        if bad:
            text += ("\nBut these parameter gradients hold inf/NaN, made by their module's weight-gradient "
                     "computation (its output gradient was finite):\n" + "\n".join(f"  {g}" for g in bad))
        return text


def trace_nonfinite(model: nn.Module, compare_fp32: bool = True,
                    loss_scale: float | Callable[[], float] | None = None) -> NonfiniteTracer:
    """``with trace_nonfinite(model) as t: loss = loss_fn(model(x))``, then ``loss.backward()`` (or the
    scaler's) and ``print(t.report())``; see NonfiniteTracer."""
    return NonfiniteTracer(model, compare_fp32, loss_scale)

