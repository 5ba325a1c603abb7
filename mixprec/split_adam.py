"""A one-pass native Adam/AdamW step for ``LowPrecisionOptimizer(..., mode="split")`` on the CPU.

The split layout keeps each fp32 master as its bf16 model weight (the high half) plus an int16 low half:
the fp32 master exactly, at 2 bytes per parameter beside the weight. The generic step rebuilds fp32
weights and gradients per chunk, runs the wrapped optimizer, and splits the result again: several passes
over memory. Here one loop (``split_adam.c``) reads the bf16 gradient, the two halves and Adam's moments of
each element, and writes the halves and the moments back -- 26 bytes per parameter, where torch's fused
fp32 AdamW moves 28 -- so the step of a model that holds 14 bytes per parameter runs faster than torch's
fastest step on fp32 weights (0.86-0.94x on an AMX Xeon with 2 threads, benchmarks/RESULTS.md).

Its arithmetic is torch's ``_single_tensor_adam`` (what ``Adam``/``AdamW`` run on the CPU by default),
operation by operation, with one difference: its square root is correctly rounded, where torch's CPU
``sqrt`` (MKL's vector math, above ~100 elements) is one ulp off in ~0.6% of elements. So the masters equal
torch's Adam on fp32 masters bit for bit when that sqrt is made exact, and are within a few ulps of it as
it is (tests/test_split_adam.py). Torch's ``fused=True`` CPU kernel computes the same, correctly rounded
sqrt included (the same masters in every case tried); only its scalar tail (the last <16 elements of a
thread's share) rounds the second moment once more, by an ulp. So ``fused=True`` is stepped here too.
The wrapper uses it in place of the wrapped optimizer's step wherever it can
(:meth:`NativeSplitAdam.reason` says when not); ``kernel="generic"`` keeps torch's own numbers.

The loop is C (``split_adam.c``), built once per machine by :mod:`mixprec.native` and called through
ctypes. Without a compiler the wrapper keeps its generic step, and warns: the same masters up to that sqrt
rounding, several times slower.

Raw pointers are only as safe as their checks: every step, before the loop runs, each parameter's memory,
dtype and size, its low half, moments and step count are compared with what the pointer tables were made
from (:class:`_Plan`), and anything that moved is checked and planned anew; a pickled or copied wrapper
plans anew. tests/test_split_adam_safety.py moves memory every way a user can.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mixprec.master_kernel import coefficient_rows, decay_kind, unsupported_flags
from mixprec.native import dense, library, library_error, library_threads, pointers, sizes
from mixprec.skip_step import record_step_called

__all__ = ["NativeSplitAdam", "library_error", "library_threads"]

# Per-tensor flags, as split_adam.c numbers them.
_DECOUPLED, _L2, _MAXIMIZE, _SCALED = 1, 2, 4, 8
_DECAY_FLAG = {"none": 0, "decoupled": _DECOUPLED, "l2": _L2}
SUPPORTED = (torch.optim.Adam, torch.optim.AdamW)


def _optimizer_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the native step cannot stand in for this optimizer's step (None: it can), checked every step.
    Hooks and tensor settings change what a step does or how its scalars round; amsgrad, capturable and
    differentiable are other algorithms or contracts."""
    if type(optimizer) not in SUPPORTED:
        return f"it implements Adam and AdamW, not {type(optimizer).__name__}"
    # fused=True is stepped too: torch's fused CPU kernel is this arithmetic with a correctly rounded sqrt
    # (bit for bit on its vectorised path; its scalar tail rounds the second moment once more)
    unsupported = unsupported_flags(optimizer)
    if unsupported:
        return f"the optimizer has {unsupported[0]}=True"
    for g in optimizer.param_groups:
        if any(isinstance(v, torch.Tensor) for v in (g["lr"], g["eps"], g["weight_decay"], *g["betas"])):
            # torch computes the step size and bias corrections of tensor settings in fp32 tensor arithmetic
            return "a hyperparameter (lr, betas, eps, weight_decay) is a tensor"
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return "the optimizer has step hooks (the native step does not call its step)"
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    if _global_optimizer_pre_hooks or _global_optimizer_post_hooks:
        return "global optimizer step hooks are registered (the native step does not call a step)"
    return library_error()


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, and the same strides wherever a stride matters (a dimension of size 1 has any)."""
    return a.shape == b.shape and (a.stride() == b.stride() or all(
        sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride(), strict=True) if n > 1))


def _state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, Any]:
    """The parameter's Adam state, made as torch's Adam makes it on its first step (fp32 moments: the
    wrapper's generic step lends the optimizer fp32 views, so its state is fp32 too)."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
    return state


def _like(p: torch.Tensor, t: Any, dtype: torch.dtype) -> Any:
    """``t`` laid out as ``p`` where it holds the right values in another dense layout (the model moved
    to channels_last after wrapping; moments a generic step made contiguous): copied once, when planning."""
    if (isinstance(t, torch.Tensor) and t.dtype is dtype and t.device == p.device and t.shape == p.shape
            and not _same_layout(t, p)):
        return torch.empty_like(p, dtype=dtype).copy_(t)
    return t


def _member_reason(p: torch.Tensor, low: torch.Tensor | None, state: dict[str, Any]) -> str | None:
    """Why the loop cannot update ``p`` through raw pointers (None: it can): every tensor it touches must
    be on the CPU, of the dtype the loop reads, as many elements as ``p``, dense, laid out as ``p``."""
    where = f"a parameter of shape {tuple(p.shape)}"
    if p.device.type != "cpu" or p.dtype is not torch.bfloat16 or not dense(p):
        return f"{where} is not a dense bf16 CPU tensor ({p.dtype}, {p.device}, strides {p.stride()})"
    if low is None or low.dtype is not torch.int16 or not _same_layout(low, p):
        return f"{where} has no int16 low half of its shape (was it replaced after wrapping?)"
    tensors = [state.get(k) for k in ("exp_avg", "exp_avg_sq")]
    if any(t is not None and (t.dtype is not torch.float32 or t.device != p.device or not _same_layout(t, p))
           for t in tensors):
        return f"the Adam state of {where} is not fp32 of its shape"
    step = state.get("step")
    if step is not None and (not isinstance(step, torch.Tensor) or step.dim() != 0 or step.is_cuda):
        return f"the step count of {where} is not a 0-dim CPU tensor"
    return None


@dataclass
class _Plan:
    """The pointer tables of one set of parameters, kept between steps while :func:`_key` of the set is
    unchanged: the same parameters in the same groups, each still at the same memory as its low half,
    moments and step count. Anything that moves a tensor's memory (``p.data = ...``, ``share_memory_()``,
    a loaded state, ``.data`` swapped under a state tensor) changes the key and makes a new plan, checked
    anew, so the loop never writes through a stale pointer."""

    key: list[tuple[Any, ...]]
    # the tensors the tables point into (parameters, low halves, exp_avg, exp_avg_sq): alive, so no id in
    # `key` is reused
    held: list[list[torch.Tensor]]
    steps: list[torch.Tensor]
    groups: list[int]
    tables: list[np.ndarray]  # pointers into `held`, table by table
    numel: np.ndarray

    @property
    def params(self) -> list[torch.Tensor]:
        return self.held[0]


def _key(optimizer: torch.optim.Optimizer, members: list[tuple[int, torch.Tensor]],
         lows: dict[torch.Tensor, torch.Tensor], grads: list[torch.Tensor]) -> list[tuple[Any, ...]] | str:
    """Per member: what its plan entry depends on (identities, memory addresses, dtype, size); or why a
    gradient (``grads``, one per member) cannot be read by the loop. One pass: the per-step cost of the
    native step's checks (~1 us a parameter)."""
    key, state, none, bf16 = [], optimizer.state, {}, torch.bfloat16
    for (k, p), g in zip(members, grads, strict=True):
        # the shape too: a (1, n) tensor has an (m, n) one's strides, and the loop reads p.numel() elements;
        # on the CPU, as the plan checked the parameter (is_cpu: comparing devices costs ~1 us a tensor)
        if not g.is_cpu:  # type: ignore[union-attr]
            return f"the native step runs on the CPU only, and a gradient is on {g.device}"  # type: ignore[union-attr]
        if g.dtype is not bf16 or g.layout is not torch.strided or g.shape != p.shape or (  # type: ignore[union-attr]
                g.stride() != p.stride() and not _same_layout(g, p)):  # type: ignore[union-attr]
            return f"the gradient of a parameter of shape {tuple(p.shape)} is not bf16 laid out as it"
        st = state.get(p, none)
        low, m, v = lows.get(p), st.get("exp_avg"), st.get("exp_avg_sq")
        # ids, not tensors (== on tensors compares values): the plan holds every tensor it names, so none
        # of these ids can be reused by another object while the plan lives
        key.append((k, id(p), p.data_ptr(), p.dtype, p.shape, id(low), id(m), id(v), id(st.get("step")),
                    None if low is None or m is None or v is None else (
                        low.data_ptr(), m.data_ptr(), v.data_ptr())))
    return key


def _plan(optimizer: torch.optim.Optimizer, members: list[tuple[int, torch.Tensor]],
          lows: dict[torch.Tensor, torch.Tensor], grads: list[torch.Tensor]) -> _Plan | str:
    """A plan for ``members`` (group index, parameter), or why the native step cannot update them."""
    if len({id(p) for _, p in members}) != len(members):
        return "a parameter is listed twice"
    for _, p in members:
        if p.dtype is torch.bfloat16 and dense(p):
            if p in lows:
                lows[p] = _like(p, lows[p], torch.int16)
            st = optimizer.state.get(p)
            for k in ("exp_avg", "exp_avg_sq") if st else ():
                st[k] = _like(p, st.get(k), torch.float32)  # type: ignore[index]
        reason = _member_reason(p, lows.get(p), optimizer.state.get(p) or {})
        if reason is not None:
            return reason
    states = [_state(optimizer, p) for _, p in members]
    params = [p for _, p in members]
    held = [params, [lows[p] for p in params], [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states]]
    key = _key(optimizer, members, lows, grads)
    assert not isinstance(key, str)  # the gradients were checked before planning
    return _Plan(key, held, [s["step"] for s in states], [k for k, _ in members],
                 [pointers(ts) for ts in held], sizes(params))


class NativeSplitAdam:
    """The native step of one ``LowPrecisionOptimizer``: checks, plans and runs the loop. :meth:`reason`
    before each :meth:`step`."""

    def __init__(self, optimizer: torch.optim.Optimizer, lows: dict[torch.Tensor, torch.Tensor]) -> None:
        self.optimizer, self.lows = optimizer, lows
        self._plan: _Plan | None = None
        # The gradients :meth:`reason` checked, read once: held until the loop returns (ctypes lets go of
        # the GIL, and another thread's zero_grad(set_to_none) would free them under it), and never read
        # from the parameters again in between (a gradient gone between two reads was an AttributeError
        # mid-step, whose traceback's tensors torch's garbage collection then tore down: aborts, segfaults)
        self._grads: list[torch.Tensor] = []

    def __getstate__(self) -> dict[str, Any]:
        # raw addresses mean nothing in a copy (a pickle, deepcopy): it plans anew on its first step
        return {**self.__dict__, "_plan": None, "_grads": []}

    def reason(self) -> str | None:
        """Why this step cannot run natively, or None (then :meth:`step` runs it)."""
        reason = _optimizer_reason(self.optimizer)
        if reason is not None:
            return reason
        groups = self.optimizer.param_groups
        read = [(k, p, p.grad) for k, g in enumerate(groups) for p in g["params"]]
        members = [(k, p) for k, p, grad in read if grad is not None]
        grads = [grad for _, _, grad in read if grad is not None]
        self._grads = []
        key = _key(self.optimizer, members, self.lows, grads)
        if isinstance(key, str):
            return key
        if self._plan is None or key != self._plan.key:
            made = _plan(self.optimizer, members, self.lows, grads)
            self._plan = made if isinstance(made, _Plan) else None
            if isinstance(made, str):
                return made
        self._grads = grads
        return None

    @torch.no_grad()
    def step(self, inv_scale: float | None) -> None:
        """One Adam/AdamW step of the parameters :meth:`reason` planned for, gradients multiplied by
        ``inv_scale`` first when given."""
        plan, lib = self._plan, library()
        if plan is None or not plan.params:
            self._grads = []
            return
        torch._foreach_add_(plan.steps, 1)  # torch counts the step before using it (int or float counts)
        counts = torch.stack(plan.steps).tolist()
        groups = self.optimizer.param_groups
        # the scalars in fp64 as torch's Python computes them (** 0.5 as torch writes it), then fp32 as
        # its kernels receive them
        keys = list(zip(plan.groups, counts, strict=True))
        coef = np.array(coefficient_rows(groups, keys, lambda x: x**0.5), dtype=np.float32)
        kind = [_DECAY_FLAG[decay_kind(g)] | (_MAXIMIZE if g["maximize"] else 0) for g in groups]
        scaled = 0 if inv_scale is None else _SCALED
        flags = np.array([kind[k] | scaled for k in plan.groups], dtype=np.int32)
        grad_tensors, self._grads = self._grads, []  # those reason() checked: held until the loop returns
        grads = pointers(grad_tensors)
        high, low, exp_avg, exp_avg_sq = plan.tables
        lib.split_adam_step(
            len(plan.params), high.ctypes.data, low.ctypes.data, grads.ctypes.data, exp_avg.ctypes.data,
            exp_avg_sq.ctypes.data, plan.numel.ctypes.data, coef.ctypes.data, flags.ctypes.data,
            1.0 if inv_scale is None else inv_scale, torch.get_num_threads(),
        )
        del grad_tensors
        record_step_called(self.optimizer)  # the native step stands in for the wrapped optimizer's
