"""Which ops ran in which dtype: an opt-in record of the aten ops under autocast (or any precision setup).

:class:`CastTrace` is a ``TorchDispatchMode``. It sits at the bottom of torch's dispatcher, below autograd
and below autocast, so it sees the ops that actually run, in the dtypes they actually run in: after
``torch.autocast`` (or ``mixprec.autocast``) has inserted its casts. Those casts are ``aten._to_copy`` calls
that change the dtype (and ``aten.copy_`` between dtypes, as when master weights are copied back); they
are counted separately, as casts, with the bytes they wrote. Ops run by the autograd engine during
``backward()`` are marked as the backward phase. A GEMM that mixprec *emulates* in half precision
(``mixprec.emulation``: fp32 kernels on half-rounded inputs) is reported with its fp32 operands labelled
``fp16 (emulated)`` (or bf16), in forward and backward, not as an fp32 GEMM. View ops (``t``, ``view``,
``detach``...), which move no data and keep their input's dtype, are left out unless
``include_views=True``.

Cost: a Python call per aten op while the trace is active. Use it to look, not to train.

    with torch.autocast("cpu", dtype=torch.bfloat16), CastTrace() as trace:
        loss = loss_fn(model(x), y)
    print(trace.report())
"""

from __future__ import annotations

import io
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mixprec.diagnostics.memory import bytes_text
from mixprec.formats import dtype_label
from mixprec.region import EMULATED_NODE_KEY, STATE

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["CastRecord", "CastTrace", "OpRecord", "dtype_label"]

# Short dtype names for tables: the ones mixed precision is about first.

# Ops that write one tensor's values into another of (possibly) another dtype: a cast when dtypes differ.
_CAST_OPS = frozenset({"_to_copy", "copy_", "copy"})


@dataclass(frozen=True)
class OpRecord:
    """An aten op that ran ``count`` times with these input and output dtypes, in this phase."""

    phase: str  # "forward" (anything outside the autograd engine) or "backward"
    op: str  # aten op name without overload, e.g. "addmm"
    inputs: tuple[str, ...]  # dtypes of the tensor arguments, in order
    outputs: tuple[str, ...]
    count: int


@dataclass(frozen=True)
class CastRecord:
    """Dtype conversions from ``source`` to ``target`` in this phase: how many, and bytes written."""

    phase: str
    source: str
    target: str
    count: int
    bytes: int


def _dtypes(value: Any, emulated: torch.dtype | None = None) -> tuple[str, ...]:
    return tuple(_label(t.dtype, emulated) for t in tree_leaves(value) if isinstance(t, Tensor))


def _label(dtype: torch.dtype, emulated: torch.dtype | None) -> str:
    # Inside an emulated half GEMM the fp32 tensors carry half-rounded values (or an fp32 accumulator).
    if emulated is not None and dtype is torch.float32:
        return f"{dtype_label(emulated)} (emulated)"
    return dtype_label(dtype)


def _emulated_dtype(node: Any) -> torch.dtype | None:
    """The half dtype an emulated GEMM is computing now: flagged in forward, tagged on its backward node."""
    if node is None:
        return STATE.emulating
    return node.metadata.get(EMULATED_NODE_KEY) if hasattr(node, "metadata") else None


