"""fp32 master weights: ``MasterWeights`` wraps any ``torch.optim`` optimizer of a half-precision model.

Why: an update ``lr * grad`` is often smaller than half a unit in the last place of the weight it is added
to. In fp16 (11 significant bits) ``1.0 + 1e-4 == 1.0``, so a model whose weights are stored only in fp16
stops learning once its updates get small. The fix is to keep an fp32 copy of every half-precision weight
(the *master*), let the optimizer update the masters, and round them to half precision only to run the
model. Forward and backward still run in half precision; only the update is fp32.

One training step through this module::

    model (fp16/bf16) --backward--> half grads --copy_grads_to_master--> fp32 master grads
        --(GradScaler: unscale in fp32, find inf/NaN)--> optimizer.step() on the masters
        --copy back (round to nearest)--> model weights

Parameters that are already fp32 (e.g. BatchNorm kept in fp32) are their own masters: no copy.

Two layouts:
  * per parameter (default): one fp32 master per half parameter; optimizer state per parameter.
  * flat (``flat=True``, fastai's ``flat_master``): one contiguous fp32 buffer per param group, which the
    optimizer sees as a single parameter, so its update runs as one long kernel; ``master_views()`` gives
    the per-parameter views of it.

Cost: the copies are ``torch._foreach_copy_`` calls (one kernel each way per group), never a Python loop
of small ops. When the wrapped optimizer is Adam, AdamW or Adagrad and the user left both ``foreach`` and
``fused`` unset, the masters are updated with the fused
kernel: one pass over memory instead of the ~10 of the foreach path, and it can skip an overflowing step
on the device (``GradScaler`` then never syncs). Pass ``fused=False`` to keep the optimizer as it was.
``master_grads=False`` (Adam/AdamW) goes further: no fp32 master gradients at all, the step reads the half
gradients chunk by chunk (master_fused.py). master_storage.py holds the masters and the rules they keep
(no gradient, no step; frozen parameters outside flat buffers).

The GradScaler protocol (scaler.py): ``copy_grads_to_master()`` before it reads gradients,
``scaled_grad_params()`` names the tensors whose gradients it checks and unscales, ``grads_unscaled()``
after a user's ``scaler.unscale_(opt)`` (mirrors the unscaled gradients into the model for clipping).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import _get_scalar_dtype  # torch's rule for the dtype of a step count

from mixprec.errors import ConfigError, ParameterMismatchError

# re-exported: they lived here before mixprec.half_model
from mixprec.half_model import BATCHNORM, Converted, fp32_originals, model_to_half
from mixprec.hardware import HALF_DTYPES
from mixprec.master_fused import FusedMasterStep
from mixprec.master_kernel import record_non_finite_
from mixprec.master_state import InnerOptimizerGuard, check_state_shapes, split_master_state, warn_reseeded
from mixprec.master_storage import GradMirror, GroupMasters, HoleGuard, make_masters, views_like
from mixprec.outside_region import RegionWatch
from mixprec.skip_step import record_step_called
from mixprec.unscale_copy import unscale_copy_
from mixprec.warn_site import user_stacklevel

__all__ = [
    "MasterWeights",
    "HALF_DTYPES",
    "BATCHNORM",
    "Converted",
    "check_params_belong",
    "model_to_half",
    "fp32_originals",
]


_views_like = views_like  # the name low_precision.py imports from here

# Optimizers whose fused kernel we pick on the user's behalf. Not SGD: in torch 2.13 a fused SGD with
# momentum whose *first* step is skipped (found_inf) leaves its momentum buffer uninitialized (torch.empty),
# and the next step reads garbage -- exactly what a loss scaler's first overflows trigger.
AUTO_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)


def _count_complex(params: Iterable[torch.Tensor]) -> int:
    """How many of ``params`` are complex: torch's fused optimizers take real ones only."""
    return sum(p.is_complex() for p in params)


def _fused_capable(optimizer: torch.optim.Optimizer) -> bool:
    """True when we may pick the fused kernel: a class on AUTO_FUSED and neither foreach nor fused chosen."""
    defaults = optimizer.defaults
    return (
        type(optimizer) in AUTO_FUSED
        and "fused" in defaults
        and defaults.get("fused") is None
        and defaults.get("foreach") is None
        and not defaults.get("differentiable", False)
    )


@dataclass
class _Iteration:
    """What MasterWeights has done in this iteration. A plain object, not attributes of the optimizer:
    Dynamo of torch 2.11 failed to set an attribute of an Optimizer inside a compiled step ("Attempted
    setattr on a user-defined object that does not have an AttributeMutation mutation_type")."""

    grads_copied: bool = False  # the model's gradients are in the masters' (by the scaler, or clipping)


