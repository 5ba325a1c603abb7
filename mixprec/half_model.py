"""A model in half precision: cast it (BatchNorm kept fp32), remember the fp32 values that seed the
masters, cast its inputs to half and its outputs to fp32, run its forward in a precision region, and undo
all of it. ``mixprec.initialize`` (O1-O3) and the Learner's ``MixedPrecision`` callback are each a short
arrangement of :func:`prepare` and :meth:`HalfModel.restore`.

What runs in the forward's region: a half model (O2/O3, ``to_fp16``) runs under
:class:`~mixprec.autocast.half_compute` (its GEMMs computed as a tensor core does, on any device; its
numerically sensitive ops kept in fp32); fp32 weights with a cast policy (O1) run under
:class:`~mixprec.autocast.autocast`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from mixprec.autocast import autocast, half_compute
from mixprec.buffer_writes import watch_buffer_writes
from mixprec.distributed import is_sharded
from mixprec.errors import FP32_MIN_MASK, FP32_MIN_MASK_FIX, ConfigError, listed
from mixprec.fp32_modules import HANDLED_ATTR, is_kept_fp32
from mixprec.func_transforms import values_readable
from mixprec.hardware import HALF_DTYPES
from mixprec.outside_region import mark_prepared
from mixprec.region import in_any_region
from mixprec.tree import cast_floating, iter_tensors
from mixprec.warn_site import user_stacklevel

if TYPE_CHECKING:
    from mixprec.recipe import Recipe

__all__ = [
    "HALF_DTYPES",
    "BATCHNORM",
    "Converted",
    "HalfModel",
    "model_to_half",
    "model_to_float",
    "fp32_originals",
    "hook_fp32_roots",
    "internal_copies",
    "prepare",
    "warn_if_inputs_lost",
]

# The dtypes that get an fp32 master (hardware.HALF_DTYPES). Everything else floating (fp32, fp64) is
# updated in place.

# Kept fp32 when a model is cast to half (apex O2's keep_batchnorm_fp32).
BATCHNORM = (nn.modules.batchnorm._BatchNorm,)

# Embeddings that may make sparse gradients (``sparse=True``): always kept fp32 (below).
EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def keeps_sparse_grads(module: nn.Module) -> bool:
    """An embedding built with ``sparse=True``: kept fp32 in a half model. Its gradient holds only the rows
    a batch looked up, and fp32 masters are dense (a dense master gradient would cost as much as the table);
    in fp32 the table is its own master (4 bytes per weight, fewer than half + master's 6), its sparse
    gradient goes to the optimizer as it came (torch.optim.SparseAdam), and a lookup reads the rows exactly;
    the GEMMs after it round them to half as they would any fp32 input."""
    return isinstance(module, EMBEDDINGS) and bool(getattr(module, "sparse", False))


# Why a cast to half leaves a module's tensors fp32, strongest first (a module inside a kept one is kept with
# it): keep_fp32 marked it (a hand-written RMSNorm, whose rsqrt backward, 0.5 * rsqrt(x)**3, overflows fp16
# where x is small); an embedding with sparse gradients (no dense master); BatchNorm (keep_batchnorm_fp32).
MARKED, SPARSE, BATCHNORM_KEPT = "marked with mixprec.keep_fp32", "sparse", "batchnorm"


def _kept_why(module: nn.Module, keep_bn_fp32: bool) -> str | None:
    if is_kept_fp32(module):
        return MARKED
    if keeps_sparse_grads(module):
        return SPARSE
    return BATCHNORM_KEPT if keep_bn_fp32 and isinstance(module, BATCHNORM) else None


def fp32_roots(model: nn.Module, keep_bn_fp32: bool = True) -> list[tuple[nn.Module, str]]:
    """The outermost modules whose tensors a cast to half leaves fp32, each with why (MARKED, SPARSE or
    BATCHNORM_KEPT); everything inside one stays fp32 with it."""
    roots: list[tuple[nn.Module, str]] = []
    inside: set[int] = set()
    for m in model.modules():  # parents before children
        why = None if id(m) in inside else _kept_why(m, keep_bn_fp32)
        if why is not None:
            roots.append((m, why))
            inside.update(id(i) for i in m.modules())
    return roots


def fp32_kept(model: nn.Module, keep_bn_fp32: bool = True) -> set[int]:
    """The ids of every module whose own tensors a cast to half leaves fp32 (:func:`fp32_roots` and all
    inside them)."""
    return {id(i) for m, _ in fp32_roots(model, keep_bn_fp32) for i in m.modules()}


@dataclass(frozen=True)
class Converted:
    """One tensor :func:`model_to_half` turned to half precision, and how to turn it back."""

    module: nn.Module
    name: str
    is_param: bool
    dtype: torch.dtype  # its dtype before
    # its value before (a parameter's old storage: no copy was made); None once released (HalfModel:
    # after the masters are seeded from it, since it is 4 bytes per parameter held for the model's life)
    before: torch.Tensor | None
    # model_to_float gives back `before` where the tensor still holds its rounding (nothing changed it):
    # set for what HalfModel.release_originals keeps; else the tensor goes back as its half value
    restore_before: bool = False
    qualname: str = ""  # its name in the model's state dict ("" where not known)


def model_to_half(model: nn.Module, dtype: torch.dtype, keep_bn_fp32: bool = True) -> list[Converted]:
    """Cast the model's floating parameters and buffers to ``dtype`` in place (the Parameter objects stay
    the same, so an optimizer built over them still holds them), except those of :func:`fp32_kept`:
    BatchNorm's when ``keep_bn_fp32``, sparse-gradient embeddings', and keep_fp32 modules'.

    BatchNorm stays fp32 because its batch statistics are reductions over many values (a variance in fp16
    loses most of its bits) and its affine parameters are few: fp32 costs nothing there. Returns what was
    converted: to undo it, and to seed fp32 masters from the values before rounding (:func:`fp32_originals`).
    """
    converted, kept = [], fp32_kept(model, keep_bn_fp32)
    with torch.no_grad():
        for prefix, module in model.named_modules():
            if id(module) in kept:
                continue
            dotted = prefix + "." if prefix else ""
            for name, param in module.named_parameters(recurse=False):
                if param.is_floating_point() and param.dtype != dtype:
                    converted.append(Converted(module, name, True, param.dtype, param.detach(),
                                               qualname=dotted + name))
                    param.data = param.data.to(dtype)
                    param.grad = None
            for name, buf in module.named_buffers(recurse=False):
                if buf.is_floating_point() and buf.dtype != dtype:
                    converted.append(Converted(module, name, False, buf.dtype, buf, qualname=dotted + name))
                    setattr(module, name, buf.to(dtype))
    return converted


def fp32_originals(converted: list[Converted]) -> dict[torch.Tensor, torch.Tensor]:
    """Each converted parameter's value before the cast: ``MasterWeights(..., initial=...)``."""
    return {getattr(c.module, c.name): c.before for c in converted if c.is_param and c.before is not None}