class CastTrace(TorchDispatchMode):
    """Record (op, input dtypes, output dtypes, count) for every aten op run while active; casts apart.

    Use as a context manager around a forward (and backward) pass; read :attr:`ops`, :attr:`casts`,
    :meth:`table`, :meth:`casts_table` or :meth:`report`. Entering it again starts a fresh record.
    """

    def __init__(self, include_views: bool = False) -> None:
        super().__init__()
        self.include_views = include_views
        self._ops: Counter[tuple[str, str, tuple[str, ...], tuple[str, ...]]] = Counter()
        self._casts: Counter[tuple[str, str, str]] = Counter()
        self._cast_bytes: Counter[tuple[str, str, str]] = Counter()

    def __enter__(self) -> CastTrace:
        self._ops.clear()
        self._casts.clear()
        self._cast_bytes.clear()
        super().__enter__()
        STATE.traces += 1  # asks mixprec's emulated GEMMs to say so (they skip that work otherwise)
        return self

    def __exit__(self, *exc: Any) -> None:
        STATE.traces -= 1
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view and not self.include_views:
            return out
        # The autograd engine sets a current node while it runs a backward function.
        node = torch._C._current_autograd_node()
        phase = "backward" if node is not None else "forward"
        name = func.overloadpacket.__name__
        if name in _CAST_OPS and self._record_cast(phase, name, args, out):
            return out
        leaves = tree_leaves((args, kwargs, out))
        if not any(isinstance(t, Tensor) and t.is_floating_point() for t in leaves):
            return out  # no float in or out (a scaler's int counters, a CPU-support query): no dtype to show
        emulated = _emulated_dtype(node)
        self._ops[(phase, name, _dtypes((args, kwargs), emulated), _dtypes(out, emulated))] += 1
        return out

    def _record_cast(self, phase: str, name: str, args: Any, out: Any) -> bool:
        # _to_copy(src) -> new tensor; copy_(dst, src) -> dst. A cast only if the dtype changes.
        src = args[1] if name.startswith("copy") else args[0]
        dst = out
        if not (isinstance(src, Tensor) and isinstance(dst, Tensor)) or src.dtype == dst.dtype:
            return False
        key = (phase, dtype_label(src.dtype), dtype_label(dst.dtype))
        self._casts[key] += 1
        self._cast_bytes[key] += dst.numel() * dst.element_size()
        return True

    # --- results --------------------------------------------------------------------------------------

    @property
    def ops(self) -> list[OpRecord]:
        """Non-cast ops in the order first seen (forward before backward)."""
        records = [OpRecord(*key, count) for key, count in self._ops.items()]
        return sorted(records, key=lambda r: r.phase != "forward")

    @property
    def casts(self) -> list[CastRecord]:
        records = [CastRecord(*key, n, self._cast_bytes[key]) for key, n in self._casts.items()]
        return sorted(records, key=lambda r: r.phase != "forward")

    def output_dtypes(self, phase: str = "forward") -> Counter[str]:
        """How many op calls produced each (first) output dtype in ``phase``."""
        counts: Counter[str] = Counter()
        for r in self.ops:
            if r.phase == phase and r.outputs:
                counts[r.outputs[0]] += r.count
        return counts

    def dtypes_of(self, op: str, phase: str = "forward") -> set[str]:
        """The output dtypes op ``op`` (e.g. "addmm") produced in ``phase``."""
        return {r.outputs[0] for r in self.ops if r.op == op and r.phase == phase and r.outputs}

    def table(self) -> Table:
        from mixprec.diagnostics.tables import PlainTable as Table

        table = Table(title="Ops by dtype (aten level: after autocast's casts)", title_justify="left")
        for header, justify in (("phase", "left"), ("op", "left"), ("input dtypes", "left"),
                                ("output dtype", "left"), ("count", "right")):
            table.add_column(header, justify=justify)  # type: ignore[arg-type]
        for r in self.ops:
            style = {"fp16": "magenta", "bf16": "cyan"}.get(r.outputs[0] if r.outputs else "", None)
            table.add_row(r.phase, r.op, ", ".join(r.inputs), ", ".join(r.outputs), str(r.count), style=style)
        return table

    def casts_table(self) -> Table:
        from mixprec.diagnostics.tables import PlainTable as Table

        table = Table(title="Casts (_to_copy / copy_ that change the dtype)", title_justify="left")
        for header, justify in (("phase", "left"), ("from", "left"), ("to", "left"), ("count", "right"),
                                ("bytes written", "right")):
            table.add_column(header, justify=justify)  # type: ignore[arg-type]
        for c in self.casts:
            table.add_row(c.phase, c.source, c.target, str(c.count), bytes_text(c.bytes))
        return table

    def report(self, width: int = 100) -> str:
        """Both tables and a one-line summary, as plain text."""
        from rich.console import Console

        buffer = io.StringIO()
        console = Console(file=buffer, width=width, color_system=None)
        console.print(self.table())
        console.print(self.casts_table())
        forward = self.output_dtypes("forward")
        n_casts = sum(c.count for c in self.casts if c.phase == "forward")
        console.print("forward: " + ", ".join(f"{n} op calls -> {d}" for d, n in forward.most_common())
                      + f"; {n_casts} casts")
        return buffer.getvalue()

    def __str__(self) -> str:
        return self.report()

