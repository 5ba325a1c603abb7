"""The fused O2 step: Adam/AdamW on fp32 masters that reads the model's half gradients itself.

The default master step keeps a persistent fp32 gradient per master (4 bytes per parameter): with the
half parameter (2), its half gradient (2), the master (4) and Adam's two moments (8), that is 20 bytes per
parameter, more than plain fp32 training's 16. This step keeps none. It walks the parameters in chunks
(:func:`chunk_for`: :data:`CHUNK` elements on the CPU, :data:`DEVICE_CHUNK` on a GPU); per chunk it upcasts
the half gradients into one reused fp32 scratch buffer (exact: every fp16/bf16 value is an fp32 value), runs
torch's fused Adam kernel on that chunk of masters and moments, and rounds the updated masters into the
model, on the CPU while the chunk is still in cache. So O2 + Adam keeps 2 + 2 + 4 + 8 = 16 bytes per
parameter; the scratch (at most a chunk, no more than the half gradients it holds) lives for the step only.

Unscaling and the inf/NaN skip happen inside the kernel, on fp32 values: it takes the scaler's
``grad_scale`` and ``found_inf`` tensors exactly as torch's ``Adam(fused=True)`` does (divides by the scale,
leaves masters, moments and the step count untouched when ``found_inf`` is set), or no scale when the
gradients were unscaled already (``scaler.unscale_``). The arithmetic is that kernel's, element by element,
so the result equals ``MasterWeights(Adam(...), fused=True)`` with persistent master gradients bit for bit
(tests/test_master_fused.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.errors import ConfigError
from mixprec.master_kernel import KernelUnit, adam_pass, check_compilable
from mixprec.master_storage import GroupMasters, views_like

__all__ = ["CHUNK", "FusedMasterStep", "check_fused_master"]

# Elements per chunk: 2**18 fp32 values, a 1 MiB scratch. The fastest of 2**14 ... 2**22 on the 2-core
# AVX2 EPYC (benchmarks/master_step.py, 9.4M parameters: 2**14 4.3x, 2**16 2.9x, 2**18 2.2x, 2**20 2.3x,
# 2**22 2.5x the fused fp32 step): smaller chunks pay per-call overhead (3 kernel calls per chunk), larger
# ones let the scratch leave the cache before the kernel reads it back.
CHUNK = 2**18

# On a GPU a chunk is about launches, not caches: each costs three kernel launches of the host's time, and
# 16M elements take the device ~0.1 ms at an H200's bandwidth. At 2**18 the H200 took 7.3 ms for 18.9M
# parameters behind a GradScaler, at 2**24 2.4 ms (benchmarks/master_step.py --device cuda). 2**24 fp32
# values: at most a 64 MiB scratch, for the step only (a smaller model's is its size).
DEVICE_CHUNK = 2**24


def chunk_for(device: torch.device) -> int:
    """Elements per chunk on ``device``: cache-sized on the CPU, launch-sized elsewhere."""
    return CHUNK if device.type == "cpu" else DEVICE_CHUNK

# torch's fused Adam kernels, by the group's decoupled_weight_decay (AdamW is Adam with it set).
KERNELS: dict[bool, Callable[..., None]] = {False: torch._fused_adam_, True: torch._fused_adamw_}
SUPPORTED = (torch.optim.Adam, torch.optim.AdamW)


def check_fused_master(optimizer: torch.optim.Optimizer) -> None:
    """Raise unless ``optimizer`` is one this step implements."""
    if type(optimizer) not in SUPPORTED or any(g.get("differentiable") for g in optimizer.param_groups):
        raise ConfigError(
            f"master_grads=False runs torch's fused Adam kernel; {type(optimizer).__name__} has none.",
            "use torch.optim.Adam or AdamW (differentiable=False), or keep master_grads=True.",
        )
    devices = {p.device.type for g in optimizer.param_groups for p in g["params"]}
    if not devices <= {"cpu", "cuda"}:
        raise ConfigError(
            f"master_grads=False needs torch's fused Adam, which runs on cpu and cuda: {sorted(devices)}.",
            "keep master_grads=True on this device.",
        )


@dataclass
class _Unit:
    """One tensor (or a slice of it) the kernel updates, with the gradient it reads."""

    param: torch.Tensor  # fp32 master (or fp32 model parameter), flattened
    grad: torch.Tensor  # its gradient, flattened: half (upcast into the scratch) or fp32 (read as is)
    state: dict[str, Any]  # the optimizer state of the tensor it belongs to
    offset: int  # where `param` starts in that tensor's state (nonzero for flat-buffer members and slices)
    model: torch.Tensor | None  # the half model slice to round the result into, None for fp32 parameters


# Device types where compile_step=True runs the compiled pass. On a GPU its per-tensor kernels cost the host
# more than the whole update costs the device: on an H200 (benchmarks/master_step.py --device cuda, 18.9M
# bf16 parameters) the compiled step took 1.5 ms, torch's fused kernel over one chunk (DEVICE_CHUNK) 1.0 ms;
# behind a GradScaler 3.5 against 2.4 ms (RESULTS.md). There compile_step=True runs that kernel instead:
# torch's Adam arithmetic bit for bit.
COMPILED_ON: frozenset[str] = frozenset({"cpu"})

# Device types where the compiled step reads found_inf on the host to skip an overflowing step (free there);
# elsewhere the compiled pass takes the flag (a read would wait for the device every step).
SKIP_ON_HOST: frozenset[str] = frozenset({"cpu"})


def _adam_state(state: dict[str, Any], param: torch.Tensor, amsgrad: bool) -> dict[str, Any]:
    """torch's Adam state, created the way Adam(fused=True) creates it: a float32 step on the device."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if amsgrad:
            state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