def model_to_float(converted: list[Converted], values: dict[int, torch.Tensor] | None = None) -> None:
    """Undo :func:`model_to_half`. A parameter whose id is in ``values`` (its fp32 master) takes that
    value rather than its rounded half value, so leaving mixed precision loses nothing the optimizer
    accumulated."""
    values = values or {}
    with torch.no_grad():
        for c in converted:
            tensor = getattr(c.module, c.name)
            if c.is_param:
                source = values.get(id(tensor), _kept_original(c, tensor))
                tensor.data = source.detach().to(tensor.device, c.dtype, copy=True)
                tensor.grad = None
            else:
                setattr(c.module, c.name, _kept_original(c, tensor).to(tensor.device, c.dtype))


def state_to_float(model: nn.Module, dtype: torch.dtype, keep: Collection[tuple[int, str]] = ()) -> None:
    """Cast back to fp32 the ``dtype`` tensors a half forward left in the model's plain attributes, alone or
    in tuples and lists (an RNN's hidden state carried between batches, a cache): the fp32 model's next
    forward would meet them in half precision, and an LSTM's oneDNN kernel then fails with "could not create
    a primitive descriptor". Exact: every half value is an fp32 value. Parameters, buffers and submodules
    are not plain attributes; a dict or an object holding tensors is left alone (it may be shared). Buffers
    still ``dtype`` once the cast ones are restored were registered after the cast (a KV cache set up in
    the half model's dtype during training, a trial's generation): fp32 too, as the model now is, except
    those of ``keep`` (``(id(module), name)``: buffers the model held in ``dtype`` before it was cast, which
    go back as they were)."""
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.dtype == dtype and (id(module), name) not in keep:
                module._buffers[name] = buffer.float()
        for name, value in list(vars(module).items()):
            if isinstance(value, nn.Parameter) or not isinstance(value, (torch.Tensor, tuple, list)):
                continue
            if any(t.dtype == dtype for t in iter_tensors(value)):
                setattr(module, name, cast_floating(value, torch.float32, only=(dtype,)))


def _kept_original(c: Converted, now: torch.Tensor) -> torch.Tensor:
    """The value a tensor goes back to without a master: its kept original where ``now`` is still exactly
    that original's rounding (nothing trained or changed it: a frozen parameter, a constant buffer), else
    ``now`` (rounded, or what training made of it)."""
    before = c.before
    if before is None or not c.restore_before or before.shape != now.shape:
        return now
    # the original rounded as model_to_half rounded it (to `now`'s dtype), compared bit for bit
    return before if torch.equal(before.to(now.device, now.dtype), now) else now


class CastInputs:
    """A forward pre-hook casting the floating inputs to ``dtype``. An object, not a lambda: a prepared
    model pickles (``torch.save(model)``)."""

    def __init__(
        self, dtype: torch.dtype, probe: tuple[nn.Module, str] | None = None, cast: bool = True
    ) -> None:
        self.dtype = dtype
        self.checked = False  # the first call's inputs were looked at (warn_if_inputs_lost)
        # (module, name) of one parameter the cast made ``dtype``: a forward finding it another dtype (the
        # user's model.float()) is refused, where half inputs would silently meet fp32 weights
        self.probe = probe
        self.cast = cast  # False (Recipe.cast_inputs): the probe's check only, the inputs left as given

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        probe = getattr(self, "probe", None)  # (a model pickled before the attribute existed has none)
        if probe is not None and not torch.compiler.is_compiling():
            weight = probe[0]._parameters.get(probe[1])
            if weight is not None and weight.dtype is not self.dtype:
                _refuse_recast(weight.dtype, self.dtype)
        if not getattr(self, "cast", True):
            return None
        cast = cast_floating((args, kwargs), self.dtype)
        if not getattr(self, "checked", True) and values_readable():  # once, where values can be read
            self.checked = True  # once: it reads every floating input
            warn_if_inputs_lost(tree_leaves((args, kwargs)), tree_leaves(cast), self.dtype)
        return cast


def _refuse_recast(now: torch.dtype, cast_to: torch.dtype) -> None:
    name, now_name = str(cast_to).removeprefix("torch."), str(now).removeprefix("torch.")
    raise ConfigError(
        f"the model's parameters are {now_name} now (model.float()? .to()?), but its forward still casts "
        f"inputs to {name}, as initialize set it up: the {name} inputs would meet {now_name} weights (apex's "
        "patched forward failed there with a dtype mismatch)",
        "for an fp32 model (export, fp32 evaluation) call mixprec.amp.restore(model), which also removes the "
        f"input cast and gives parameters their fp32 masters' values; to go on training, leave the "
        f"parameters {name} (the optimizer's fp32 masters update them)",
    )