@torch.no_grad()
def clip_half_grads_(params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                     error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over half-precision gradients with the norm taken in fp32 (torch's
    sums the squares and rounds each tensor's norm in the gradients' dtype: up to ~1% off in bf16) and each
    gradient scaled in place with one rounding. Returns the fp32 total norm (a device tensor: no sync)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    # fp32 accumulation of the norm: the half gradients' squares summed in half lose their low bits
    norms = torch._foreach_norm(grads, norm_type, dtype=torch.float32)  # one kernel per device, as torch
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(  # torch's message
            f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped. "
            "To disable this error, set error_if_nonfinite=False"
        )
    # torch's own scaling by max_norm / (total + 1e-6), at most 1: the factor stays fp32 (total is), so each
    # half gradient is multiplied in fp32 and rounded once
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


# torch's GradScaler, by the file its step() runs in (torch.amp.GradScaler; torch.cuda.amp's subclasses it)
_TORCH_SCALER_FILE = os.path.join("torch", "amp", "grad_scaler.py")


def _called_by_torch_grad_scaler(depth: int = 12) -> bool:
    """Whether an enabled torch.amp.GradScaler is among the callers of our caller's caller (step hooks,
    an LR scheduler's or torch's profiling wrapper of Optimizer.step may sit between): ~1-2 us a step."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(_TORCH_SCALER_FILE):
            # a disabled scaler (GradScaler(enabled=False), as for a bf16 run) only calls step() as it is
            return bool(getattr(frame.f_locals.get("self"), "_enabled", True))
        frame = frame.f_back
    return False


class MasterWeights(torch.optim.Optimizer):
    """Keep fp32 master weights for a half-precision model and let ``optimizer`` update them.

    Args:
        optimizer: any ``torch.optim`` optimizer built over the model's (fp16/bf16) parameters, before
            its first step. Its param groups are rewired to the masters in place.
        flat: one contiguous fp32 buffer per param group instead of one master per parameter. Frozen
            parameters stay out of it (see master_storage.py for the rules every layout keeps).
        model: if given, every optimized parameter must belong to it (catches a model/optimizer mix-up).
        fused: None picks torch's fused update when the optimizer has one, no choice was made and
            every parameter is real (torch's fused kernels take no complex ones); False leaves the
            optimizer as it was; True requires it.
        initial: fp32 values to seed the masters of these half parameters, keyed by the parameter
            (e.g. :func:`fp32_originals` of :func:`model_to_half`): the weights before they were rounded to
            half precision, so rounding the model loses nothing the masters keep. Default: the half values.
        master_grads: True (default) keeps a persistent fp32 gradient per master. False (Adam/AdamW only)
            keeps none: the step reads the half gradients chunk by chunk (master_fused.py), 16 bytes per
            parameter for O2 + Adam instead of 20; ``scaler.unscale_`` then unscales the half gradients in
            place, which the scaler allows for bf16 and refuses for fp16 (fp16 would flush small values).
        compile_step: with ``master_grads=False``, run the update as one pass that torch.compile generates
            (master_kernel.py): the half gradient upcast, unscaled, Adam's update and the rounding into the
            model in one loop. The first step compiles (seconds); equal to torch's Adam up to fp32
            rounding order. Adam/AdamW without amsgrad. On a GPU, where the compiled pass's kernels cost
            the host more time than torch's fused kernel does, the step runs that kernel over one chunk
            instead (master_fused.COMPILED_ON), which takes ``found_inf`` on the device (no sync). With
            a GradScaler the compiled pass decides the skip by reading ``found_inf`` on the host (free on
            the CPU). When ``scaler.step`` only checks the half gradients (no ``unscale_`` before it), it
            does so read-only: natively on the CPU (:mod:`mixprec.non_finite`), with a compiled reduction
            where the CPU has no compiler (:attr:`non_finite_check`), on a GPU with torch's ops; an
            explicit ``unscale_`` (and so ``scale_loss`` and the Learner, which unscale on their own) uses
            the native check at bf16's scale of 1 on the CPU, else torch's op.
        mirror_grads: after ``scaler.unscale_(opt)``, write the unscaled gradients back into the model's
            ``.grad`` (see Clipping). One extra pass per explicit unscale; callers whose users clip only
            the masters may pass False (the Learner does; ``mixprec.initialize`` keeps it, so a clip of
            ``model.parameters()`` works there too).

    The wrapper *is* a ``torch.optim.Optimizer`` (LR schedulers accept it) whose ``param_groups`` and
    ``state`` are the wrapped optimizer's. Build schedulers on the wrapper, step the wrapper, and save
    ``opt.state_dict()`` (the wrapper's: it holds the masters; the wrapped optimizer's warns).

    Clipping: torch.amp's recipe works unchanged with ``mixprec.GradScaler`` (torch.amp's own scaler does
    not know the masters and fails on this wrapper), ``scaler.unscale_(opt)`` then
    ``clip_grad_norm_(model.parameters(), max_norm)`` then ``scaler.step(opt)``: unscale_ fills the fp32
    master gradients and mirrors them, unscaled and rounded to the model's dtype, into the model's
    ``.grad``; ``step`` takes over any gradient edited there since (it watches each tensor's version
    counter). That clip computes in the model's dtype (its norm in bf16 is up to ~1% off) and, for fp16, the
    mirror rounds small gradients to fp16 subnormals; ``opt.clip_grad_norm_(max_norm)`` clips the fp32
    master gradients instead and loses nothing (with ``master_grads=False``: an fp32 norm, the half
    gradients scaled with one rounding).

    Where it differs from the optimizer it wraps: ``state_dict()`` loads into a plain optimizer of the fp32
    model tensor by tensor only with ``flat=False`` (a flat buffer is one tensor in place of many); the
    optimizer's state-dict hooks registered on the wrapper do not run; a global step hook
    (``torch.optim.optimizer.register_optimizer_step_pre_hook``) sees the wrapper's step and the wrapped
    optimizer's, so it runs twice (once with ``master_grads=False``); with ``master_grads=False`` the
    update is mixprec's fused pass, not the wrapped optimizer's ``step``, so step hooks registered on the
    wrapped optimizer itself (``inner.register_step_pre_hook``) do not run: register them on the wrapper,
    whose hooks run every step; with ``flat=True``, SGD with
    momentum and ``dampening > 0`` starts the momentum of a parameter whose first step had no gradient from
    zero rather than from its first gradient (``dampening=0``, torch's default, is exact).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        flat: bool = False,
        model: nn.Module | None = None,
        fused: bool | None = None,
        initial: Mapping[torch.Tensor, torch.Tensor] | None = None,
        master_grads: bool = True,
        mirror_grads: bool = True,
        compile_step: bool = False,
    ) -> None:
        _check_wrappable(optimizer, model)
        if initial is None:  # with initial= the caller cast the model itself (initialize, the Learner)
            _warn_if_nothing_is_half(optimizer)
        _warn_of_frozen_masters(optimizer)
        if not master_grads and fused is False:
            raise ConfigError("master_grads=False runs a fused kernel, but fused=False was passed.",
                              "drop fused=False, or keep master_grads=True.")
        if compile_step and master_grads:
            raise ConfigError("compile_step=True compiles the step that reads the half gradients itself.",
                              "pass master_grads=False with it.")
        self._fused_step = None if master_grads else FusedMasterStep(optimizer, compiled=compile_step)
        self.optimizer = optimizer
        self.flat = flat
        self.mirror_grads = mirror_grads
        # `initial` is used here only: keeping it would hold a second fp32 copy of the model alive.
        self._groups = [self._rewire(group, initial or {}) for group in optimizer.param_groups]
        self._use_fused(optimizer, True if not master_grads else fused)
        _remake_initial_state(optimizer)  # Adagrad's, made at construction for the half parameters
        # param_groups, state and defaults are properties reading the wrapped optimizer, so schedulers see
        # one object even after load_state_dict replaces the wrapped optimizer's lists.
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._patch_step_function()
        self._iteration = _Iteration()
        self._mirror = GradMirror()
        self._guard = InnerOptimizerGuard(optimizer, self._seed_from_model)
        self._region_watch = RegionWatch("MasterWeights")  # a bare forward where torch's half GEMMs crawl

    # ------------------------------------------------------------------ the wrapped optimizer's bookkeeping
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def _from_masters_first(self, inner_state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint saved before each master took its parameter's place: its groups list the masters
        first, then the fp32 parameters. Renumber them in the groups' present order."""
        mastered = {id(v) for v in self.master_views()}
        sizes = [len(g["params"]) for g in inner_state["param_groups"]]
        mine = [len(g["params"]) for g in self.optimizer.param_groups]
        if sizes != mine:
            raise ConfigError(
                f"The checkpoint's param groups hold {sizes} tensors; this optimizer's hold {mine}.",
                "load a checkpoint saved from the same model and param groups.",
            )
        groups = []
        for saved, group in zip(inner_state["param_groups"], self.optimizer.param_groups, strict=True):
            params = group["params"]
            old_order = [p for p in params if id(p) in mastered]
            old_order += [p for p in params if id(p) not in mastered]
            saved_id = {id(p): i for p, i in zip(old_order, saved["params"], strict=True)}
            groups.append({**saved, "params": [saved_id[id(p)] for p in params]})
        return {**inner_state, "param_groups": groups}

    def __getstate__(self) -> dict[str, Any]:  # type: ignore[override]
        # torch's Optimizer pickles defaults/state/param_groups only; the wrapper is its attributes, but not
        # an LR scheduler's per-instance step wrapper (not picklable; torch drops it the same way)
        return {k: v for k, v in self.__dict__.items() if k not in ("_guard", "step")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for group in self._groups:
            group.relink()  # plain pickle copies a flat buffer's views apart from it
            group.record_versions()  # tensors made anew count from zero
        if "_grads_copied" in state:  # pickled before the flag moved into _Iteration
            self._iteration = _Iteration(self.__dict__.pop("_grads_copied"))
        # The wrapped optimizer was rebuilt from its own three fields: give it back what we set on it.
        if any(g.get("fused") for g in self.optimizer.param_groups):
            self.optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]
        self._guard = InnerOptimizerGuard(self.optimizer, self._seed_from_model)

    # ------------------------------------------------------------------ construction
    def _rewire(self, group: dict[str, Any], initial: Mapping[torch.Tensor, torch.Tensor]) -> GroupMasters:
        params: list[torch.Tensor] = list(group["params"])
        half = [p for p in params if p.dtype in HALF_DTYPES]
        others = [p for p in params if p.dtype not in HALF_DTYPES]
        masters = make_masters(half, self.flat, initial, keep_grads=self._fused_step is None)
        if masters.flat is None:
            # Each master takes its parameter's place, so the group numbers its tensors as the user's did:
            # the state_dict then loads into a plain optimizer of the fp32 model (and back) tensor by
            # tensor, fp32 BatchNorm/LayerNorm parameters among half ones included.
            master_of = {id(p): m for p, m in zip(half, masters.views, strict=True)}
            group["params"] = [master_of.get(id(p), p) for p in params]
        else:
            group["params"] = masters.shadow() + others  # one buffer for many: no order to keep
        masters.record_versions()
        return masters

    def _use_fused(self, optimizer: torch.optim.Optimizer, fused: bool | None) -> None:
        if fused is False or (fused is None and not _fused_capable(optimizer)):
            return
        if "fused" not in optimizer.defaults:
            raise ConfigError(
                f"fused=True, but {type(optimizer).__name__} has no fused implementation in torch.",
                "use fused=None (pick it when available) or one of Adam, AdamW, SGD, Adagrad.",
            )
        devices = {p.device.type for g in optimizer.param_groups for p in g["params"]}
        if fused is None and not devices <= {"cpu", "cuda"}:
            return  # fused kernels of other backends vary; keep the user's choice
        complex_ = _count_complex(p for g in optimizer.param_groups for p in g["params"])
        if complex_ and fused is None:
            return  # torch's fused kernels take real parameters only (an FNO's complex spectral weights)
        if complex_:
            raise ConfigError(
                f"fused=True (or master_grads=False, which runs a fused kernel), but {complex_} parameter(s) "
                "are complex: torch's fused optimizers take real floating point parameters only.",
                "leave fused=None and master_grads=True: the optimizer's own foreach update handles complex "
                "parameters.",
            )
        optimizer.defaults["fused"] = True
        for group in optimizer.param_groups:
            group["fused"] = True
            group["foreach"] = False
        optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]

    @torch.no_grad()
    def _seed_from_model(self) -> None:
        for g in self._groups:
            if g.model:
                torch._foreach_copy_(g.views, g.model)
            g.record_versions()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of model parameters; their masters are made here."""
        params = param_group["params"]
        new = [params] if isinstance(params, torch.Tensor) else list(params)
        seen = {id(p) for p in self.model_params()} | {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in seen for p in new):
            raise ConfigError(  # torch.optim's ValueError, with the fix
                "some parameters appear in more than one parameter group",
                "add each parameter once: leave out those already in a group of this optimizer.",
            )
        fused = param_group.get("fused", self.optimizer.defaults.get("fused"))
        if fused and _count_complex(new):
            raise ConfigError(
                "this group holds complex parameters, and the optimizer runs torch's fused kernel "
                "(MasterWeights picks it for real parameters), which takes none: its step would be refused.",
                "build MasterWeights(..., fused=False), or give the complex parameters to the optimizer when "
                "it is built (MasterWeights then keeps its own update).",
            )
        self.optimizer.add_param_group({**param_group, "params": new})
        self._groups.append(self._rewire(self.optimizer.param_groups[-1], {}))
        _remake_initial_state(self.optimizer, [self.optimizer.param_groups[-1]])

    # ------------------------------------------------------------------ the step
    @property
    def _step_supports_amp_scaling(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))

    def _check_still_half(self) -> None:
        drifted = [p for g in self.param_groups for p in g["params"] if p.dtype in HALF_DTYPES]
        if drifted:
            raise ConfigError(
                f"{len(drifted)} optimized parameters are {drifted[0].dtype} now but were not when "
                "MasterWeights was built (model.half()/.bfloat16() after wrapping?): they would be updated "
                "in half precision, without fp32 masters.",
                "cast the model first, then build the optimizer and MasterWeights over its parameters "
                "(or use mixprec.initialize, which does it in that order).",
            )

    @torch.no_grad()
    def copy_grads_to_master(self) -> None:
        """Copy the model's half gradients into the fp32 master gradients (one foreach copy per group).

        fp16/bf16 -> fp32 is exact, so nothing is lost here; the scaler unscales the fp32 copies.
        Masters whose parameter has no gradient get none (a flat buffer's holes: zero, put back after)."""
        self._copy_grads()

    def copy_grads_to_master_unscaled(
        self, found: torch.Tensor, inv_scale: torch.Tensor
    ) -> tuple[set[int], bool]:
        """:meth:`copy_grads_to_master`, and where it can (the CPU, :mod:`mixprec.unscale_copy`), the
        scaler's unscale and inf/NaN check (into ``found``) in the same pass. Returns the ids of the
        tensors in ``param_groups`` whose gradients are done (the scaler leaves them alone; it still
        unscales the others), and whether those were unscaled by exactly 1 (exact upcasts of the model's).
        A subclass that overrides :meth:`copy_grads_to_master` gets that call instead, and the scaler
        unscales every gradient."""
        if type(self).copy_grads_to_master is not MasterWeights.copy_grads_to_master:
            self.copy_grads_to_master()
            return set(), True
        return self._copy_grads((found, inv_scale))

    def _copy_grads(self, unscale: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[set[int], bool]:
        self._check_still_half()
        self._mirror.reset()
        done: set[int] = set()
        exact = True
        for g in self._groups:
            dst, src = g.attach_grads()
            if dst:
                by_one = None if unscale is None else unscale_copy_(dst, src, *unscale)
                if by_one is None:
                    torch._foreach_copy_(dst, src)
                else:  # every gradient of the group's shadow is done: the flat one's holes are zeros
                    done.update(id(t) for t in g.shadow())
                    exact = exact and by_one
                params = [p for p in g.model if p.grad is not None]
                self._mirror.copied += zip(params, dst, src, strict=True)
        self._iteration.grads_copied = True
        return done, exact

    def grads_unscaled(self, exact_upcasts: bool = False) -> None:
        """Called by ``GradScaler.unscale_`` once the master gradients hold their true values: mirror them
        into the model's ``.grad`` (rounded to its dtype), so that what a user's clip reads and edits there
        is the unscaled gradient. ``step`` copies the edited ones back (see Clipping above).
        ``exact_upcasts``: nothing changed the master gradients since they were copied from the model
        (unscaled by exactly 1, bf16's static scale), so the model's ``.grad`` hold them already."""
        if self.mirror_grads:
            adopted = self._adopt_master_only_grads()
            self._mirror.mirror(write=not exact_upcasts or adopted)

    def _adopt_master_only_grads(self) -> bool:
        """Give the model a ``.grad`` for each master gradient it lacks, for the mirror to write: apex-style
        losses one after another (``scale_loss`` twice under O2) add an earlier loss's unscaled gradients to
        the masters after this loss's were copied, and a parameter only the earlier loss reached had none
        in the model (a clip of ``model.parameters()`` left it out: an MoE trial's clip saw norm 3.59 of
        3.94, and the masters came out at 1.91 for a max_norm of 1)."""
        adopted = [pair for g in self._groups for pair in g.grads_without_model_grad()]
        for p, master_grad in adopted:
            p.grad = torch.empty_like(p)  # the mirror writes the master gradient's rounding into it
            self._mirror.copied.append((p, master_grad, p.grad))
        return bool(adopted)

    def scaled_grad_params(self) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` a GradScaler checks and unscales: the masters (and fp32 params), or
        with ``master_grads=False`` the model's half parameters (and fp32 params)."""
        if self._fused_step is None:
            return [p for g in self.param_groups for p in g["params"]]
        return [*self.model_params(), *self.fp32_params()]

    @property
    def non_finite_check(self) -> Callable[[list[torch.Tensor], torch.Tensor], None] | None:
        """How a GradScaler should look for inf/NaN in the half gradients before this optimizer's step
        unscales them itself, where its native CPU check does not run (no compiler): the compiled read-only
        check where the step runs compiled (``compile_step=True`` on the CPU;
        master_kernel.record_non_finite_), else None (torch's own op: on an H200 it took 0.44 ms for the
        GPT's 55 bf16 gradients, the compiled one 1.2 ms)."""
        fused = self._fused_step
        return record_non_finite_ if fused is not None and fused.runs_compiled() else None

    @property
    def keeps_master_grads(self) -> bool:
        """Whether the masters get fp32 gradients (False: the step reads the half gradients itself)."""
        return self._fused_step is None

    def take_grad_edits(self) -> None:
        """Give the master gradients what was edited in the model's ``.grad`` since ``scaler.unscale_``
        mirrored them there (torch.amp's recipe: a clip of ``model.parameters()``), now rather than at the
        step, so that the masters' gradients read before it show the clip. Later edits are taken too."""
        self._mirror.take_edits(keep_watching=True)

    def master_grads_pending(self) -> bool:
        """Whether the model holds gradients its masters have not received yet (they arrive at unscale_ or
        at the step): a clip of :meth:`master_params` now would find no gradient to clip."""
        if not self.keeps_master_grads:
            return False
        fp32 = {id(p) for p in self.fp32_params()}
        masters = [m for m in self.master_params() if id(m) not in fp32]
        return any(p.grad is not None for p in self.model_params()) and all(m.grad is None for m in masters)

    def fp32_params(self) -> list[torch.Tensor]:
        """The model parameters the wrapped optimizer updates as they are (kept in fp32: no master)."""
        shadowed = {id(m) for g in self._groups for m in g.shadow()}
        return [p for g in self.param_groups for p in g["params"] if id(p) not in shadowed]

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the gradients the step reads: the fp32 master gradients
        (norm and scaling in fp32). Call it where torch.amp clips: after ``scaler.unscale_(opt)``.

        With ``master_grads=False`` the step reads the model's half gradients: their norm is taken in fp32
        too (torch's would sum squares in half: up to ~1% off in bf16), and each is scaled in place with one
        rounding to half."""
        if not self._iteration.grads_copied:
            self.copy_grads_to_master()
        self._mirror.take_edits(keep_watching=True)  # a clip of model.parameters() before this one
        params = list(self.scaled_grad_params())
        if not self.keeps_master_grads:
            return clip_half_grads_(params, max_norm, norm_type, error_if_nonfinite)
        total = nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
        # the mirrored model .grad show the clip (a norm logged there reads it), and a clip of them after
        # this one (even of max_norm=inf, a multiply by 1 here) still reaches the step
        self._mirror.remirror()
        return total

    @torch.no_grad()
    def copy_master_to_model(self) -> None:
        """Round the masters to the model's dtype (round-to-nearest-even) and write them into the model."""
        for g in self._groups:
            if g.model:
                torch._foreach_copy_(g.model, g.views)
            g.record_versions()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Masters <- optimizer update from master gradients; then model <- masters.

        Gradients are copied from the model first unless the scaler already did so in this iteration. A
        model parameter written since the last step (``model.load_state_dict`` after wrapping, a DDP
        broadcast, an in-place edit) first gives its master its new value."""
        if _called_by_torch_grad_scaler():
            raise ConfigError(
                "MasterWeights is stepped by torch.amp.GradScaler, which looks for inf/NaN in the "
                "optimizer's parameters, the fp32 masters: they get their gradients only inside step(), so "
                "it found none to check and handed the fused kernel found_inf=0, a number, not a tensor "
                "(with a non-fused optimizer torch stops first: 'No inf checks were recorded').",
                "use mixprec.GradScaler (torch.amp.GradScaler's API; it checks the model's half gradients).",
            )
        self.take_model_edits()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self._iteration.grads_copied = False
        self._region_watch.check(self.model_params())
        if not self._iteration.grads_copied:
            self.copy_grads_to_master()
        self._mirror.take_edits()
        scaling = {a: getattr(self, a) for a in ("grad_scale", "found_inf") if hasattr(self, a)}
        if self._fused_step is not None:
            self._fused_step.step(self._groups, scaling.get("grad_scale"), scaling.get("found_inf"))
            record_step_called(self.optimizer)  # its step() did not run: a scheduler built on it checks
            for g in self._groups:
                g.record_versions()  # the pass wrote the model's half copies
        else:
            self._step_inner(scaling)
        self._iteration.grads_copied = False
        self._mirror.reset()  # holds the model's gradients: let zero_grad free them
        return loss

    def _step_inner(self, scaling: dict[str, Any]) -> None:
        holes = HoleGuard(self._groups, self.state)
        for name, value in scaling.items():  # set by GradScaler for fused optimizers: skip/unscale on device
            setattr(self.optimizer, name, value)
        try:
            self.optimizer.step()
        finally:
            for name in scaling:
                delattr(self.optimizer, name)
        holes.restore()
        self.copy_master_to_model()

    def take_model_edits(self) -> None:
        """Give the masters the model's values where the model was written since the masters last wrote
        it (``model.load_state_dict``, an in-place edit): :meth:`step`, :meth:`state_dict` and
        ``HalfModel.restore`` call it first."""
        for g in self._groups:
            g.take_model_edits()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the model's half parameters and of the masters."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for g in self._groups:
            for p in g.model:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
        self._iteration.grads_copied = False
        self._mirror.reset()

    # ------------------------------------------------------------------ access
    def master_params(self) -> Iterator[torch.Tensor]:
        """The tensors the optimizer updates (fp32 masters, flat buffers, fp32 model params). Clip these."""
        for group in self.param_groups:
            yield from group["params"]

    def master_views(self) -> Iterator[torch.Tensor]:
        """One fp32 master per half model parameter, in the order of :meth:`model_params` (the optimizer's
        parameter groups, not necessarily ``model.parameters()``'s; views into the buffer when flat)."""
        for g in self._groups:
            yield from g.views

    def model_params(self) -> Iterator[torch.Tensor]:
        """The half-precision model parameters that have masters."""
        for g in self._groups:
            yield from g.model

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state (``state``, ``param_groups``: a plain optimizer of the fp32 model
        loads it, as apex O2 checkpoints allowed) plus the fp32 masters, so a resume never rounds through
        half."""
        self.take_model_edits()  # a model loaded since the last step: its values are the masters'
        with self._guard.own():
            inner = self.optimizer.state_dict()
        masters = [v.detach().clone() for v in self.master_views()]
        # "order": each group lists its tensors in the model's order (before 02bb826 the masters came
        # first, then the group's fp32 parameters; load_state_dict renumbers such a checkpoint)
        return {**inner, "masters": masters, "flat": self.flat, "order": "model"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s output; or a plain optimizer's (saved before ``initialize``, as
        apex allowed): its state is loaded and the masters are seeded from the model's current values."""
        views = list(self.master_views())
        inner_state, masters = split_master_state(state_dict, views, self.flat)
        if masters is not None and not self.flat and state_dict.get("order") != "model":
            inner_state = self._from_masters_first(inner_state)
        if _runs_torch_step(self.optimizer):  # torch.optim's update, whose state names mean what they say
            check_state_shapes(inner_state, self.optimizer.param_groups)
        # none for an optimizer of fp32 parameters only (O2's sparse tables): torch's op refuses []
        if masters:
            with torch.no_grad():
                torch._foreach_copy_(views, [m.to(v.device) for m, v in zip(masters, views, strict=True)])
        # torch's load_state_dict restores each group's saved settings, fused/foreach included; keep the
        # implementation this wrapper chose (the scaler relies on it to skip on the device).
        chosen = [(g.get("fused"), g.get("foreach")) for g in self.optimizer.param_groups]
        with self._guard.own():
            self.optimizer.load_state_dict(inner_state)
        if self._fused_step is not None:
            self._fused_step.forget_views()  # let the replaced moments go now
        for group, (fused, foreach) in zip(self.optimizer.param_groups, chosen, strict=True):
            group["fused"], group["foreach"] = fused, foreach
        if masters is None:
            self._seed_from_model()  # an exact upcast of the half weights: all a plain state allows
            warn_reseeded(stacklevel=3)
        else:
            self.copy_master_to_model()

    def __repr__(self) -> str:
        layout = "flat" if self.flat else "per-parameter"
        n = sum(v.numel() for v in self.master_views())
        return f"MasterWeights({layout}, {n:,} fp32 master values,\n  {self.optimizer!r})"


def _check_wrappable(optimizer: torch.optim.Optimizer, model: nn.Module | None) -> None:
    if isinstance(optimizer, MasterWeights):
        raise ConfigError(
            "This optimizer already keeps master weights.", "wrap the plain optimizer once, not twice."
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"MasterWeights wraps a torch.optim.Optimizer, got {type(optimizer).__name__}.",
            "build the optimizer first, e.g. MasterWeights(torch.optim.AdamW(model.parameters())).",
        )
    if _has_stepped(optimizer):
        raise ConfigError(
            "The optimizer already holds state (it has already stepped, or loaded a state_dict): that state "
            "belongs to the parameters it was built with, not to the fp32 masters made now.",
            "wrap the optimizer (or call mixprec.initialize) right after building it, before its first step. "
            "To resume, load the saved optimizer state into the wrapped optimizer afterwards (apex's order: "
            "initialize, then model/optimizer/amp load_state_dict).",
        )
    if model is not None:
        check_params_belong(optimizer, [model])


def _warn_if_nothing_is_half(optimizer: torch.optim.Optimizer) -> None:
    """A wrapper over fp32 parameters only makes no masters: the run is plain fp32, likely not what was
    meant (the model's cast to half forgotten, or the optimizer built before it). Not said where the caller
    passed ``initial=`` (the values it cast the model from): there an optimizer of fp32 parameters alone
    holds what the cast kept fp32 on purpose (BatchNorm; sparse-gradient tables with their SparseAdam)."""
    if not any(p.dtype in HALF_DTYPES for g in optimizer.param_groups for p in g["params"]):
        warnings.warn(
            "MasterWeights: none of the optimizer's parameters is fp16 or bf16, so it keeps no fp32 masters "
            "and the model trains in fp32. Fix: cast the model first (model.to(torch.bfloat16)) and build "
            "the optimizer from its parameters, or drop MasterWeights.",
            UserWarning,
            stacklevel=3,
        )


def _warn_of_frozen_masters(optimizer: torch.optim.Optimizer) -> None:
    """Frozen half parameters the optimizer holds get fp32 masters too (master_storage.py: so that
    unfreezing one later trains it from fp32), 4 bytes per element more than fp32 training, where torch's
    optimizer holds nothing for a parameter that never gets a gradient, and apex makes no master for it.
    A LoRA's frozen base passed as ``model.parameters()`` costs more than the whole fp32 run: say so."""
    frozen = [p for g in optimizer.param_groups for p in g["params"]
              if p.dtype in HALF_DTYPES and not p.requires_grad]
    if frozen:
        n = sum(p.numel() for p in frozen)
        warnings.warn(
            f"MasterWeights: the optimizer holds {len(frozen)} frozen parameters (requires_grad=False, "
            f"{n:,} elements), and each gets an fp32 master, so that unfreezing it later trains it: "
            f"{4 * n:,} bytes that fp32 training would not spend (apex makes none for them). Fix: "
            "build the optimizer over the trainable parameters only, e.g. "
            "torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]), and add a param group "
            "for what you unfreeze later; or ignore this where that later unfreezing is the plan "
            "(warnings.filterwarnings('ignore', 'MasterWeights: the optimizer holds .* frozen')).",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def _has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` holds state from a step. Adagrad makes its state when built (step 0 and the
    initial accumulator), which :func:`_remake_initial_state` makes again for the masters."""
    if type(optimizer) in INITIAL_STATE:
        return any(float(s.get("step", 1)) != 0 for s in optimizer.state.values())  # once, at wrapping
    return len(optimizer.state) > 0


def _runs_torch_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps with torch.optim's own update: a torch optimizer, or a subclass that
    keeps its ``step`` (torch's step wrapper keeps the original's module through functools.wraps)."""
    step = type(optimizer).step
    return getattr(step, "__wrapped__", step).__module__.startswith("torch.optim.")


def _adagrad_state(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor
) -> dict[str, Any]:
    # torch.optim.Adagrad's state: the step count (on the device for the fused kernel) and the accumulator
    # at the constructor's initial_accumulator_value (torch uses it for every group), made here in the
    # master's fp32, not rounded through half
    fused = bool(group.get("fused"))
    step_device = p.device if fused else None
    # the step count's dtype is torch's choice (fp64 under an fp64 default dtype, fp32 for the fused kernel)
    step_dtype = _get_scalar_dtype(is_fused=fused)
    value = optimizer.defaults["initial_accumulator_value"]
    value = complex(value, value) if p.is_complex() else value  # torch's rule for complex parameters
    initial = torch.full_like(p, value, memory_format=torch.preserve_format)
    return {"step": torch.zeros((), dtype=step_dtype, device=step_device), "sum": initial}


# Optimizers that make per-parameter state when built, and how: made again for the tensors they now update.
INITIAL_STATE: dict[type, Callable[[torch.optim.Optimizer, dict[str, Any], torch.Tensor], dict[str, Any]]] = {
    torch.optim.Adagrad: _adagrad_state,
}


def _remake_initial_state(
    optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]] | None = None
) -> None:
    """``groups`` (default: all, whose state made for the half parameters is dropped first) get the state
    their optimizer makes when built, for the tensors they now hold. A group added later gets it at once:
    a flat buffer's member without a gradient in its first step would otherwise start from zero."""
    make = INITIAL_STATE.get(type(optimizer))
    if make is None:
        return
    if groups is None:
        optimizer.state.clear()  # it was made for the half parameters, now replaced by their masters
    for group in optimizer.param_groups if groups is None else groups:
        for p in group["params"]:
            optimizer.state[p] = make(optimizer, group, p)


def check_params_belong(optimizer: torch.optim.Optimizer, models: list[nn.Module], label: str = "") -> None:
    """Raise if ``optimizer`` updates a tensor that is not a parameter of one of ``models`` but has the
    shape of one of theirs: the optimizer of another instance of the model, or of parameters since
    replaced. A parameter of its own shape (SAC's temperature ``log_alpha``, CLIP's ``logit_scale``
    outside the model) is the user's own, as apex took it: it steps as it is (fp32: its own master)."""
    params = [p for m in models for p in m.parameters()]
    owned, shapes = {id(p) for p in params}, {tuple(p.shape) for p in params}
    foreign = [p for g in optimizer.param_groups for p in g["params"]
               if id(p) not in owned and tuple(p.shape) in shapes]
    if foreign:
        raise ParameterMismatchError(
            f"{len(foreign)} of the {label or 'optimizer'}'s parameters (e.g. shape "
            f"{tuple(foreign[0].shape)}) are not parameters of the given model(s), though shaped as theirs.",
            "build the optimizer from the model's parameters (after any model.half()/.to() call); a "
            "parameter of your own of that shape (outside the model): hold it in a module, passed as one of "
            "the models.",
        )
