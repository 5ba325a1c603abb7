"""Skipping a step: the one decision "step, or skip because a gradient was inf/NaN", and leaving the model
as it was when a step is skipped.

Every interface skips through ``step_unless_inf``: ``GradScaler.step``, apex-style ``scale_loss`` and the
Learner. It decides in one of two ways:

* on the device, with no host sync, when the optimizer can skip by itself (torch's fused Adam/AdamW/SGD
  read ``optimizer.found_inf`` and ``optimizer.grad_scale`` inside their kernel; ``device_skip_is_safe``
  excludes the one case where that is wrong);
* otherwise on the host: the inf flag is read once (one sync) and ``step`` is not called at all.

A skipped step may also leave the normalization layers' running statistics (BatchNorm's mean/var,
``num_batches_tracked``) as they were: the forward of the bad batch already changed them, with a NaN
sample for good. ``BufferWatch`` snapshots them before the first training forward of an iteration and puts
them back, with ``torch.where`` on the device flag (no sync), when the iteration's step is skipped. Those
only, by default: a training forward never reads them, so putting them back cannot make the next forward
overflow as this one did, where a buffer the forward reads (an EMA codebook healing from a stale value)
would be put back before the value that overflowed every time, and every step would be skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = ["step_unless_inf", "step_with_flags", "record_step_called", "combined_found_inf",
           "supports_amp_scaling", "skips_on_device", "device_skip_is_safe", "BufferWatch", "remove_watches",
           "running_statistics"]

T = TypeVar("T")


def device_skip_is_safe(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a fused optimizer may be left to skip an overflowing step on the device.

    Not a fused SGD with momentum before its momentum buffers exist: torch 2.13's fused SGD allocates them
    with torch.empty and, when ``found_inf`` skips that first step, never fills them, so the next step
    reads garbage. Then we decide on the host (one sync) and do not call step() at all."""
    inner = getattr(optimizer, "optimizer", optimizer)  # MasterWeights wraps the optimizer that steps
    if not isinstance(inner, torch.optim.SGD):
        return True
    return all(
        group.get("momentum", 0) == 0 or "momentum_buffer" in inner.state.get(p, {})
        for group in inner.param_groups
        for p in group["params"]
    )


