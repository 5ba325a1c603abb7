"""The O2 Adam/AdamW step as one compiled pass over memory (``MasterWeights(..., compile_step=True)``).

master_fused.py runs torch's fused Adam kernel, which needs fp32 gradients: each chunk of half gradients is
upcast into a scratch buffer first, and the updated masters are rounded into the model after, so every
element passes through three kernels (about 1.9x torch's fused fp32 AdamW on the 2-core AVX2 EPYC,
benchmarks/master_step.py). Here the whole update is one loop that torch.compile (Inductor) generates:
per element it reads the half gradient, the fp32 master and the two fp32 moments, and writes the master,
the moments and the half weight -- 28 bytes, what torch's fused fp32 AdamW moves -- with the upcast, the
unscale and the rounding in registers. AdamW, and Adam without weight decay, run at 1.04-1.10x torch's
fused fp32 AdamW on the 2-core AVX2 EPYC at 18.9M parameters (benchmarks/master_step.py; RESULTS.md says
where the rest goes: mostly per-step overhead, not bytes); Adam's L2 decay runs a narrower loop (below).

The arithmetic is torch.optim.Adam's (``_single_tensor_adam``), written once below; the scalars (bias
corrections, step size) in fp64 as torch computes them in Python, the elementwise part in fp32. It equals
the fused kernel's result up to the order of fp32 operations (tests/test_master_kernel.py: within a few
fp32 ulps after several steps), not bit for bit.

Hyperparameters enter as tensors, so an LR schedule does not recompile; the set of tensors with a gradient
does (one compile per distinct set). The skip of an overflowing step is decided before the kernel on the
CPU, where reading ``found_inf`` is free; on a GPU reading it would be a sync every step (the host could no
longer queue work ahead of the device), so there the kernel takes the flag and writes back the old values
when it is set, as torch's fused Adam does. (MasterWeights runs this pass on the CPU only: on a GPU torch's
fused kernel was faster, master_fused.COMPILED_ON. The GPU branches here stay tested on a GPU for the day
that changes.)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.errors import ConfigError

__all__ = ["KernelUnit", "adam_pass", "check_compilable", "coefficient_rows", "record_non_finite_",
           "unsupported_flags"]

@dataclass
class KernelUnit:
    """One tensor the pass updates: flattened fp32 master, its gradient, moments, half copy, step."""

    param: torch.Tensor
    grad: torch.Tensor  # half (upcast in the kernel) or fp32
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    model: torch.Tensor | None  # the half model tensor to round into; None for an fp32 parameter
    step: torch.Tensor  # 0-d fp32, already incremented for this step
    group: int  # index into the groups' hyperparameter tensors


def unsupported_flags(optimizer: torch.optim.Optimizer) -> list[str]:
    """The Adam settings set in some group that this pass (and split_adam's loop) do not implement."""
    groups = optimizer.param_groups
    return [k for k in ("amsgrad", "differentiable", "capturable") if any(g.get(k) for g in groups)]


def check_compilable(optimizer: torch.optim.Optimizer) -> None:
    """Raise unless every group is one this pass implements (Adam/AdamW without amsgrad, differentiable)."""
    unsupported = unsupported_flags(optimizer)
    if unsupported:
        raise ConfigError(
            f"compile_step=True implements Adam/AdamW without {', '.join(unsupported)}.",
            "drop compile_step=True (master_grads=False then runs torch's fused kernel chunk by chunk).",
        )


# The per-tensor scalars the pass reads, computed before it in double precision as torch's Adam computes
# them (Python floats) and handed to the pass as fp32 scalars, as torch hands them to its kernels. Computed
# outside the compiled loop because Inductor would re-evaluate loop-invariant scalar math (two pow() in
# double) for every vector of elements.
COEFFICIENTS = ("step_size", "bias_correction2_sqrt", "decay", "weight_decay", "one_minus_beta1", "beta2",
                "one_minus_beta2", "eps")


def _columns(lr: Any, beta1: Any, beta2: Any, eps: Any, wd: Any, step: Any, sqrt: Any) -> list[Any]:
    """COEFFICIENTS from the settings and the step count: Python floats or fp64 tensors alike."""
    columns = {
        "step_size": lr / (1 - beta1**step),  # lr over the first moment's bias correction
        "bias_correction2_sqrt": sqrt(1 - beta2**step),
        "decay": 1 - lr * wd,  # AdamW's decoupled decay factor
        "weight_decay": wd,
        "one_minus_beta1": 1 - beta1,
        "beta2": beta2,
        "one_minus_beta2": 1 - beta2,
        "eps": eps,
    }
    return [columns[name] for name in COEFFICIENTS]


def _settings(group: dict[str, Any]) -> list[float]:
    """lr, beta1, beta2, eps, weight_decay: _columns' leading arguments."""
    beta1, beta2 = map(float, group["betas"])
    return [_value(group["lr"]), beta1, beta2, float(group["eps"]), float(group["weight_decay"])]


def coefficients(units: Sequence[KernelUnit], groups: Sequence[dict[str, Any]]) -> torch.Tensor:
    """One row of COEFFICIENTS per unit (fp32), from its group's settings and its own step count."""
    if units[0].param.device.type != "cpu":
        return coefficients_on_device(units, groups)
    # On the CPU reading a step count costs ~1 us and Python floats beat ~15 tiny tensor ops (~0.4 ms a
    # step right after the pass has streamed the model through the caches). Units that share a group
    # and a step count share a row's arithmetic.
    steps = {id(u.step): u.step.item() for u in units}  # flat-buffer members share one step tensor
    keys = [(u.group, steps[id(u.step)]) for u in units]
    return torch.tensor(coefficient_rows(groups, keys, math.sqrt), dtype=torch.float32,
                        device=units[0].param.device)


def coefficient_rows(groups: Sequence[dict[str, Any]], keys: Sequence[tuple[int, float]],
                     sqrt: Any) -> list[list[float]]:
    """One row of COEFFICIENTS (Python floats) per (group index, step count) key; keys that repeat share
    one row's arithmetic. Also split_adam's native step's scalars."""
    settings = [_settings(g) for g in groups]
    rows = {key: _columns(*settings[key[0]], key[1], sqrt) for key in set(keys)}
    return [rows[key] for key in keys]


def coefficients_on_device(units: Sequence[KernelUnit], groups: Sequence[dict[str, Any]]) -> torch.Tensor:
    """:func:`coefficients` as fp64 tensor ops on the units' device: reads no step count back (no sync)."""
    device = units[0].param.device
    table = _on_device([_settings(g) for g in groups], torch.float64, device)
    per_unit = table[_on_device([u.group for u in units], torch.int64, device)].unbind(1)
    step = torch.stack([u.step for u in units]).to(torch.float64)
    return torch.stack(_columns(*per_unit, step, torch.sqrt), 1).to(torch.float32)


def _on_device(rows: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``rows`` as a tensor on ``device``, queued rather than waited for: CUDA copies from pageable host
    memory only once every kernel queued before has run (a sync per step); from pinned memory the copy is
    queued like a kernel (torch's pinned allocator keeps the buffer until the copy has run)."""
    host = torch.tensor(rows, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _value(lr: float | torch.Tensor) -> float:
    return lr.item() if isinstance(lr, torch.Tensor) else float(lr)


def decay_kind(group: dict[str, Any]) -> str:
    """How weight decay enters: torch's Adam adds it to the gradient (L2), AdamW shrinks the weight
    (decoupled); "none" at 0. A constant of the compiled pass: Dynamo recompiles if it changes."""
    if group["weight_decay"] == 0:
        return "none"
    return "decoupled" if group.get("decoupled_weight_decay", False) else "l2"


def _adam_pass(
    units: Sequence[tuple[torch.Tensor, ...]],
    models: Sequence[torch.Tensor | None],
    which: Sequence[int],
    coef: torch.Tensor,
    decay: Sequence[str],
    maximize: Sequence[bool],
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    # found_inf given (a GPU): a skipped step writes every target's old value back, so nothing changes
    keep_old = None if found_inf is None else found_inf > 0
    targets: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for i, ((p, g, m, v), model, k) in enumerate(zip(units, models, which, strict=True)):
        step_size, bias_correction2_sqrt, decay_factor, wd, one_minus_beta1, beta2, one_minus_beta2, eps = (
            coef[i].unbind()  # COEFFICIENTS' order
        )
        # fp16/bf16 -> fp32 is exact; unscaling in fp32 cannot flush a small gradient to zero.
        grad = g.float() if grad_scale is None else g.float() / grad_scale
        if maximize[k]:
            grad = -grad
        if decay[k] == "l2":
            grad = grad + wd * p
        weight = p * decay_factor if decay[k] == "decoupled" else p
        exp_avg = torch.lerp(m, grad, one_minus_beta1)
        exp_avg_sq = v * beta2 + grad * grad * one_minus_beta2
        new = weight - step_size * (exp_avg / (exp_avg_sq.sqrt() / bias_correction2_sqrt + eps))  # addcdiv's
        # the model (rounded to nearest), then p, m, v: each written after everything that reads its old value
        writes = [(model, new)] if model is not None else []
        writes += [(p, new), (m, exp_avg), (v, exp_avg_sq)]
        if keep_old is not None:  # each target reads only itself more: the write order below still holds
            writes = [(target, torch.where(keep_old, target, value)) for target, value in writes]
        # On the CPU one _foreach_copy_ writes every result. Inductor stores it straight into the targets
        # and recomputes each value inside its own write-back, so every loop touches the half gradient and
        # is vectorized at the half type's full width (separate copies leave fp32-only copy loops that
        # halve it: ~8% of the step on the AVX2 EPYC). As the recomputation reads the targets, the order
        # above matters (the model and p read p, m, v; m and v read themselves); Inductor's C++ backend
        # keeps it, and tests/test_master_kernel.py sees a wrong one as a step off by ~lr. Separate copies
        # where the order can be lost (Inductor then buffers each value before writing it back): Adam's L2
        # decay (p reads m and v, which read p: no order is safe) and GPUs, where Inductor packs a
        # _foreach_copy_ into one kernel whose parts run concurrently. A constant of the trace either way.
        if decay[k] == "l2" or not p.is_cpu:
            for target, value in writes:
                target.copy_(value)
        else:
            targets += [t for t, _ in writes]
            values += [value for _, value in writes]
    if targets:
        torch._foreach_copy_(targets, values)


# Compiled once per distinct set of tensors; dynamic=False: the shapes are fixed for a model's life.
# size_asserts off: Inductor's generated code would check every input's sizes and strides again on each
# call (~1 us per tensor, 5 tensors per parameter: 0.26 ms of a 1.6 ms step at 52 parameters, measured on
# one CPU thread), which Dynamo's guards already checked (dynamic=False guards on exact sizes and strides).
# Made at the first step, not at import: torch.compile with options can import Inductor (measured: 1.5-2 s
# of `import mixprec`, for users who never take this path; tests/test_master_kernel.py keeps it out).
@functools.cache
def _compiled_pass() -> Callable[..., None]:
    return torch.compile(_adam_pass, dynamic=False, options={"size_asserts": False})


@torch.no_grad()
def adam_pass(
    units: list[KernelUnit], groups: list[dict[str, Any]], grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """Update ``units`` (their steps already counted) by Adam/AdamW with ``groups``' settings, one pass;
    with ``found_inf`` (0-d, on the units' device) set, the pass leaves every tensor as it was.

    One compiled function serves every MasterWeights in the process: each distinct set of tensors (another
    model, or parameters that got no gradient this step) compiles once more (seconds). Past Dynamo's
    recompile limit (``torch._dynamo.config.recompile_limit``, 8) it warns and runs the same arithmetic
    eagerly: correct, but several passes over memory instead of one."""
    if not units:
        return
    _compiled_pass()(
        [(u.param, u.grad, u.exp_avg, u.exp_avg_sq) for u in units],
        [u.model for u in units],
        tuple(u.group for u in units),
        coefficients(units, groups),
        tuple(decay_kind(g) for g in groups),
        tuple(bool(g["maximize"]) for g in groups),
        None if grad_scale is None else grad_scale.to(units[0].param.device, torch.float32),
        None if found_inf is None else found_inf.to(units[0].param.device, torch.float32),
    )


# ---- the scaler's inf/NaN check of the half gradients, read-only ----------------------------------------


def _record_non_finite(grads: Sequence[torch.Tensor], found: torch.Tensor) -> None:
    flags = torch.stack([(~torch.isfinite(g)).any() for g in grads])
    found.copy_(torch.maximum(found, flags.any().to(found.dtype)))  # 1.0 once any is inf/NaN, never more


@functools.cache
def _compiled_record_non_finite() -> Callable[..., None]:
    return torch.compile(_record_non_finite, dynamic=False)  # at first use, as _compiled_pass


@torch.no_grad()
def record_non_finite_(grads: Sequence[torch.Tensor], found: torch.Tensor) -> None:
    """Set ``found`` (0-d fp32) to 1.0 if any of ``grads`` holds an inf or NaN; the gradients are only read.

    What ``torch._amp_foreach_non_finite_check_and_unscale_`` records at scale 1, the check a GradScaler
    makes before a step that unscales by itself (this one). That op's bf16 loop is slow on the CPU: 9.5 ms
    for 18.9M bf16 gradients on an AMX Xeon, where it takes 3.4 ms for twice the bytes of fp32 ones
    (benchmarks/master_step.py). Here one compiled reduction reads each half gradient once. Compiled once
    per distinct set of gradients, like the step itself (see adam_pass on recompiles).
    """
    _compiled_record_non_finite()(list(grads), found)