class FusedMasterStep:
    """Steps an Adam/AdamW whose param groups hold the masters of ``groups`` (see module docstring).

    ``compiled=True`` runs the whole update as one compiled pass instead (master_kernel.py)."""

    def __init__(self, optimizer: torch.optim.Optimizer, compiled: bool = False) -> None:
        check_fused_master(optimizer)
        if compiled:
            check_compilable(optimizer)
        self.optimizer = optimizer
        self.compiled = compiled
        self._slots: list[_Slot] = []  # the compiled step's tensors, kept from step to step (_slots_for)
        self._slots_key: tuple[int, ...] = ()

    def _units(self, group: dict[str, Any], masters: GroupMasters) -> Iterator[_Unit]:
        state, amsgrad = self.optimizer.state, bool(group["amsgrad"])
        for slot in _slots(group, masters, 0):
            if slot.source.grad is None:
                continue  # torch.optim's rule: no gradient, no step (no decay, no moment update)
            s = _adam_state(state[slot.owner], slot.owner, amsgrad)
            yield _Unit(slot.param, slot.source.grad.reshape(-1), s, slot.offset, slot.model)

    def _chunks(self, units: list[_Unit]) -> Iterator[list[_Unit]]:
        """Units cut at CHUNK elements and packed so that each chunk's half gradients fill one scratch."""
        chunk: list[_Unit] = []
        filled = 0
        size = chunk_for(units[0].param.device)
        for u in units:
            start = 0
            while start < u.param.numel():
                n = min(u.param.numel() - start, size - filled)
                chunk.append(_slice(u, start, n))
                start += n
                filled += n if u.model is not None else 0
                if filled == size:
                    yield chunk
                    chunk, filled = [], 0
        if chunk:
            yield chunk

    def runs_compiled(self) -> bool:
        """Whether :meth:`step` runs the compiled pass: asked for, and on a device in COMPILED_ON."""
        first = next((p for g in self.optimizer.param_groups for p in g["params"]), None)
        return self.compiled and first is not None and first.device.type in COMPILED_ON

    @torch.no_grad()
    def step(self, groups: list[GroupMasters], grad_scale: Any = None, found_inf: Any = None) -> None:
        if self.runs_compiled():
            self._step_compiled(groups, grad_scale, found_inf)
            return
        scratch: dict[torch.device, torch.Tensor] = {}  # up to a chunk of fp32 per device, for this step
        for group, masters in zip(self.optimizer.param_groups, groups, strict=True):
            units = list(self._units(group, masters))
            if not units:
                continue
            steps = list({id(u.state["step"]): u.state["step"] for u in units}.values())
            torch._foreach_add_(steps, 1)  # once per tensor, before its chunks: the kernel reads it
            for chunk in self._chunks(units):
                self._update(group, chunk, grad_scale, found_inf, scratch)
            if found_inf is not None:  # a skipped step does not count (torch's fused Adam does the same)
                torch._foreach_sub_(steps, [found_inf.to(s.device) for s in steps])

    def _step_compiled(self, groups: list[GroupMasters], grad_scale: Any, found_inf: Any) -> None:
        # Where reading the flag is free (the CPU) a skipped step returns here: masters, moments and step
        # counts untouched, as torch's fused Adam leaves them. On a GPU the read would be a sync every step:
        # the pass takes the flag instead and leaves every tensor as it was (master_kernel.py).
        on_device = found_inf is not None and found_inf.device.type not in SKIP_ON_HOST
        if found_inf is not None and not on_device and found_inf.item():
            return
        state = self.optimizer.state
        slots = self._slots_for(groups)
        if any(slot.moved() for slot in slots):  # a parameter's memory was replaced (`.data =`)
            self.forget_views()
            slots = self._slots_for(groups)
        units = []
        for slot in slots:
            grad = slot.source.grad
            if grad is None:
                slot.release()  # its moments may be freed (a frozen parameter's state deleted, a new state)
                continue  # torch.optim's rule: no gradient, no step (no decay, no moment update)
            owned = _adam_state(state[slot.owner], slot.owner, False)  # one lookup: tensors hash in Python
            units.append(KernelUnit(slot.param, grad.reshape(-1), *slot.moments(owned), slot.model,
                                    owned["step"], slot.group))
        steps = list({id(u.step): u.step for u in units}.values())
        if steps:
            torch._foreach_add_(steps, 1)  # once per tensor: flat-buffer members share their buffer's step
        adam_pass(units, self.optimizer.param_groups, grad_scale, found_inf if on_device else None)
        if on_device and steps:  # a skipped step does not count (torch's fused Adam does the same)
            # by 1 whatever the flag's value: the pass skips on any found_inf > 0 (a torch GradScaler over
            # several devices may sum flags to 2)
            skipped = (found_inf > 0).to(torch.float32)
            torch._foreach_sub_(steps, [skipped.to(s.device) for s in steps])

    def _slots_for(self, groups: list[GroupMasters]) -> list[_Slot]:
        """One :class:`_Slot` per tensor the compiled step may update, built on the first step and again
        when the param groups change (add_param_group) or load_state_dict replaced the state: walking the
        groups and flattening views every step cost ~0.16 ms at 60 tensors on the AMX Xeon (RESULTS.md)."""
        key = (id(groups), len(groups), *(len(g["params"]) for g in self.optimizer.param_groups))
        if key != self._slots_key:
            self._slots = [slot for k, (group, masters) in
                           enumerate(zip(self.optimizer.param_groups, groups, strict=True))
                           for slot in _slots(group, masters, k)]
            self._slots_key = key
        return self._slots

    def forget_views(self) -> None:
        """Drop the cached slots and their moment views (MasterWeights.load_state_dict: the replaced
        moments are freed now, not after the next step)."""
        self._slots, self._slots_key = [], ()

    def __getstate__(self) -> dict[str, Any]:
        # The slots alias this process's memory: a copy or a load rebuilds them on its first step.
        return {k: v for k, v in self.__dict__.items() if k not in ("_slots", "_slots_key", "_views")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.pop("_views", None)  # pickled before the slots (2026-11-25): their moment-view cache
        self.forget_views()

    def _update(
        self, group: dict[str, Any], chunk: list[_Unit], grad_scale: Any, found_inf: Any,
        scratch: dict[torch.device, torch.Tensor],
    ) -> None:
        half = [u for u in chunk if u.model is not None]
        grads = {id(u): u.grad for u in chunk}
        if half:
            device = half[0].param.device
            need = sum(u.grad.numel() for u in half)  # a small model's scratch is its size, not a chunk's
            if device not in scratch or scratch[device].numel() < need:
                scratch[device] = torch.empty(need, dtype=torch.float32, device=device)
            views = views_like(scratch[device], [u.grad for u in half])
            torch._foreach_copy_(views, [u.grad for u in half])  # exact upcast
            grads.update({id(u): v for u, v in zip(half, views, strict=True)})
        moments = [_moment(u, "exp_avg") for u in chunk]
        squares = [_moment(u, "exp_avg_sq") for u in chunk]
        maxes = [_moment(u, "max_exp_avg_sq") for u in chunk] if group["amsgrad"] else []
        KERNELS[bool(group.get("decoupled_weight_decay", False))](
            [u.param for u in chunk],
            [grads[id(u)] for u in chunk],
            moments,
            squares,
            maxes,
            [u.state["step"] for u in chunk],
            lr=group["lr"],
            beta1=float(group["betas"][0]),
            beta2=float(group["betas"][1]),
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            amsgrad=group["amsgrad"],
            maximize=group["maximize"],
            grad_scale=grad_scale,
            found_inf=found_inf,
        )
        if half:  # round to nearest into the model while the chunk is in cache
            torch._foreach_copy_([u.model for u in half], [u.param for u in half])  # type: ignore[misc]


@dataclass
class _Slot:
    """One tensor of the compiled step and what stays the same from step to step: its flat master (or
    fp32 parameter) and model views, where its optimizer state lives, and its views of the two moments.
    The moment views are kept while the state holds the same moment tensors over the same memory (``.data =``
    or ``.set_()`` move a tensor's memory; load_state_dict replaces the tensors)."""

    source: torch.Tensor  # whose .grad the step reads: the half model parameter, or the fp32 parameter
    param: torch.Tensor  # the fp32 master (or the fp32 parameter itself), flattened
    model: torch.Tensor | None  # the half model tensor, flattened; None for an fp32 parameter
    owner: torch.Tensor  # the tensor the optimizer keeps state for: the flat buffer, or the master
    offset: int  # where `param` starts in that state
    group: int
    master: torch.Tensor  # the tensor `param` aliases (the master, or the fp32 parameter itself)
    _cache: tuple[Any, ...] = ()  # (exp_avg, exp_avg_sq, their data_ptrs, their views)
    _ptrs: tuple[int, int] = (-1, -1)

    def __post_init__(self) -> None:
        self._ptrs = (self.source.data_ptr(), self.master.data_ptr())

    def moved(self) -> bool:
        """Whether the parameter or its master now lives in other memory than the aliases were made of."""
        return (self.source.data_ptr(), self.master.data_ptr()) != self._ptrs

    def release(self) -> None:
        """Let go of the moment views (and so of the moments): the next step with a gradient re-takes them."""
        self._cache = ()

    def moments(self, state: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        m, v = state["exp_avg"], state["exp_avg_sq"]
        c = self._cache
        if not c or c[0] is not m or c[1] is not v or c[2] != m.data_ptr() or c[3] != v.data_ptr():
            n = self.param.numel()
            c = self._cache = (m, v, m.data_ptr(), v.data_ptr(), _part(m, self.offset, n),
                               _part(v, self.offset, n))
        return c[4], c[5]


def _slots(group: dict[str, Any], masters: GroupMasters, k: int) -> Iterator[_Slot]:
    """Every tensor of one param group the step may update (with or without a gradient now): the half
    parameters' masters in order, then the fp32 parameters that are their own masters."""
    shadowed = {id(t) for t in masters.shadow()}
    for view, p, in_flat in zip(masters.views, masters.model, masters.in_flat, strict=True):
        owner = masters.flat if in_flat else view
        offset = view.storage_offset() if in_flat else 0
        yield _Slot(p, _alias(view), _alias(p), owner, offset, k, view)  # type: ignore[arg-type]
    for p in group["params"]:  # fp32 parameters are their own masters (BatchNorm under O2)
        if id(p) not in shadowed:
            yield _Slot(p, _alias(p), None, p, 0, k, p)


def _alias(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened, outside autograd: the same memory and version counter, no autograd view. A view of
    a tensor that requires grad, made under no_grad and kept across steps, may not be read once its base
    was written in place (torch refuses its grad_fn; Dynamo reads it when the step recompiles)."""
    return t.detach().view(-1)


def _slice(u: _Unit, start: int, n: int) -> _Unit:
    if start == 0 and n == u.param.numel():
        return u
    model = None if u.model is None else u.model[start : start + n]
    return _Unit(u.param[start : start + n], u.grad[start : start + n], u.state, u.offset + start, model)


def _moment(u: _Unit, key: str) -> torch.Tensor:
    return _part(u.state[key], u.offset, u.param.numel())


def _part(state_tensor: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    """A tensor's share of an optimizer-state tensor (a flat buffer's state holds all its members)."""
    return state_tensor.view(-1)[offset : offset + n]