# no_grad: the checks' own ops (isfinite's abs, round) would otherwise be recorded, each saving a copy of an
# input that requires grad or of a kept module's output (the measured memory breakdown counted one: 512 KiB
# more than the estimate, which reads no values)
@torch.no_grad()
def warn_if_inputs_lost(before: list[Any], after: list[Any], dtype: torch.dtype) -> None:
    """Say so where the input cast lost what a floating input meant: finite values that became inf (an
    additive mask filled with fp32's finfo.min: -inf in half), or whole numbers rounded (a diffusion
    model's timesteps: bf16 holds integers exactly only up to 256, so 998 and 999 both became 1000,
    silently, in a user trial; positions, counts). apex cast inputs too, but only to fp16 (exact to 2048)."""
    name = str(dtype).removeprefix("torch.")
    for i, (t, c) in enumerate(zip(before, after, strict=True)):
        if not isinstance(t, torch.Tensor) or t is c or t.dtype is not torch.float32:
            continue
        if t.is_meta or is_fake(t):  # no values to read (the memory estimate's fake tensors)
            continue
        back = c.to(t.dtype)
        overflow = _first_overflow(t, back)
        if overflow is not None:
            problem = f"holds {overflow[0]:g}, beyond {name}'s range: the cast made it {overflow[1]:g}"
            data = ("scale the values into range, or leave the inputs as given (initialize(..., "
                    "cast_model_inputs=False), to_fp16(cast_inputs=False)) and normalize them in a module "
                    "marked mixprec.keep_fp32")
            # an additive mask (zeros and a huge negative fill) gets the mask's fix first, data the other
            mask = bool(((t == 0) | (t <= -torch.finfo(dtype).max)).all())
            fix = (f"{FP32_MIN_MASK_FIX} ({FP32_MIN_MASK}); if it is not a mask, {data}" if mask
                   else f"{data}; if it is an additive mask, {FP32_MIN_MASK_FIX}")
        elif torch.equal(t, t.round()) and not torch.equal(back, t):
            where = tuple((back != t).nonzero()[0])
            problem = (f"holds whole numbers (timesteps? positions?) that the cast rounds: "
                       f"{t[where].item():g} became {back[where].item():g}")
            fix = ("pass them as an integer tensor (the input cast leaves those alone) and convert inside "
                   "forward, e.g. `t.float()` before the embedding")
        else:
            continue
        warnings.warn(f"The model's input {i} {problem}. Fix: {fix}.", UserWarning,
                      stacklevel=user_stacklevel())
        return


class _Flag:
    """A module attribute (fp32_modules.HANDLED_ATTR) set while the model is prepared, taken off with the
    hooks (restore), so an fp32 model run later by hand under half_compute is warned about again."""

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module, self.name = module, name
        object.__setattr__(module, name, True)

    def remove(self) -> None:
        self.module.__dict__.pop(self.name, None)


class CastOutputs:
    """Casts a forward's floating outputs: to fp32, the half ones (the loss and its reductions need fp32;
    fp64 outputs stay) unless ``every``; to another dtype, every floating one (apex's
    ``cast_model_outputs``)."""

    def __init__(self, dtype: torch.dtype, every: bool = False) -> None:
        self.dtype = dtype
        self.only = HALF_DTYPES if dtype == torch.float32 and not every else None

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        return cast_floating(output, self.dtype, only=self.only, dataclasses=True)  # an output record too


class CastKeptOutputs(CastOutputs):
    """A keep_fp32 module's output hook: its fp32 outputs back to the model's half dtype, and once, where that
    cast made finite values inf, a warning naming the module (a forecaster's kept de-normalizer returned
    ~1e6, inf in fp16: every step was skipped with nothing pointing at it)."""

    # Calls checked: the first few, so a module called several times in a forward (RevIN's norm, then
    # denorm) is seen in each role, without a read of the device per call for good.
    CHECKS = 8

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__(dtype)
        self.checks_left = self.CHECKS

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        cast = super().__call__(module, args, output)
        if getattr(self, "checks_left", 0) > 0 and values_readable():
            self.checks_left -= 1
            if _warn_if_kept_output_overflows(module, tree_leaves(output), tree_leaves(cast), self.dtype):
                self.checks_left = 0  # said once
        return cast


def _first_overflow(before: torch.Tensor, cast: torch.Tensor) -> tuple[float, float] | None:
    """(a value of ``before``, what ``cast`` made of it) where a finite value became inf in the cast; None
    where none did. One read of the device (the inputs' and kept outputs' checks, both few)."""
    overflowed = cast.isinf() & before.isfinite()
    if not overflowed.any():
        return None
    where = tuple(overflowed.nonzero()[0])
    return before[where].item(), cast[where].item()


@torch.no_grad()  # as warn_if_inputs_lost
def _warn_if_kept_output_overflows(module: nn.Module, before: list[Any], after: list[Any],
                                   dtype: torch.dtype) -> bool:
    for t, c in zip(before, after, strict=True):
        if not isinstance(t, torch.Tensor) or t is c or t.is_meta or is_fake(t):
            continue
        overflow = _first_overflow(t, c)
        if overflow is not None:
            name = str(dtype).removeprefix("torch.")
            warnings.warn(
                f"mixprec.keep_fp32: this {type(module).__name__} returned {overflow[0]:g}, beyond {name}'s "
                f"range, and its output is cast to the model's {name} as it leaves it: the cast made it inf. "
                "Fix: scale its output into range, or keep what reads it fp32 too (mark the module that "
                "encloses both, or compute the rest from .float() tensors).",
                UserWarning, stacklevel=user_stacklevel(),
            )
            return True
    return False


def _fp32_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """apex O2's state_dict hook: the module's own half tensors are saved as fp32, so a checkpoint of a
    half model loads into an fp32 one (and back: load_state_dict copies across dtypes)."""
    for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
        key = prefix + name
        if tensor is not None and tensor.dtype in HALF_DTYPES and key in state_dict:
            state_dict[key] = state_dict[key].float()


