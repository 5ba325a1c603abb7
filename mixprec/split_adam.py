"""A one-pass native Adam/AdamW step for ``LowPrecisionOptimizer(..., mode="split")`` on the CPU.

The split layout keeps each fp32 master as its bf16 model weight (the high half) plus an int16 low half:
the fp32 master exactly, at 2 bytes per parameter beside the weight. The generic step rebuilds fp32
weights and gradients per chunk, runs the wrapped optimizer, and splits the result again: several passes
over memory. Here one loop (``split_adam.c``) reads the bf16 gradient, the two halves and Adam's moments of
each element, and writes the halves and the moments back -- 26 bytes per parameter, where torch's fused
fp32 AdamW moves 28 -- so the step of a model that holds 14 bytes per parameter runs faster than torch's
fastest step on fp32 weights (benchmarks/master_step.py).

Its arithmetic is torch's ``_single_tensor_adam`` (what ``Adam``/``AdamW`` run on the CPU unless asked for
``fused=True``), operation by operation, with one difference: its square root is correctly rounded, where
torch's CPU ``sqrt`` (MKL's vector math, above ~100 elements) is one ulp off in ~0.6% of elements. So the
masters equal torch's Adam on fp32 masters bit for bit when that sqrt is made exact, and are within a few
ulps of it as it is (tests/test_split_adam.py). The wrapper uses it in place of the wrapped optimizer's
step wherever it can (:meth:`NativeSplitAdam.reason` says when not); ``kernel="generic"`` keeps torch's
own numbers.

The loop is C, compiled once per machine with ``$CC`` (else ``cc``, ``gcc``, ``clang``; torch.compile
needs one too) into ``$MIXPREC_CACHE_DIR`` (default ``~/.cache/mixprec``) and called through ctypes: it
includes no torch header, so it builds in well under a second (a torch C++ extension: ~20 s). It links the
OpenMP runtime torch has already loaded, so it shares torch's threads. Without a compiler the wrapper
keeps its generic step: the same masters up to that sqrt rounding, several times slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mixprec.master_kernel import _columns, _settings, decay_kind

__all__ = ["NativeSplitAdam", "library_error"]

SOURCE = Path(__file__).with_name("split_adam.c")
# -ffp-contract=off: the compiler may add no fused multiply-add the source does not write (torch's roundings
# are matched one by one); -fno-math-errno lets sqrtf vectorise (it sets no errno; IEEE results unchanged);
# -march=native: the library is built on, and cached for, the machine that runs it.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
OPENMP = ["-fopenmp"]  # dropped (one thread) where the compiler has no OpenMP, e.g. Apple's clang
SUPPORTED = (torch.optim.Adam, torch.optim.AdamW)
# Per-tensor flags, as split_adam.c numbers them.
_DECOUPLED, _L2, _MAXIMIZE, _SCALED = 1, 2, 4, 8
_DECAY_FLAG = {"none": 0, "decoupled": _DECOUPLED, "l2": _L2}

_LIBRARY: dict[str, Any] = {}  # "lib": the loaded library, or "error": why there is none


def _cache_dir() -> Path:
    root = os.environ.get("MIXPREC_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mixprec"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(compiler: str) -> Path:
    """Compile split_adam.c into the cache (once per source, compiler, flags and CPU), return its path."""
    source = SOURCE.read_bytes()
    cpu = sorted(k for k, v in torch.cpu.get_capabilities().items() if v is True)
    recipe = (source, compiler, FLAGS, OPENMP, cpu, platform.machine())
    key = hashlib.sha256(repr(recipe).encode()).hexdigest()
    target = _cache_dir() / f"split_adam-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for extra in (OPENMP, []):
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            try:
                run = subprocess.run([compiler, *FLAGS, *extra, str(SOURCE), "-o", str(out), "-lm"],
                                     capture_output=True, text=True)
            except OSError as e:
                raise OSError(f"the C compiler {compiler!r} cannot be run ({e.strerror}): set $CC to one "
                              "that can") from None
            if run.returncode == 0:
                os.replace(out, target)  # atomic: a concurrent build of the same key writes the same bytes
                return target
            errors.append(run.stderr.strip().splitlines()[-1:] or ["(no output)"])
    raise OSError(f"{compiler} could not build {SOURCE.name}: {errors[-1][0]}; set $CC to another compiler")


def _library() -> Any | None:
    if not _LIBRARY:
        compiler = _compiler()
        try:
            if compiler is None:
                raise OSError("no C compiler found (set $CC, or install gcc or clang)")
            lib = ctypes.CDLL(str(_build(compiler)))
            fn = lib.split_adam_step
            fn.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 8 + [ctypes.c_float, ctypes.c_int32]
            fn.restype = None
            _LIBRARY["lib"] = lib
        except OSError as e:
            _LIBRARY["error"] = str(e)
    return _LIBRARY.get("lib")


def library_error() -> str | None:
    """Why the native step cannot be built on this machine, or None when it can."""
    _library()
    return _LIBRARY.get("error")


def _optimizer_reason(optimizer: torch.optim.Optimizer) -> str | None:
    if type(optimizer) not in SUPPORTED:
        return f"it implements Adam and AdamW, not {type(optimizer).__name__}"
    for key in ("fused", "amsgrad", "capturable", "differentiable"):
        if any(g.get(key) for g in optimizer.param_groups):
            return f"the optimizer has {key}=True"
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return "the optimizer has step hooks (the native step does not call its step)"
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    if _global_optimizer_pre_hooks or _global_optimizer_post_hooks:
        return "global optimizer step hooks are registered (the native step does not call a step)"
    return library_error()


def _tensor_reason(p: torch.Tensor, state: dict[str, Any]) -> str | None:
    if p.device.type != "cpu" or not p.is_contiguous():
        return f"a parameter of shape {tuple(p.shape)} is not a contiguous CPU tensor"
    moments = [state.get(k) for k in ("exp_avg", "exp_avg_sq")]
    if any(m is not None and (m.dtype != torch.float32 or not m.is_contiguous()) for m in moments):
        return f"the Adam state of a parameter of shape {tuple(p.shape)} is not contiguous fp32"
    return None


def _grad_reason(params: Sequence[torch.Tensor]) -> str | None:
    for p in params:
        if not p.grad.is_contiguous():  # type: ignore[union-attr]
            return f"the gradient of a parameter of shape {tuple(p.shape)} is not contiguous"
    return None


def _state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, Any]:
    """The parameter's Adam state, made as torch's Adam makes it on its first step (fp32 moments: the
    wrapper's generic step lends the optimizer fp32 views, so its state is fp32 too)."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
    return state


def _pointers(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    return np.fromiter((t.data_ptr() for t in tensors), dtype=np.uint64, count=len(tensors))


@dataclass
class _Plan:
    """What the loop reads of the parameters a step updates, kept between steps: the C code writes through
    raw pointers, so a plan holds the tensors it points into (none is freed under it) and is used only
    while each parameter's data, low half and moments are still those tensors (:meth:`current`)."""

    params: list[torch.Tensor]
    held: list[tuple[torch.Tensor, ...]]  # per parameter: its data, low half, exp_avg, exp_avg_sq
    steps: list[torch.Tensor]
    groups: list[int]
    tables: list[np.ndarray]  # pointers to the data, low halves, exp_avg, exp_avg_sq
    numel: np.ndarray

    def current(self, optimizer: torch.optim.Optimizer, lows: dict[torch.Tensor, torch.Tensor]) -> bool:
        state = optimizer.state
        for p, (data, low, m, v) in zip(self.params, self.held, strict=True):
            st = state.get(p)
            moved = st is None or p.data_ptr() != data.data_ptr() or p.shape != data.shape
            if moved or lows.get(p) is not low or st.get("exp_avg") is not m or st.get("exp_avg_sq") is not v:
                return False
        return True


def _plan(optimizer: torch.optim.Optimizer, members: list[tuple[int, torch.Tensor]],
          lows: dict[torch.Tensor, torch.Tensor]) -> _Plan | str:
    """A plan for ``members`` (group index, parameter), or why the native step cannot update them."""
    held = []
    for _, p in members:
        reason = _tensor_reason(p, optimizer.state.get(p, {}))
        if reason is not None:
            return reason
        st = _state(optimizer, p)
        held.append((p.data, lows[p], st["exp_avg"], st["exp_avg_sq"]))
    params = [p for _, p in members]
    tables = [_pointers([h[i] for h in held]) for i in range(4)]
    numel = np.array([p.numel() for p in params], dtype=np.int64)
    steps = [optimizer.state[p]["step"] for p in params]
    return _Plan(params, held, steps, [k for k, _ in members], tables, numel)


class NativeSplitAdam:
    """The native step of one ``LowPrecisionOptimizer``: checks, plans and runs the loop. ``reason()``
    before each ``step()``; ``forget()`` when the optimizer's state is replaced (a load)."""

    def __init__(self, optimizer: torch.optim.Optimizer, lows: dict[torch.Tensor, torch.Tensor]) -> None:
        self.optimizer, self.lows = optimizer, lows
        self._plan: _Plan | None = None
        self._members: list[tuple[int, torch.Tensor]] = []

    def forget(self) -> None:
        self._plan = None

    def reason(self) -> str | None:
        """Why this step cannot run natively, or None (then :meth:`step` runs it)."""
        reason = _optimizer_reason(self.optimizer)
        if reason is not None:
            return reason
        groups = self.optimizer.param_groups
        self._members = [(k, p) for k, g in enumerate(groups) for p in g["params"] if p.grad is not None]
        reason = _grad_reason([p for _, p in self._members])
        if reason is not None:
            return reason
        plan = self._plan
        same = plan is not None and len(plan.params) == len(self._members) and all(
            p is q for (_, p), q in zip(self._members, plan.params, strict=True))
        if not (same and plan.current(self.optimizer, self.lows)):  # type: ignore[union-attr]
            made = _plan(self.optimizer, self._members, self.lows) if self._members else None
            if isinstance(made, str):
                self._plan = None
                return made
            self._plan = made
        return None

    @torch.no_grad()
    def step(self, inv_scale: float | None) -> None:
        """One Adam/AdamW step of the parameters :meth:`reason` found with a gradient, gradients multiplied
        by ``inv_scale`` first when given."""
        plan, lib = self._plan, _library()
        if plan is None or not self._members:
            return
        torch._foreach_add_(plan.steps, 1.0)  # torch counts the step before using it
        counts = torch.stack(plan.steps).tolist()
        groups = self.optimizer.param_groups
        settings = [_settings(g) for g in groups]
        # the scalars in fp64 as torch's Python computes them (** 0.5 as torch writes it), then fp32 as
        # its kernels receive them
        keys = list(zip(plan.groups, counts, strict=True))
        rows = {key: _columns(*settings[key[0]], key[1], lambda x: x**0.5) for key in set(keys)}
        coef = np.array([rows[key] for key in keys], dtype=np.float32)
        kind = [_DECAY_FLAG[decay_kind(g)] | (_MAXIMIZE if g["maximize"] else 0) for g in groups]
        scaled = 0 if inv_scale is None else _SCALED
        flags = np.array([kind[k] | scaled for k in plan.groups], dtype=np.int32)
        grads = _pointers([p.grad for p in plan.params])  # type: ignore[misc]
        high, low, exp_avg, exp_avg_sq = plan.tables
        lib.split_adam_step(
            len(plan.params), high.ctypes.data, low.ctypes.data, grads.ctypes.data, exp_avg.ctypes.data,
            exp_avg_sq.ctypes.data, plan.numel.ctypes.data, coef.ctypes.data, flags.ctypes.data,
            1.0 if inv_scale is None else inv_scale, torch.get_num_threads(),
        )