def supports_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` unscales and skips in its own step (torch's fused optimizers, a user's with the
    flag): it then reads ``found_inf`` and ``grad_scale``, set by :func:`step_with_flags`."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``step_unless_inf`` leaves the skip to ``optimizer``'s own kernel (no host sync)."""
    return supports_amp_scaling(optimizer) and device_skip_is_safe(optimizer)


def combined_found_inf(flags: Iterable[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """One 0-dim float32 flag on ``device`` (default: the first flag's): exactly 1.0 when any of ``flags``
    is > 0, else 0.0. No sync. Never a sum: torch's fused optimizers skip only when ``found_inf == 1``, so
    two overflowing flags summed to 2.0 would let the step write inf/NaN. apex's rule that one overflowing
    loss skips every optimizer it touched, or a skip decided over several optimizers, is this flag over
    all of theirs."""
    flags = list(flags)
    if not flags:
        raise ValueError("combined_found_inf needs at least one flag (record an inf check first).")
    target = flags[0].device if device is None else device
    moved = [f.to(device=target, non_blocking=True).reshape(()) for f in flags]
    # one flag (one optimizer, one device: the common case) needs no stack and no any()
    raised = moved[0] > 0 if len(moved) == 1 else (torch.stack(moved) > 0).any()
    return raised.to(torch.float32)


def step_unless_inf(
    optimizer: torch.optim.Optimizer,
    found_inf: torch.Tensor,
    step_fn: Callable[..., T],
    *args: Any,
    grad_scale: torch.Tensor | None = None,
    on_skip: Callable[[], None] | None = None,
    **kwargs: Any,
) -> T | None:
    """``step_fn(*args, **kwargs)`` (normally ``optimizer.step``) unless ``found_inf > 0``.

    When ``skips_on_device(optimizer)``, the flag (and ``grad_scale``, the scale still in the gradients, or
    None if they are unscaled) is handed to the optimizer's fused kernel, which skips by itself: no sync,
    ``step_fn`` is always called and its result returned. Otherwise the flag is read once on the host (one
    sync); a skipped step returns None without calling ``step_fn``, but marks the optimizer as stepped in
    order so LR schedulers do not warn (pytorch#44511; the schedule advances with the iteration, as in
    torch). A clean step of an optimizer that unscales itself but may not skip on the device (fused SGD
    before its momentum buffers exist) still gets both flags. ``grad_scale`` needs such an optimizer:
    others must be given unscaled gradients. ``on_skip`` runs when the host path skips (apex's "Gradient
    overflow" message: the flag was read already, so saying so costs no sync), and the device path where
    the flag is in host memory (a fused optimizer on the CPU: reading it costs nothing); on a GPU the
    device path never knows, so never calls it."""
    if skips_on_device(optimizer):
        result = step_with_flags(optimizer, found_inf, grad_scale, step_fn, *args, **kwargs)
        if on_skip is not None and found_inf.device.type == "cpu" and found_inf.item():
            on_skip()  # a flag in host memory reads without a sync (a fused optimizer on the CPU)
        return result
    unscales_itself = supports_amp_scaling(optimizer)
    assert grad_scale is None or unscales_itself, "scaled gradients need an optimizer that unscales them"
    if not found_inf.item():  # the one host sync of the host path
        if unscales_itself:
            return step_with_flags(optimizer, found_inf, grad_scale, step_fn, *args, **kwargs)
        return step_fn(*args, **kwargs)
    record_step_called(optimizer)
    if on_skip is not None:
        on_skip()
    return None


def record_step_called(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer`` stepped, and the optimizer it wraps (``.optimizer``, ``.inner``), though their
    ``step()`` did not run (a skipped step; a pass that updates in the wrapped one's place): an LR
    scheduler built on either checks the flag torch's step wrapper sets, and warns "lr_scheduler.step()
    before optimizer.step()" without it (torch.amp's skip leaves that warning, pytorch#44511)."""
    for opt in (optimizer, getattr(optimizer, "optimizer", None), getattr(optimizer, "inner", None)):
        if isinstance(opt, torch.optim.Optimizer):
            opt._opt_called = True  # type: ignore[attr-defined]


def step_with_flags(
    optimizer: torch.optim.Optimizer,
    found_inf: torch.Tensor,
    grad_scale: torch.Tensor | None,
    step_fn: Callable[..., T],
    *args: Any,
    **kwargs: Any,
) -> T:
    """``step_fn`` with ``optimizer.found_inf`` and ``optimizer.grad_scale`` set for its duration: the
    contract of an optimizer with ``_step_supports_amp_scaling`` (torch's fused ones, or a user's), which
    reads both in every step torch.amp's GradScaler calls."""
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
    try:
        return step_fn(*args, **kwargs)
    finally:
        del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]


def running_statistics(module: nn.Module) -> list[torch.Tensor]:
    """The buffers of ``module``'s normalization layers (BatchNorm, InstanceNorm with running statistics,
    SyncBatchNorm: torch's ``_NormBase``), which a training forward updates and never reads."""
    norms = (m for m in module.modules() if isinstance(m, nn.modules.batchnorm._NormBase))
    return [b for m in norms for b in m.buffers(recurse=False)]


class BufferWatch:
    """Puts a module's running statistics back as they were when its step is skipped. Sync-free.

    A forward pre-hook copies the buffers of the module's normalization layers (:func:`running_statistics`:
    BatchNorm's running mean/var and ``num_batches_tracked``), or every buffer of every submodule with
    ``all_buffers=True``, into a snapshot at the first training-mode forward after ``arm()``, so gradient
    accumulation over several forwards snapshots once. ``restore_if(found_inf)`` then writes
    ``where(found_inf > 0, snapshot, buffer)`` into each on the device and re-arms. ``all_buffers``: for
    buffers the forward writes and does not read; one it reads, put back, may make every step overflow
    as the first did (module docstring).

    ``GradScaler.watch(model)`` makes one and calls ``restore_if`` from ``update()``; use it directly
    where the skip decision is made elsewhere (one ``restore_if`` per iteration, after the step).
    """

    def __init__(self, module: nn.Module, *, all_buffers: bool = False) -> None:
        self.module = module
        self.all_buffers = all_buffers
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._armed = True
        self._taken = False
        self._handle = module.register_forward_pre_hook(self._pre_forward)

    # Eager even inside a compiled model: traced, its per-iteration Python state (the armed flag, the
    # snapshot pairs) would be guarded on and recompile the model every step.
    @torch.compiler.disable
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if self._armed and module.training:  # eval forwards do not change BatchNorm buffers
            self.snapshot()

    @torch.no_grad()
    def snapshot(self) -> None:
        """Copy the buffers now (the pre-hook does this; call it yourself for buffers changed outside
        forward). Snapshot tensors are reused while the buffers keep their identity and shape."""
        old = {id(buf): snap for buf, snap in self._pairs}
        pairs = []
        for buf in self.watched():
            if nn.parameter.is_lazy(buf):  # a LazyBatchNorm's, before its first forward sizes it: none yet
                continue
            snap = old.get(id(buf))
            if snap is None or (snap.shape, snap.dtype, snap.device) != (buf.shape, buf.dtype, buf.device):
                snap = torch.empty_like(buf)
            pairs.append((buf, snap))
        if pairs:
            torch._foreach_copy_([s for _, s in pairs], [b for b, _ in pairs])
        self._pairs = pairs
        self._armed, self._taken = False, True

    def watched(self) -> list[torch.Tensor]:
        """The buffers a skipped step puts back."""
        return list(self.module.buffers()) if self.all_buffers else running_statistics(self.module)

    @torch.no_grad()
    def restore_if(self, found_inf: torch.Tensor) -> None:
        """Where ``found_inf > 0``, put every buffer back to its snapshot; then re-arm. No sync. Does
        nothing to the buffers if no training forward ran since the last call."""
        if self._taken:
            skipped = found_inf > 0
            for buf, snap in self._pairs:
                # Written through .data: the buffer's version counter stays. A graph still waiting for its
                # backward may have saved these buffers (BatchNorm saves its running statistics): another
                # loss's backward after this update (a GAN's generator loss through a forward made before
                # the discriminator's update, a second loss of the same forward) would fail autograd's
                # version check on a write that, unless the step was skipped, changes no value. Where it
                # was skipped, BatchNorm's training backward does not read them (it uses the batch's
                # statistics); only an eval-mode forward made after a training one in the same iteration,
                # its backward still to run, would read the values put back.
                buf.data.copy_(torch.where(skipped.to(buf.device, non_blocking=True), snap, buf))
        self.arm()

    def arm(self) -> None:
        """Take a new snapshot at the next training forward (start of an iteration)."""
        self._armed, self._taken = True, False

    def remove(self) -> None:
        """Stop watching: remove the hook and drop the snapshot."""
        self._handle.remove()
        self._pairs = []


def remove_watches(watches: list[BufferWatch], module: nn.Module) -> None:
    """Stop and drop the watches in ``watches`` that are on ``module``."""
    for watch in [w for w in watches if w.module is module]:
        watch.remove()
        watches.remove(watch)