def _share_tied(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """Names of one tied tensor get one entry again (see :func:`share_tied_entries`)."""
    owner = prefix[:-1]  # named_parameters adds the separator itself
    first: dict[int, str] = {}
    for name, t in [*module.named_parameters(owner, remove_duplicate=False),
                    *module.named_buffers(owner, remove_duplicate=False)]:
        if name in state_dict:
            kept = first.setdefault(id(t), name)
            if kept != name:
                state_dict[name] = state_dict[kept]


def share_tied_entries(model: nn.Module) -> list[RemovableHandle]:
    """State-dict hooks (register them after every hook that rewrites entries: hooks run in registration
    order) that give names of one tied tensor one entry again. The per-module hooks above upcast each
    name's half tensor on its own, so a tied embedding was saved as two fp32 tensors (a user trial: 16,384 x
    4 bytes more per checkpoint, and tools that find ties by shared storage found none). One hook on the
    innermost module holding every name of a tie, so ``model.part.state_dict()`` shares them too. Module-level
    functions: a prepared model pickles whole (``torch.save(model)``)."""
    names: dict[int, list[str]] = {}
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in tensors:
        names.setdefault(id(t), []).append(name)
    owners = set()
    for tied in (n for n in names.values() if len(n) > 1):
        paths = [name.split(".")[:-1] for name in tied]  # each name's module path
        shortest = min(map(len, paths))
        common = next((i for i in range(shortest) if len({p[i] for p in paths}) > 1), shortest)
        owners.add(".".join(paths[0][:common]))
    return [model.get_submodule(owner)._register_state_dict_hook(_share_tied) for owner in sorted(owners)]


_REGION_ATTR = "_mixprec_region"
MakeRegion = Callable[[], contextlib.AbstractContextManager[Any]]  # enters a fresh region each call


def _forward_in_region(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The model's own forward inside its precision region, as a ``with`` block: torch.compile traces a
    region entered this way into one graph (a region entered in a pre-hook and left in a post-hook made
    AOTAutograd refuse graphs whose ops switch autocast off, e.g. an fp32 loss inside forward)."""
    make, inner = getattr(self, _REGION_ATTR)
    if torch.compiler.is_compiling():
        # contexts Dynamo can resume after a graph break in the forward (a loss computed by a library
        # function, a print): around the region object itself it ran the rest of the forward outside it
        outer, mode = make().compiled_contexts()
        with outer, mode:
            return inner(*args, **kwargs)
    with make():
        return inner(*args, **kwargs)


class _ModelForward(functools.partial):
    """``model.forward`` of a prepared model: :func:`_forward_in_region` bound to it. A partial, not a bound
    method, so that the model pickles: pickle stores a bound method as a lookup of its name, which on
    loading finds the class's forward, not this one. ``copy.deepcopy`` rebinds it to the copy."""

    __name__ = "forward"

    @property
    def __self__(self) -> nn.Module:  # as a bound method's: the model
        return self.args[0]

    @property
    def __func__(self) -> Any:  # as a bound method's: what __self__ is passed to (Dynamo reads the pair)
        return self.func

    @property
    def __wrapped__(self) -> Any:
        """The forward the region wraps: ``inspect.signature(model.forward)`` follows it and shows the
        model's own parameters (Hugging Face's Trainer reads them to drop unused dataset columns)."""
        return getattr(self.args[0], _REGION_ATTR)[1]

    def __reduce__(self) -> tuple[Any, ...]:
        return _forward_after_load, (self.args[0],)

    def __deepcopy__(self, memo: dict[int, Any]) -> _ModelForward:
        _warn_of_a_half_copy(self.args[0])
        # the copy's submodules keep their wrapped forwards (deepcopy rebinds bound methods): no re-wrap
        return _ModelForward(self.func, copy.deepcopy(self.args[0], memo))


HALF_COPY_WARNING = (
    "copy.deepcopy of a half model (O2, O3, to_fp16()/to_bf16()): the copy holds its {dtype} weights, not "
    "fp32 masters, and its state_dict() gives fp32 copies of them (apex's rule), not the tensors "
    "themselves. An EMA updated in place through the copy's state_dict() (timm's ModelEmaV2) never moves; "
    "one updated through its parameters() (lerp_, AveragedModel) averages in {dtype} and rounds most "
    "updates away; a best-model snapshot keeps the rounded weights. Keep an EMA or a snapshot in fp32, of "
    "the masters where the optimizer keeps them: docs/recipes.md, 'An exponential moving average (EMA) of "
    "a half model' (O3 keeps none: average its weights into an fp32 model). (To evaluate the copy or "
    "train it on its own, this does not matter.)"
)


_QUIET_COPIES = threading.local()  # mixprec's own copies (a diagnostic's fp32 re-run): not the user's EMA


@contextlib.contextmanager
def internal_copies() -> Any:
    """Within it, deep copies of half models are mixprec's own (the overflow tracer's fp32 re-run, the
    memory breakdown's model copy), and :func:`_warn_of_a_half_copy` says nothing of EMAs."""
    outer = getattr(_QUIET_COPIES, "on", False)
    _QUIET_COPIES.on = True
    try:
        yield
    finally:
        _QUIET_COPIES.on = outer


def _warn_of_a_half_copy(model: nn.Module) -> None:
    """Warn where a half model is deep-copied: the EMA and snapshot patterns that copy a model fail on it
    silently (an EMA through state_dict() never moves: its values are fp32 copies, not the weights)."""
    if getattr(_QUIET_COPIES, "on", False):
        return
    dtype = next((p.dtype for p in model.parameters() if p.dtype in HALF_DTYPES), None)
    if dtype is not None:
        warnings.warn(HALF_COPY_WARNING.format(dtype=str(dtype).removeprefix("torch.")),
                      stacklevel=user_stacklevel())


def _forward_after_load(model: nn.Module) -> _ModelForward:
    """What an unpickled model's ``forward`` is rebuilt as: its first call wraps the submodules again
    (pickle stored theirs as their class's forward, see :func:`_submodule_forward`), then it is the
    model's ordinary forward."""
    return _ModelForward(_first_forward_after_load, model)


def _first_forward_after_load(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if torch.compiler.is_compiling():  # compiled code traces a recompute itself; wrap at the first eager call
        return _forward_in_region(self, *args, **kwargs)
    make = getattr(self, _REGION_ATTR)[0]
    records = [m.__dict__[_BLOCK_ATTR] for m in self.modules() if _BLOCK_ATTR in m.__dict__]
    if records:  # the submodules were wrapped: again, of the same kind
        _SubmoduleForwards(self, make, half_model=records[0][2])
    self.__dict__["forward"] = _ModelForward(_region_forward(type(self)), self)
    return _forward_in_region(self, *args, **kwargs)


# on a prepared model's submodule: (make the region, the forward as it was, whether the model is half,
# whether the class's forward is a plain function)
_BLOCK_ATTR = "_mixprec_block"


def _skip_frame(code: types.CodeType) -> None:
    """Dynamo runs ``code``'s frames as they are, never compiled as frames of their own (it still inlines
    the function into a traced caller, and compiles the frames it calls)."""
    skip = getattr(torch._dynamo.eval_frame, "skip_code", None)
    if skip is not None:
        skip(code)


def _submodule_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A half model's submodule's ``forward``: the module's own, inside the model's region when it runs
    outside every region. That is a checkpoint's recompute: ``torch.utils.checkpoint`` (either kind,
    Hugging Face's ``gradient_checkpointing_enable`` too) re-runs a block during backward after the model's
    region has closed, and restores torch's autocast state but not mixprec's. Without this the recompute
    ran the half model's layer norms and softmax in half, not in fp32: other gradients (reentrant) or
    torch's CheckpointError (non-reentrant). Inside the model's forward (or a recompute that re-entered the
    regions, :func:`mixprec.checkpoint_context`) it only calls the forward; compiled code traces the
    recompute itself.

    An O1 model's submodules (fp32 weights) re-enter only while autograd runs a backward, i.e. in a
    recompute (or a backward hook that calls one): called outside the forward otherwise (a model's
    ``encode_image``), they run in fp32 as an fp32 model's would. Its recompute needs the region where the
    region has a Python layer (emulated half GEMMs, a custom policy): torch restores only its own
    autocast state.

    A ``with`` block, so an interrupt (Ctrl-C in a notebook) still leaves the region; one function per
    module class (:func:`_block_forward`), so torch.compile of each block separately shares one graph (an
    object per module was a guard that failed from block to block); the module's own forward pre-hooks run
    before it, outside the region."""
    make, own, half_model, plain = self.__dict__[_BLOCK_ATTR]
    # The forward is called from this frame, not from a helper's: after a graph break in it, Dynamo compiles
    # the caller from eager code as a frame of its own, and a helper's one code object for all classes
    # recompiled per class (this function's code is a copy per class, :func:`_block_forward`).
    forward = own if own is not None else _class_forward(self, plain)
    if torch.compiler.is_compiling() or in_any_region():
        return forward(*args, **kwargs)
    if not half_model and torch._C._current_graph_task_id() == -1:  # O1, not in a backward: fp32
        return forward(*args, **kwargs)
    with make():
        return forward(*args, **kwargs)


def _class_forward(module: nn.Module, plain: bool) -> Callable[..., Any]:
    # A plain class forward is bound with a partial, not as a bound method made here: at a graph break
    # Dynamo rebuilt a bound method as ``module.forward``, the wrapper, which called itself forever. Any
    # other kind (a classmethod, a descriptor) is bound by its own __get__, as attribute lookup would.
    cls = type(module)
    if plain:
        return functools.partial(cls.forward, module)
    return inspect.getattr_static(cls, "forward").__get__(module, cls)  # type: ignore[no-any-return]


_skip_frame(_class_forward.__code__)  # called from the wrapper's frame, which Dynamo skips: per class


def _plain_forward(module: nn.Module) -> bool:
    return isinstance(inspect.getattr_static(type(module), "forward", None), types.FunctionType)


# One forward per class: _submodule_forward's code in a function object whose __signature__ is the class's
# forward's, so inspect.signature shows the block's own parameters (Hugging Face reads them: a PEFT model's
# Trainer to keep dataset columns, generate() to check keyword arguments). Per class, not per module:
# blocks of one class share it, and torch.compile of each block shares one graph. Keyed weakly, and
# holding no reference to the class (a forward that calls super() would, through its __class__ cell): a
# class made per instance is freed with its instances. Made again when the class's forward is replaced.
# After a graph break inside a compiled model, Dynamo compiles each forward called from eager code as a
# frame of its own, and keeps compiled frames per code object: one code object for all classes made each
# class a recompile of it, until recompile_limit (8) sent the rest of the model to eager code with a
# warning into mixprec (a seq2seq model's first step: 146 s). So the wrapper is never compiled as a frame
# of its own (Dynamo still inlines it into a traced caller, and compiles the forward it calls as it would
# without mixprec: a user's block compiled, torch's nn modules left to eager code, as in an fp32 model),
# and its code is a copy per class (where torch cannot skip a frame, compiled frames stay per class).
_BLOCK_FORWARDS: weakref.WeakKeyDictionary[type, Callable[..., Any]] = weakref.WeakKeyDictionary()


def _block_forward(cls: type) -> Callable[..., Any]:
    raw = inspect.getattr_static(cls, "forward", None)
    fn = _BLOCK_FORWARDS.get(cls)
    if fn is None or fn._mixprec_block != id(raw):  # type: ignore[attr-defined]
        # named "forward": pickle stores a module's bound method as a lookup of this name
        fn = _copy_for(_submodule_forward, cls, "forward")
        _skip_frame(fn.__code__)  # Dynamo never compiles it as a frame of its own (see above)
        if isinstance(raw, types.FunctionType):  # (self, ...): a bound method's signature drops self
            fn.__signature__ = inspect.signature(raw)  # type: ignore[attr-defined]
        fn._mixprec_block = id(raw)  # type: ignore[attr-defined]  # marks it; the forward it was made for
        _BLOCK_FORWARDS[cls] = fn
    return fn


def _copy_for(fn: Callable[..., Any], cls: type, name: str) -> Callable[..., Any]:
    """``fn`` as a function of its own code object for ``cls``: Dynamo keeps compiled frames (and counts
    recompiles against recompile_limit) per code object, and an fp32 model's forwards are one per class."""
    code = fn.__code__
    # replace() always makes a new code object; named for the class where Python has qualified names
    if hasattr(code, "co_qualname"):  # Python >= 3.11
        code = code.replace(co_qualname=f"{cls.__qualname__}.forward")
    else:
        code = code.replace()
    copy = types.FunctionType(code, fn.__globals__, name)
    copy.__doc__ = fn.__doc__
    return copy


# A prepared model's forward per class, as the blocks' (_block_forward): all models' forwards were one code
# object, so four compiled models, each called with and without a gradient-requiring input and under
# no_grad, were 12 entries of it, past recompile_limit (8), where fp32 models of four classes make 3 each.
_REGION_FORWARDS: weakref.WeakKeyDictionary[type, Callable[..., Any]] = weakref.WeakKeyDictionary()


def _region_forward(cls: type) -> Callable[..., Any]:
    fn = _REGION_FORWARDS.get(cls)
    if fn is None:
        fn = _REGION_FORWARDS[cls] = _copy_for(_forward_in_region, cls, "_forward_in_region")
    return fn


class _SubmoduleForwards:
    """Wraps a model's submodules' forwards in :func:`_submodule_forward`, and takes them out: a handle."""

    def __init__(self, model: nn.Module, make: MakeRegion, half_model: bool) -> None:
        # a submodule another prepare already wrapped (shared by two models) or made a model of its own
        # (prepared before its parent) keeps that: it is in a region either way
        # containers without a forward (ModuleList, ModuleDict) are never called
        # a TorchScript module runs no Python forward to wrap (and answers no __dict__ questions)
        subs = [m for m in model.modules() if m is not model and not isinstance(m, torch.jit.ScriptModule)]
        self.wrapped = [m for m in subs if not _is_wrapped(m) and _has_forward(m)]
        for m in self.wrapped:
            # the instance's own forward (a patch, torch.compile's) if it had one, else None: the class's is
            # looked up per call, so the module pickles and follows a later patch of its class
            m.__dict__[_BLOCK_ATTR] = (make, _own_forward(m), half_model, _plain_forward(m))
            m.__dict__["forward"] = types.MethodType(_block_forward(type(m)), m)
            if isinstance(m, _REPRS_EVERY_ATTRIBUTE):
                m.__dict__["extra_repr"] = _ExtraReprOnce(m)

    def remove(self) -> None:
        for m in self.wrapped:
            if not _has_block_forward(m):
                continue  # replaced since (a library's hook around it): theirs stays, and what it calls
            own = m.__dict__.pop(_BLOCK_ATTR)[1]
            if isinstance(m.__dict__.get("extra_repr"), _ExtraReprOnce):
                del m.__dict__["extra_repr"]
            if own is None:
                m.__dict__.pop("forward")  # the class's own forward again
            else:
                m.__dict__["forward"] = own


# Modules whose extra_repr calls repr() on every attribute (EmbeddingBag's): the wrapped forward is a method
# bound to the module, whose repr is the module's, so repr(model) recursed until RecursionError.
_REPRS_EVERY_ATTRIBUTE = (nn.EmbeddingBag,)
_IN_REPR = threading.local()


class _ExtraReprOnce:
    """The module's class's extra_repr, answering "..." when asked again from inside itself (a bound
    method's repr): those inner answers are made and dropped, as the class's format string names none of
    them. An object, not a bound method: a module holding it pickles and deep-copies."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self) -> str:
        active: set[int] = _IN_REPR.__dict__.setdefault("ids", set())
        if id(self.module) in active:
            return "..."
        active.add(id(self.module))
        try:
            return type(self.module).extra_repr(self.module)
        finally:
            active.discard(id(self.module))

    def __repr__(self) -> str:
        return f"<extra_repr of a {type(self.module).__name__}>"


def _has_block_forward(module: nn.Module) -> bool:
    return hasattr(getattr(module.__dict__.get("forward"), "__func__", None), "_mixprec_block")


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward or "forward" in module.__dict__


def _own_forward(module: nn.Module) -> Any:
    """The forward the instance holds of its own, if any: not the class's bound to it (what an unpickled
    module holds, pickle having looked ``forward`` up by name)."""
    own = module.__dict__.get("forward")
    return None if getattr(own, "__func__", None) is type(module).forward else own


def _is_wrapped(module: nn.Module) -> bool:
    """Already in a region: a model's own forward, or a block's, perhaps under a library's hook put on
    since. An unpickled block comes back with its class's forward and a stale record: not wrapped."""
    if _REGION_ATTR in module.__dict__:
        return True
    return _BLOCK_ATTR in module.__dict__ and _own_forward(module) is not None


class _RegionForward:
    """Puts the model's forward inside the region (:class:`_ModelForward` on the instance, which
    ``copy.deepcopy`` and pickle rebind to the copy) and takes it out again: a handle like the hooks'."""

    def __init__(self, model: nn.Module, make: MakeRegion) -> None:
        self.model = model
        # what the instance had: a forward of its own (torch.compile's), or the wrapper of an earlier prepare
        self.own = model.__dict__.get("forward")
        self.own_region = model.__dict__.get(_REGION_ATTR)
        # the forward as it was (under an earlier wrapper, the one that wrapper calls): a bound method, which
        # deepcopy rebinds to the copy and pickle to the class's forward. Into the instance's own
        # __dict__: setattr on torch.compile's OptimizedModule sets the attribute on the module it wraps.
        inner = self.own_region[1] if self.own_region is not None else model.forward
        model.__dict__[_REGION_ATTR] = (make, inner)
        model.forward = _ModelForward(_region_forward(type(model)), model)  # type: ignore[method-assign]

    def remove(self) -> None:
        for name, value in (("forward", self.own), (_REGION_ATTR, self.own_region)):
            if value is None:
                self.model.__dict__.pop(name, None)
            else:
                self.model.__dict__[name] = value


def region_factory(recipe: Recipe, device_type: str) -> MakeRegion:
    """What enters ``recipe``'s region, anew on each call: half_compute for a half model, else autocast
    under the recipe's policy (diagnostics.memory counts a step in the same region)."""
    dtype = recipe.half_dtype
    assert dtype is not None  # only half recipes have a region
    if recipe.casts_model:
        return functools.partial(half_compute, device_type, dtype)  # a partial pickles, a lambda does not
    return functools.partial(autocast, device_type, dtype=dtype, policy=recipe.policy)


@dataclass
class HalfModel:
    """What :func:`prepare` did to a model, so that it can be undone."""

    model: nn.Module
    recipe: Recipe
    converted: list[Converted] = field(default_factory=list)
    handles: list[RemovableHandle] = field(default_factory=list)
    # (id(module), name) of the buffers already in the half dtype before the cast: restore leaves them so
    half_before: frozenset[tuple[int, str]] = frozenset()

    def fp32_originals(self) -> dict[torch.Tensor, torch.Tensor]:
        """The fp32 values of the cast parameters: masters are seeded from these, not their rounding."""
        return fp32_originals(self.converted)

    def release_originals(self, keep_untrained: Collection[torch.Tensor] | None = None,
                          keep_buffers: bool = False) -> None:
        """Let go of the values the model was cast from: once the fp32 masters are seeded from them (or
        when none will be), they would hold a second fp32 copy of every weight for the model's life.

        ``keep_untrained`` (the parameters that have masters): the originals of the other parameters
        (frozen, or held by no optimizer) and of the buffers are kept instead, copied to the CPU, so that
        :meth:`restore` gives them back exactly where nothing changed them (the Learner: a fit's end leaves
        a frozen backbone as it was, not rounded to the half dtype). Host memory: 4 bytes per such value.
        ``keep_buffers``: the buffers' originals alone (few values: RoPE's inv_freq). Meta tensors hold no
        values to keep."""
        trained = None if keep_untrained is None else {id(t) for t in keep_untrained}

        def kept(c: Converted) -> bool:
            if c.before is None or c.before.is_meta:
                return False
            if keep_buffers and not c.is_param:
                return True
            return trained is not None and id(getattr(c.module, c.name)) not in trained

        # on the CPU this keeps the original's own storage (no copy); from a GPU it copies to the host
        self.converted = [
            replace(c, before=c.before.to("cpu"), restore_before=True) if kept(c)
            else replace(c, before=None)
            for c in self.converted
        ]

    def restore(self, *masters: Any, values: Mapping[int, torch.Tensor] | None = None) -> None:
        """Remove the hooks and cast the model back; parameters take their fp32 master's value when one
        of ``masters`` (:class:`~mixprec.master.MasterWeights`) holds one, or ``values`` (by the
        parameter's id: split masters' fp32 values)."""
        self.check_parameters_kept()
        for handle in self.handles:
            handle.remove()
        held = [m for m in masters if m is not None]
        for m in held:
            m.take_model_edits()  # a model loaded since the last step (the best epoch's weights)
        found = {id(p): v for m in held for p, v in zip(m.model_params(), m.master_views(), strict=True)}
        model_to_float(self.converted, {**found, **(values or {})})
        if self.recipe.half_dtype is not None:
            state_to_float(self.model, self.recipe.half_dtype, keep=self.half_before)
        self.handles, self.converted = [], []

    def check_parameters_kept(self) -> None:
        """Refuse, before anything changes, to restore a model whose cast parameters left it since: weight
        norm folded (``remove_parametrizations``/``remove_weight_norm`` replace g and v by a new ``weight``,
        computed in half), a layer replaced. Their masters would have nowhere to go, and what replaced them
        would stay half (a user trial: the next forward failed on "weight type (torch.HalfTensor)")."""
        present = {id(p) for p in self.model.parameters()}
        gone = [c.qualname or c.name for c in self.converted
                if c.is_param and id(getattr(c.module, c.name, None)) not in present]
        if gone:
            names = listed([repr(n) for n in gone])
            raise ConfigError(
                f"cannot restore {type(self.model).__name__}: {names}, cast to half when it was prepared, "
                f"{'is' if len(gone) == 1 else 'are'} no longer in the model (weight norm folded with "
                "remove_parametrizations or remove_weight_norm, a layer replaced, or a parametrization or "
                "prune registered since, which moved it to 'original'/'weight_orig'): the fp32 masters have "
                "nowhere to go, and what replaced them would stay half.",
                "restore first, then change the model (restore, then fold the weight norm: exact, from the "
                "fp32 masters).",
            )


# Wrappers that hold per-parameter state made for the parameters as they were (DDP's gradient buckets and
# hooks, DataParallel's replicas): casting the model inside them afterwards is not seen by them.
_PARALLEL_WRAPPERS: tuple[type, ...] = (nn.parallel.DistributedDataParallel, nn.DataParallel)


def check_castable(model: nn.Module, recipe: Recipe) -> None:
    """Refuse to cast a model a parallel wrapper already holds (apex refused it too): DDP built its buckets
    for the fp32 parameters, and after the cast each rank trains on its own gradients, with no error. And
    a model FSDP2 sharded: the recipe casts it and keeps a master per parameter, while fully_shard replaces
    the parameters by DTensor shards gathered in its own MixedPrecisionPolicy's dtype."""
    if not recipe.casts_model:
        return
    if any(is_sharded(p) for p in model.parameters()):
        raise ConfigError(
            f"{recipe.name} casts the model to half and keeps fp32 masters, but this model's parameters are "
            "FSDP2 shards (DTensor): fully_shard decides their dtype itself.",
            "with FSDP2 keep the model fp32 and use fully_shard(model, mp_policy=MixedPrecisionPolicy("
            "param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) with a plain optimizer (and "
            "mixprec.GradScaler for fp16), or O1 (initialize's opt_level='O1', the Learner's "
            "to_recipe('O1')); see docs/recipes.md, Distributed.",
        )
    if not isinstance(model, _PARALLEL_WRAPPERS):
        return
    raise ConfigError(
        f"{recipe.name} casts the model to {recipe.model_dtype}, and this model is already wrapped in "
        f"{type(model).__name__}, which set up its gradient sync for the fp32 parameters: cast inside it, "
        "the ranks would train apart without an error.",
        f"cast first, then wrap (apex's order): model, opt = mixprec.initialize(model, opt, '{recipe.name}') "
        "and then DistributedDataParallel(model). The Learner casts when a fit starts, so with a wrapped "
        "model use learn.to_recipe('O1') (autocast: the model stays fp32); docs/recipes.md, Distributed.",
    )


def _warn_computed_buffers_rounded(converted: list[Converted], dtype: torch.dtype) -> None:
    """Say which non-persistent float buffers (values a model computes once, such as RoPE's inv_freq:
    not in its state dict, so no checkpoint restores them) the cast rounded: apex's model.half() did it
    silently, and Hugging Face keeps inv_freq in fp32 (in bf16 a position's angle moved by up to 0.36)."""
    rounded = []
    for c in converted:
        if c.is_param or c.before is None or c.before.is_meta:
            continue
        if c.name not in c.module._non_persistent_buffers_set:
            continue
        if not torch.equal(getattr(c.module, c.name).to(c.before.dtype), c.before):
            rounded.append(c.qualname)
    if rounded:
        warnings.warn(
            f"The cast to {str(dtype).removeprefix('torch.')} rounded the computed buffer(s) "
            f"{listed(rounded)} (not in the state dict: no "
            "checkpoint restores them), as apex's model.half() does. Where one must keep fp32's precision "
            "(RoPE's inv_freq at long contexts), put it back after initialize: docs/recipes.md, 'O2/O3 "
            "cast every floating buffer'.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def _warn_cast_overflow(converted: list[Converted], dtype: torch.dtype) -> None:
    """Name the parameters and buffers the cast made inf: values beyond ``dtype``'s range (fp16's 65504; a
    weight set by hand, a large learned scale). A parameter's fp32 master keeps the value, but the half
    model computes with inf and every step is skipped, with nothing pointing at the cast (a trial; apex's
    model.half() was as silent). A buffer's large negative values are left out: an additive mask's -1e9
    is meant to become -inf. One host read for all of them (per device), once."""
    pairs = [(c, getattr(c.module, c.name)) for c in converted
             if c.before is not None and not c.before.is_meta and not is_fake(c.before)]
    limit = torch.finfo(dtype).max

    def made_inf(c: Converted, t: torch.Tensor) -> torch.Tensor:
        beyond = torch.isinf(t) & torch.isfinite(c.before)
        return (beyond if c.is_param else beyond & (c.before > limit)).any()

    flags = [made_inf(c, t) for c, t in pairs]
    if not flags:
        return
    same_device = len({f.device for f in flags}) == 1
    read = torch.stack(flags).tolist() if same_device else [bool(f) for f in flags]
    named = [(c.qualname or c.name, float(c.before.abs().max())) for (c, _), bad in
             zip(pairs, read, strict=True) if bad]  # fmt: skip
    if not named:
        return
    shown = listed([f"{n} (max |x| {m:.3g})" for n, m in named])
    warnings.warn(
        f"The cast to {str(dtype).removeprefix('torch.')} made inf of values beyond its range (+-{limit:g}) "
        f"in {shown}. A parameter's fp32 master keeps its value, but the half model computes with inf: "
        "every step would be skipped. Fix: keep that module in fp32 (mixprec.keep_fp32(module) before "
        "initialize or to_fp16()), train in bf16 (fp32's range), or rescale the values.",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def hook_fp32_roots(model: nn.Module, dtype: torch.dtype, keep_bn_fp32: bool) -> list[Any]:
    """The hooks that fit the modules a cast to ``dtype`` kept fp32 (:func:`fp32_roots`) into the half
    model, as handles: a sparse-gradient table hands on its rows in the model's dtype, as a half table
    would (the lookup reads them exactly, the cast rounds them once; a GEMM after it would round them
    anyway); a keep_fp32 module computes in fp32 on its fp32 tensors and hands the model its dtype back.
    prepare's, and the memory breakdown's on its copy of the model."""
    hooks: list[Any] = []
    for m, why in fp32_roots(model, keep_bn_fp32):
        if why not in (SPARSE, MARKED):  # a kept BatchNorm: no hooks, as in apex O2
            continue
        if why == MARKED:
            hooks.append(_Flag(m, HANDLED_ATTR))  # its keep_fp32 hook: no warning
        # fp32 inputs: a kept module computes in fp32, and an EmbeddingBag's per_sample_weights must be its
        # table's dtype (torch: "Expected tensor for argument #1 'weight' to have the same type"); half ones
        # (the model's input cast, a half layer's output) upcast exactly
        hooks.append(m.register_forward_pre_hook(CastInputs(torch.float32), with_kwargs=True))
        back = CastKeptOutputs(dtype) if why == MARKED else CastOutputs(dtype)  # kept ones: overflow checked
        hooks.append(m.register_forward_hook(back))
    return hooks


def prepare(
    model: nn.Module,
    recipe: Recipe,
    device_type: str,
    *,
    output_dtype: torch.dtype | None = None,
    fp32_state_dict: bool = False,
) -> HalfModel:
    """Cast ``model`` as ``recipe`` says and hook its forward: floating inputs to the model's half dtype,
    the forward inside the recipe's precision region, outputs cast to ``output_dtype`` (by default fp32
    for the half ones when ``recipe.loss_fp32``). ``fp32_state_dict``: ``model.state_dict()`` holds fp32
    tensors (apex O2). An fp32 recipe changes nothing."""
    check_castable(model, recipe)
    half = HalfModel(model, recipe)
    if recipe.is_fp32:
        return half
    hooks = half.handles
    if recipe.half_dtype is not None:  # restore's state_to_float looks for that dtype, O1's too
        half.half_before = frozenset((id(m), n) for m in model.modules() for n, b in m._buffers.items()
                                     if b is not None and b.dtype == recipe.half_dtype)
    if recipe.casts_model:
        dtype = recipe.model_dtype
        half.converted = model_to_half(model, dtype, keep_bn_fp32=recipe.keep_batchnorm_fp32)
        _warn_computed_buffers_rounded(half.converted, dtype)
        _warn_cast_overflow(half.converted, dtype)
        hooks += hook_fp32_roots(model, dtype, recipe.keep_batchnorm_fp32)
        hooks += watch_buffer_writes(model, [(c.qualname, c.module, c.name) for c in half.converted
                                             if not c.is_param], dtype)
        probe = next(((c.module, c.name) for c in half.converted if c.is_param), None)
        hooks.append(model.register_forward_pre_hook(CastInputs(dtype, probe, recipe.cast_inputs),
                                                     with_kwargs=True))
        if fp32_state_dict:
            hooks += [m._register_state_dict_hook(_fp32_state_dict) for m in model.modules()]
            hooks += share_tied_entries(model)
    make = region_factory(recipe, device_type)
    hooks.append(_RegionForward(model, make))  # type: ignore[arg-type]
    mark_prepared(model.parameters())  # their forward runs in the region: fast, compiled or not
    # the submodules, for a checkpoint's recompute (_submodule_forward)
    hooks.append(_SubmoduleForwards(model, make, half_model=recipe.casts_model))  # type: ignore[arg-type]
    out_dtype = output_dtype or (torch.float32 if recipe.loss_fp32 else None)
    if out_dtype is not None:
        hooks.append(model.register_forward_hook(CastOutputs(out_dtype)))
    return half
