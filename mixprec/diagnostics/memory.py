"""Memory of one training step, by component, for each precision recipe: where mixed precision saves bytes.

(Longer than most modules: the measured breakdown and the estimate without computing are one concept, the
same components counted two ways, and the tests hold them against each other.)

:func:`memory_breakdown` copies the model into the recipe's dtypes, runs one forward pass and the loss under
``torch.autograd.graph.saved_tensors_hooks`` and lets the optimizer create its state, then reports:

- ``params`` / ``buffers``: the model's parameters and buffers (BatchNorm running statistics) in the
  recipe's dtypes. Tied parameters count once.
- ``masters``: fp32 copies of the half parameters, which the optimizer updates (O2).
- ``grads``: one gradient per trainable parameter, in the parameter's dtype (autograd's contract); dense:
  a ``sparse=True`` table's is counted at the table's size, an upper bound of the looked-up rows its
  sparse gradient holds;
  ``master_grads``: the fp32 gradients of the masters.
- ``optimizer_state``: every tensor in ``optimizer.state`` after one step (Adam: ``exp_avg`` and
  ``exp_avg_sq`` -- twice the stepped parameters -- plus a 4-byte ``step`` counter per parameter).
- ``activations``: tensors autograd saved for backward. We count **unique storages** (keyed by the storage,
  not the tensor), whole: a saved view keeps its whole base storage alive, and a tensor saved by two ops
  (ReLU's output is saved by ReLU and by the next Linear) or viewed twice is one storage. Storages of
  parameters and buffers are left out (already counted). The input batch counts when an op saves it (the
  first layer does, for its weight gradient), as do the loss's targets. An emulated half GEMM saves its
  half activations, as a native kernel does, but for tiny ones (below 4096 elements:
  ``mixprec.half_saving_gemms.FEW_ACTIVATIONS``) it saves their fp32 copies, at most 16 KiB a GEMM.
- ``weight_copies``: copies of weights that a GEMM made and autograd saved for backward: autocast's fp16/bf16
  casts of fp32 weights (O1), or, where half GEMMs are *emulated* (``half_arithmetic``; CPU fp16 by
  default), the fp32 copies of weights the emulated GEMM computed with (O1 with mixprec.autocast, and every
  half-model recipe: O2, O3, fp16, pure-fp16). They are activations by lifetime but weights by size, so
  they get their own line: found by walking a saved tensor's autograd history through casts and views
  back to a parameter. A half model's forward runs in the region mixprec's own half model runs in
  (``half_compute``), so the count follows the arithmetic mixprec will use; ``arithmetic`` says which.
- ``total``: the sum. It is an upper bound on what one step holds at once, not a measured peak: autograd
  frees activations as backward produces gradients, and temporaries and allocator slack are not counted.

``estimate=True`` runs all of this under :class:`~torch._subclasses.fake_tensor.FakeTensorMode`: tensors
carry shapes, dtypes and storages but no data and no arithmetic, so VGG16 at batch 64 takes about a second.
The estimate follows the same kernels' autograd formulas as a real run on the model's device, so it
matches a measured run byte for byte (tested on a small CNN), but for a recurrent layer's workspace, which
torch's fake kernels cannot size: a breakdown's ``notes`` say so. It describes the device the model is on:
e.g. CPU dropout saves a full-width noise tensor where CUDA saves a 1-byte mask.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec.apex_properties import Properties
from mixprec.errors import ConfigError
from mixprec.formats import dtype_label
from mixprec.half_model import CastInputs, fp32_kept, hook_fp32_roots, internal_copies
from mixprec.hardware import HALF_DTYPES, half_arithmetic
from mixprec.low_precision import LowPrecisionOptimizer, UpdateMode
from mixprec.master import MasterWeights
from mixprec.recipe import RECIPES, Recipe, get_recipe
from mixprec.tree import cast_floating, iter_tensors, map_tensors

if TYPE_CHECKING:
    from rich.table import Table
    from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = [
    "AUTOCAST_IMPLS",
    "COMPONENTS",
    "MemoryBreakdown",
    "SavedTensors",
    "PRECISIONS",
    "get_precision",
    "as_recipe",
    "check_update",
    "parse_precision",
    "precision_name",
    "memory_breakdown",
    "memory_breakdowns",
    "memory_table",
]

MIB = 2**20  # the ladder's tables show MiB

# Binary units, smallest first: a breakdown is shown in the largest whose 1 fits its largest total, so a
# small model's table is not all 0.00 and a large one's not six digits (the table and the chart alike).
_UNITS: tuple[tuple[str, int], ...] = (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30))


def memory_unit(breakdowns: Sequence[MemoryBreakdown]) -> tuple[str, int]:
    """(name, bytes) of the unit to show ``breakdowns`` in."""
    top = max((b.total for b in breakdowns), default=0)
    return next(((n, b) for n, b in reversed(_UNITS) if top >= b), _UNITS[0])


def bytes_text(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches, as the memory tables count: ``"1.50 KiB"``."""
    name, size = next(((name, size) for name, size in reversed(_UNITS) if n >= size), ("B", 1))
    return f"{n} B" if size == 1 else f"{n / size:.2f} {name}"


# ---------------------------------------------------------------------------------------------------------
# precision recipes: mixprec.recipe's, plus a LowPrecisionOptimizer mode for pure half ones
# ---------------------------------------------------------------------------------------------------------

PrecisionLike = str | Recipe | Properties


def as_recipe(precision: PrecisionLike) -> Recipe:
    """The :class:`~mixprec.recipe.Recipe` named ``precision`` (a preset of :data:`~mixprec.recipe.RECIPES`),
    an apex :class:`~mixprec.amp.Properties`' recipe, or ``precision`` itself."""
    if isinstance(precision, Properties):
        return precision.recipe
    return get_recipe(precision.strip() if isinstance(precision, str) else precision)


def _resolve(precision: PrecisionLike, update: UpdateMode | str | None) -> tuple[Recipe, UpdateMode | None]:
    recipe, mode = parse_precision(precision) if isinstance(precision, str) else (as_recipe(precision), None)
    if update is not None:
        if mode is not None:
            raise ConfigError(f"precision {precision!r} names an update mode, and update={update!r} another.",
                              "name the mode once.")
        text = update.value if isinstance(update, UpdateMode) else str(update)
        mode = parse_precision(f"{recipe.name}+{text}")[1]  # an unknown mode: its ConfigError
    return recipe, mode


def check_update(recipe: Recipe, update: UpdateMode | None) -> None:
    """A LowPrecisionOptimizer mode needs pure half weights: a half model without fp32 masters."""
    if update is not None and (not recipe.casts_model or recipe.uses_masters):
        raise ConfigError(
            f"update mode {update.value!r} with recipe {recipe.name!r}: a LowPrecisionOptimizer updates "
            "half weights that have no fp32 masters.",
            "use it with pure-bf16 or pure-fp16, e.g. pure-bf16+kahan.",
        )


def parse_precision(name: str) -> tuple[Recipe, UpdateMode | None]:
    """``"pure-bf16+kahan"`` -> (the pure-bf16 recipe, UpdateMode.KAHAN); ``"O2"`` -> (O2's recipe, None).
    The names of ``mixprec memory --precision`` and of the ladder's rungs."""
    base, plus, mode = name.strip().partition("+")
    recipe = as_recipe(base)
    if not plus:
        return recipe, None
    modes = ", ".join(m.value for m in UpdateMode)
    try:
        update = UpdateMode(mode.strip().lower())
    except ValueError:
        raise ConfigError(f"unknown update mode {mode!r} in {name!r}.",
                          f"write RECIPE+MODE with MODE one of {modes}, e.g. pure-bf16+kahan.") from None
    check_update(recipe, update)
    return recipe, update


# The names before the Recipe (mixprec 0.x): the presets are the recipes now.
PRECISIONS = RECIPES
get_precision = as_recipe


def precision_name(recipe: Recipe, update: UpdateMode | None) -> str:
    return recipe.name if update is None else f"{recipe.name}+{update.value}"


# ---------------------------------------------------------------------------------------------------------
# result
# ---------------------------------------------------------------------------------------------------------

# (field, label, what is counted), in the order the components stack in the plot (bottom first).
COMPONENTS: tuple[tuple[str, str, str], ...] = (
    ("params", "parameters", "model parameters in the recipe's dtypes; tied parameters once"),
    ("masters", "fp32 master weights", "fp32 copies of the half parameters, stepped by the optimizer"),
    ("extras", "low-precision extras", "Kahan compensations or 16+16 low halves (LowPrecisionOptimizer)"),
    ("buffers", "buffers", "non-parameter state such as BatchNorm running statistics"),
    ("grads", "gradients", "one per trainable parameter, in the parameter's dtype"),
    ("master_grads", "fp32 master gradients", "fp32 gradients of the master weights"),
    ("optimizer_state", "optimizer state", "every tensor in optimizer.state after one step"),
    ("weight_copies", "GEMM weight copies",
     "weight copies a GEMM made (autocast's half casts, emulation's fp32 upcasts), saved for backward"),
    ("activations", "activations (saved for backward)",
     "unique storages autograd saved for backward, params excluded, input batch included if saved"),
)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes of each component of one training step (see the module docstring for what each counts)."""

    precision: str
    params: int
    masters: int
    buffers: int
    grads: int
    master_grads: int
    optimizer_state: int
    weight_copies: int
    activations: int
    n_params: int
    estimated: bool  # True: FakeTensorMode, nothing computed; False: measured on real tensors
    extras: int = 0  # a LowPrecisionOptimizer's per-parameter buffers (pure half recipes only)
    # How the counted step's half GEMMs ran ("" for fp32): "emulated" ones save fp32 copies of weights.
    arithmetic: str = ""
    notes: tuple[str, ...] = ()  # what the count leaves out, and how to count it

    @property
    def total(self) -> int:
        """Sum of all components: an upper bound on one step's live tensors (see the module docstring)."""
        return sum(getattr(self, key) for key, _, _ in COMPONENTS)

    @property
    def bytes_per_param(self) -> float:
        """Parameters, gradients, masters and their gradients or low-precision extras, and optimizer state,
        per parameter: what grows with the model (the ladder's B/param)."""
        weights = self.params + self.masters + self.extras
        held = weights + self.grads + self.master_grads + self.optimizer_state
        return held / self.n_params if self.n_params else 0.0

    @property
    def weights(self) -> int:
        """Parameters plus fp32 masters: the "model memory" of the published figures."""
        return self.params + self.masters

    def as_dict(self) -> dict[str, int]:
        return {key: getattr(self, key) for key, _, _ in COMPONENTS} | {"total": self.total}

    def plot(self, path: str | Path, title: str | None = None) -> Path:
        """A one-bar stacked chart of this breakdown as a PNG (see :func:`~.plots.plot_memory`)."""
        from mixprec.diagnostics.plots import plot_memory

        return plot_memory([self], path, title)


# ---------------------------------------------------------------------------------------------------------
# autocast implementations
# ---------------------------------------------------------------------------------------------------------


def _torch_autocast(device_type: str, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast(device_type, dtype=dtype)


def _mixprec_autocast(device_type: str, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    from mixprec.autocast import autocast

    return autocast(device_type, dtype=dtype)


# name -> (device_type, dtype) -> context manager. "torch" is the default because under fp16 on CPU
# mixprec.autocast *emulates* fp16 GEMMs with fp32 arithmetic, and autograd then saves the fp32 upcasts:
# the memory of that emulation, not of an fp16 device. For bf16, and on CUDA, the two agree.
AUTOCAST_IMPLS: dict[str, Callable[[str, torch.dtype], contextlib.AbstractContextManager[Any]]] = {
    "torch": _torch_autocast,
    "mixprec": _mixprec_autocast,
}


# ---------------------------------------------------------------------------------------------------------
# building the step's tensors
# ---------------------------------------------------------------------------------------------------------

OptimizerLike = torch.optim.Optimizer | Callable[[list[Tensor]], torch.optim.Optimizer] | None
Batch = Tensor | Sequence[Any]
LossFn = Callable[[Any, Any], Tensor]


class _Maker:
    """Makes the step's tensors: real copies (measured) or data-less fakes (estimated)."""

    def __init__(self, fake: FakeTensorMode | None) -> None:
        self.fake = fake

    def like(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        if self.fake is None:
            if t.is_meta:
                raise ConfigError(
                    "the model or batch is on the meta device, which has no data to measure with.",
                    "pass estimate=True (nothing is computed), or build the model on a real device.",
                )
            return t.detach().to(dtype=dtype, copy=True)
        # Fake tensors describe the model's device; meta tensors (no device of their own) become CPU ones.
        device = torch.device("cpu") if t.device.type == "meta" else t.device
        with self.fake:
            return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device=device)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.fake is None:
            yield
            return
        with self.fake, _batch_norm_stats_fix():
            yield


def _param_dtype(t: Tensor, recipe: Recipe, kept_fp32: bool) -> torch.dtype:
    if not t.is_floating_point():
        return t.dtype  # e.g. BatchNorm's num_batches_tracked
    # kept_fp32: the library's definition of what model_to_half keeps fp32 (half_model.fp32_kept)
    return torch.float32 if kept_fp32 else recipe.model_dtype


def _copy_model(model: nn.Module, precision: Recipe, maker: _Maker) -> nn.Module:
    # deepcopy with the memo pre-filled: every parameter and buffer is replaced by its converted copy (made
    # once, so tied weights stay tied); everything else about the model is copied as usual.
    memo: dict[int, Any] = {}
    kept = fp32_kept(model, precision.keep_batchnorm_fp32)
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) not in memo:
                dtype = _param_dtype(p, precision, id(module) in kept)
                memo[id(p)] = nn.Parameter(maker.like(p, dtype), p.requires_grad)
        for b in module.buffers(recurse=False):
            if id(b) not in memo:
                memo[id(b)] = maker.like(b, _param_dtype(b, precision, id(module) in kept))
    with internal_copies():  # the breakdown's own copy, not an EMA
        copied = copy.deepcopy(model, memo)
    if precision.casts_model:  # its kept modules compute in fp32, as prepare's hooks make them
        hook_fp32_roots(copied, precision.model_dtype, precision.keep_batchnorm_fp32)
    return copied


def split_batch(batch: Batch) -> tuple[Any, Any]:
    """``(x, y)`` of an example batch ``x`` or ``(x, y, ...)``; ``y`` is None when there is none. ``x`` is
    one tensor, or a tuple/list of a model's several inputs (``((tokens, mask), y)``: the Learner's rule)
    or a dict of them (a Hugging Face model's ``input_ids``, ``attention_mask``): see :func:`call_model`.
    Shared by the diagnostics that run a step on an example batch (memory, gradients)."""
    # a bare dict is the model's keyword inputs (a Hugging Face collator's batch), not a sequence of (x, y)
    items = (batch,) if isinstance(batch, (Tensor, Mapping)) else tuple(batch)
    x = items[0] if items else None
    several = isinstance(x, (tuple, list, dict)) and any(True for _ in iter_tensors(x))
    if not (isinstance(x, Tensor) or several):
        got = type(x).__name__ if items else "an empty batch"
        raise ConfigError(
            f"the example batch must be a tensor x or a tuple (x, y), x being one tensor, a tuple or list of "
            f"the model's inputs (called as model(*x)) or a dict of them (model(**x)); its x is {got}.",
            "pass e.g. data.one_batch(), (torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))) or "
            "((tokens, mask), targets).",
        )
    return x, items[1] if len(items) > 1 else None


def first_batched_input(batch: Batch) -> Tensor | None:
    """The first input of an example batch with a batch dimension (an ODE field's forward(t, y) takes a
    0-d ``t`` first): what the commands read the batch size and sample shape from."""
    return next((t for t in iter_tensors(split_batch(batch)[0]) if t.dim()), None)


def call_model(model: nn.Module, x: Any) -> Any:
    """``model`` on an example batch's ``x`` (:func:`split_batch`): ``model(*x)`` for a tuple or list,
    ``model(**x)`` for a dict, else ``model(x)``."""
    if isinstance(x, dict):
        return model(**x)
    return model(*x) if isinstance(x, (tuple, list)) else model(x)


def default_loss(output: Tensor, target: Tensor | None) -> Tensor:
    """Cross-entropy on (logits, class ids); without targets, the sum of the outputs.

    The cross-entropy runs in the dtype of the logits it is handed: fp32 for a recipe with ``loss_fp32``
    (the breakdown casts half outputs first, as the recipe's model does), else the model's. What autograd
    saves for it is part of the memory being measured. The plain sum
    is taken in fp32, where a half sum could overflow; the upcast saves nothing for backward.
    """
    if not isinstance(output, Tensor):
        keys = f" (keys: {', '.join(map(str, output))})" if isinstance(output, Mapping) else ""
        raise ConfigError(
            f"the model returned a {type(output).__name__}{keys}, and the default loss takes logits, one "
            "tensor.",
            "pass loss_fn=lambda out, y: ... returning the loss from it, e.g. lambda out, y: out['loss'] for "
            "a model that computes its own (labels in the inputs), or "
            "lambda out, y: F.cross_entropy(out['logits'], y).",
        )
    if target is None:
        return output.float().sum()
    return F.cross_entropy(output, target)


def _check_prepared_for(model: nn.Module, recipe: Recipe) -> None:
    """A model mixprec prepared (initialize, to_fp16()) is copied with its hooks, which cast its inputs to
    the dtype it was prepared for and refuse weights of another: a recipe of another model dtype is refused
    here, naming the fix, where the copy's forward said to call ``restore`` (which would undo the run). The
    root's input cast is prepare's alone (kept submodules get theirs), and restore takes it off."""
    prepared = {h.dtype for h in model._forward_pre_hooks.values() if isinstance(h, CastInputs)}
    wanted = recipe.model_dtype if recipe.casts_model else torch.float32
    if prepared and wanted not in prepared:
        raise ConfigError(
            f"this {type(model).__name__} was prepared by mixprec for {dtype_label(next(iter(prepared)))} "
            f"weights (initialize, to_fp16()/to_bf16()), and the {recipe.name} breakdown would copy it into "
            f"{dtype_label(wanted)} ones under its hooks.",
            "ask for the recipe it was prepared with, or pass the model before initialize (or a fresh "
            "instance of its class: the breakdown never changes it), and keep training the prepared one.",
        )


def _copy_batch(batch: Batch, recipe: Recipe, maker: _Maker) -> tuple[Any, Any]:
    # floating inputs as the model's boundary casts them: to its dtype, or left as given (cast_inputs=False)
    floating = recipe.model_dtype if recipe.cast_inputs else None

    def convert(t: Tensor) -> Tensor:
        return maker.like(t, (floating or t.dtype) if t.is_floating_point() else t.dtype)

    x, y = split_batch(batch)
    return map_tensors(convert, x), map_tensors(convert, y)


def _storage_key(t: Tensor) -> int:
    # The address of the StorageImpl: shared by every view of a storage, distinct for fake storages too
    # (data_ptr() is 0 for every fake and meta tensor).
    return t.untyped_storage()._cdata


def _unique_bytes(tensors: Iterable[Tensor], exclude: set[int] | None = None) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        key = _storage_key(t)
        if exclude is None or key not in exclude:
            seen[key] = t.untyped_storage().nbytes()
    return sum(seen.values())


# ---------------------------------------------------------------------------------------------------------
# what autograd saves
# ---------------------------------------------------------------------------------------------------------

# Autograd nodes that only view or cast their single input: walking through them from a saved tensor
# to a parameter's AccumulateGrad finds the tensors that are a weight in another dtype.
_VIEW_OR_CAST_NODES = frozenset({
    "ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
    "UnsafeViewBackward0", "ReshapeAliasBackward0", "ExpandBackward0", "AliasBackward0",
    "SqueezeBackward0", "SqueezeBackward1", "UnsqueezeBackward0",
})


def _is_weight_copy(t: Tensor, param_ids: set[int]) -> bool:
    """Whether ``t`` is a cast (possibly viewed) of one of the parameters, as autocast makes them."""
    node, cast = t.grad_fn, False
    while node is not None:
        name = type(node).__name__
        if name == "AccumulateGrad":
            return cast and id(node.variable) in param_ids
        if name not in _VIEW_OR_CAST_NODES:
            return False
        cast = cast or name == "ToCopyBackward0"
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return False


@dataclass
class SavedTensors:
    """Unique storages autograd saves for backward, seen by a pack hook (``saved.counting()``), split into
    weight copies and activations; the storages of ``exclude`` (parameters, buffers) are not counted."""

    exclude: set[int]
    param_ids: set[int]
    activations: dict[int, int] = dataclasses.field(default_factory=dict)
    weight_copies: dict[int, int] = dataclasses.field(default_factory=dict)
    keep: list[Tensor] = dataclasses.field(default_factory=list)

    @classmethod
    def beyond(cls, params: Iterable[Tensor], others: Iterable[Tensor] = ()) -> SavedTensors:
        """Count what is saved beyond ``params`` (whose copies are weight copies) and ``others``."""
        params = list(params)
        return cls({_storage_key(t) for t in [*params, *others]}, {id(p) for p in params})

    def counting(self) -> contextlib.AbstractContextManager[None]:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.activations.values()) + sum(self.weight_copies.values())

    def pack(self, t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key in self.exclude or key in self.activations or key in self.weight_copies:
            return t
        bucket = self.weight_copies if _is_weight_copy(t, self.param_ids) else self.activations
        bucket[key] = t.untyped_storage().nbytes()
        # Hold the tensor until counting is done, so a freed storage's address cannot be reused by a
        # later one and be mistaken for it.
        self.keep.append(t)
        return t


def _device_type(x: Any) -> str:
    # Fake tensors describe the model's device; meta tensors (no device of their own) are CPU ones.
    first = next(iter_tensors(x), None)
    device_type = first.device.type if first is not None else "cpu"
    return "cpu" if device_type == "meta" else device_type


def _forward_region(
    precision: Recipe, device_type: str, autocast: str
) -> contextlib.AbstractContextManager[Any]:
    """The region the recipe's forward runs in: autocast for an fp32 model (``autocast`` picks which), or
    for a half model the half_compute region mixprec's own half model runs in (half_model.prepare). The
    latter decides what autograd saves: an emulated half GEMM saves the fp32 copy of its weight that it
    computed with (O2 fp16 on a CPU without fp16 units), a native one the half weight itself."""
    if precision.casts_model and precision.half_dtype is not None:
        from mixprec.half_model import region_factory

        return region_factory(precision, device_type)()
    if precision.autocast_dtype is not None:
        return AUTOCAST_IMPLS[autocast](device_type, precision.autocast_dtype)
    return contextlib.nullcontext()


def _counted_arithmetic(precision: Recipe, device_type: str, autocast: str) -> str:
    """How the counted step's half GEMMs compute: ``""`` for an fp32 recipe, torch's own kernels under
    torch.autocast, else :func:`mixprec.hardware.half_arithmetic`'s answer (MIXPREC_HALF_ARITHMETIC
    honoured), which is what mixprec's regions use. Asked outside any FakeTensorMode: a probe, where one is
    needed, must time real GEMMs, and its answer is cached for the fake run."""
    if precision.half_dtype is None:
        return ""
    if not precision.casts_model and autocast == "torch":
        return "native (torch.autocast)"
    return half_arithmetic(device_type, precision.half_dtype).arithmetic.value


def _saved_for_backward(
    model: nn.Module, x: Any, y: Any, precision: Recipe, loss_fn: LossFn, autocast: str
) -> SavedTensors:
    saved = SavedTensors.beyond(model.parameters(), model.buffers())
    region = _forward_region(precision, _device_type(x), autocast)
    model.train()  # a training step: dropout active, BatchNorm on batch statistics
    with saved.counting():
        with region:
            output = call_model(model, x)
        if precision.loss_fp32 and not precision.is_fp32:
            # As the recipe's real model (half_model.prepare) hands them to the loss: half outputs cast to
            # fp32 first, so what the loss saves (log_softmax's output) takes fp32's bytes, not half's.
            output = cast_floating(output, torch.float32, only=HALF_DTYPES, dataclasses=True)
        loss_fn(output, y)
    return saved


# ---------------------------------------------------------------------------------------------------------
# optimizer state
# ---------------------------------------------------------------------------------------------------------


def _optimizer_factory(optimizer: OptimizerLike) -> Callable[[list[Tensor]], torch.optim.Optimizer] | None:
    if optimizer is None:
        return None
    if isinstance(optimizer, MasterWeights):
        # What initialize(..., "O2") returns. The recipe decides whether there are masters; the optimizer
        # is only asked which state it keeps, so the wrapped one is rebuilt.
        optimizer = optimizer.optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        cls, defaults = type(optimizer), dict(optimizer.defaults)
        if "optimizer" in vars(optimizer):  # a wrapper such as MasterWeights: its class needs the inner one
            raise ConfigError(
                f"cannot rebuild the wrapping optimizer {cls.__name__} on the breakdown's parameters.",
                "pass the inner optimizer, or a function params -> optimizer (e.g. "
                "lambda ps: torch.optim.Adam(ps, lr=1e-3)).",
            )
        # Only what the constructor takes: torch's AdamW keeps Adam's `decoupled_weight_decay` among its
        # defaults (torch 2.13) but refuses it as an argument (it is always True there).
        taken = inspect.signature(cls.__init__).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken.values()):
            defaults = {k: v for k, v in defaults.items() if k in taken}
        return lambda params: cls(params, **defaults)
    if callable(optimizer):
        return optimizer
    raise ConfigError(
        f"optimizer must be a torch.optim.Optimizer, a function params -> optimizer, or None; got "
        f"{type(optimizer).__name__}.",
        "pass e.g. torch.optim.Adam or lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9).",
    )


def _optimizer_state_bytes(
    factory: Callable[[list[Tensor]], torch.optim.Optimizer] | None, stepped: list[Tensor]
) -> int:
    """Bytes of the state the optimizer creates on its first step over ``stepped``."""
    if factory is None or not stepped:
        return 0
    for t in stepped:
        t.grad = torch.zeros_like(t)  # any gradient makes the state; these tensors are our own copies
    optimizer = factory(stepped)
    optimizer.step()
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
    exclude = {_storage_key(t) for t in stepped} | {_storage_key(t.grad) for t in stepped}
    return _unique_bytes(state, exclude)


# ---------------------------------------------------------------------------------------------------------
# the breakdown
# ---------------------------------------------------------------------------------------------------------


def _nbytes(tensors: Iterable[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_breakdown(
    model: nn.Module,
    optimizer: OptimizerLike,
    batch: Batch,
    precision: PrecisionLike = "fp32",
    *,
    loss_fn: LossFn | None = None,
    estimate: bool = False,
    autocast: str = "mixprec",
    update: UpdateMode | str | None = None,
) -> MemoryBreakdown:
    """Bytes of parameters, gradients, fp32 masters, optimizer state and saved activations of one step.

    Args:
        model: the model; it is copied (or, with ``estimate=True``, described by fake tensors) and never
            changed. It may live on the meta device when ``estimate=True``.
        optimizer: an optimizer instance (its class and defaults are rebuilt on the copied parameters; its
            own state is not touched; a ``MasterWeights`` is unwrapped, since the recipe decides about
            masters), a function ``params -> optimizer``, or None for no state. Frozen parameters an
            instance holds are counted with fp32 masters where the recipe has masters, as MasterWeights
            makes them one (no gradient, no state); a function's optimizer holds the trainable ones.
        batch: an example ``x`` or ``(x, y)``; only shapes and dtypes matter when ``estimate=True``.
        precision: a :class:`~mixprec.recipe.Recipe`, the name of one of :data:`~mixprec.recipe.RECIPES`
            (fp32, pure-fp16, pure-bf16, fp16, bf16, O0-O3, ...), or an apex ``Properties`` (its recipe).
        loss_fn: ``loss_fn(output, y)``; default cross-entropy, or ``output.sum()`` without ``y``.
        estimate: compute nothing: run under FakeTensorMode (seconds for VGG16 at batch 64).
        autocast: ``"mixprec"`` (mixprec.autocast: what ``initialize(..., "O1")`` and the ladder's O1 run;
            where mixprec emulates half GEMMs it saves other tensors than torch's kernels) or ``"torch"``
            (torch.autocast), for recipes with autocast.
        update: a :class:`~mixprec.low_precision.LowPrecisionOptimizer` mode (pure half recipes only): its
            extra buffers are counted, and the wrapped optimizer's state is fp32, as it steps fp32 views.
    """
    recipe, mode = _resolve(precision, update)
    if recipe.split_masters:  # O2's masters held as the bf16 weights' low halves: the split wrapper's count
        if mode is not None:
            raise ConfigError(f"recipe {recipe.name!r} holds split masters, and update={mode.value!r} asks "
                              "for another update.", "pass one of them.")
        recipe, mode = recipe.replace(master_weights=False, split_masters=False), UpdateMode.SPLIT
    if autocast not in AUTOCAST_IMPLS:
        raise ConfigError(f"unknown autocast {autocast!r}.", f"use one of {', '.join(AUTOCAST_IMPLS)}.")
    _check_prepared_for(model, recipe)
    factory = _optimizer_factory(optimizer)
    maker = _Maker(_new_fake_mode() if estimate else None)
    step_model = _copy_model(model, recipe, maker)
    x, y = _copy_batch(batch, recipe, maker)
    params = list(step_model.parameters())
    trainable = [p for p in params if p.requires_grad]
    masters, stepped = _masters_and_stepped(trainable, recipe, maker)
    # frozen parameters the optimizer holds get masters too (MasterWeights), never a gradient or state
    frozen_masters = _masters_and_stepped(_held_frozen(model, step_model, optimizer), recipe, maker)[0]
    if mode is not None:  # the wrapped optimizer steps fp32 views of the half weights
        stepped = [maker.like(p, torch.float32) for p in trainable]
    arithmetic = _counted_arithmetic(recipe, _device_type(x), autocast)  # before any FakeTensorMode
    with maker.active(), _values_needed_by_the_estimate(estimate):
        saved = _saved_for_backward(step_model, x, y, recipe, loss_fn or default_loss, autocast)
        state = _optimizer_state_bytes(factory, [t.detach().requires_grad_(True) for t in stepped])
        extras = _extra_bytes(trainable, mode)
    return MemoryBreakdown(
        precision=precision_name(recipe, mode),
        extras=extras,
        params=_unique_bytes(params),
        masters=_nbytes(masters) + _nbytes(frozen_masters),
        buffers=_unique_bytes(step_model.buffers()),
        grads=_nbytes(trainable),
        master_grads=_nbytes(masters) if recipe.master_grads else 0,  # False: the step reads half grads
        optimizer_state=state,
        weight_copies=sum(saved.weight_copies.values()),
        activations=sum(saved.activations.values()),
        n_params=sum(p.numel() for p in params),
        estimated=estimate,
        arithmetic=arithmetic,
        notes=_estimate_notes(step_model) if estimate else (),
    )


@contextlib.contextmanager
def _values_needed_by_the_estimate(estimate: bool) -> Iterator[None]:
    """An estimate's forward reads no values (fake tensors hold none): one that reads a value (``.item()``,
    ``float(t)``, a branch on a tensor) or makes a shape from values (``nonzero``) is refused, naming the
    measured count, where torch's own exception left a bare traceback from its fake kernels."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as err:
        if not estimate:
            raise
        raise ConfigError(
            f"the estimate runs the model on fake tensors, which hold no values, and this model's step "
            f"needs one ({type(err).__name__}: {err}): a value read in forward (.item(), float(t), an if on "
            "a tensor) or a shape that depends on values (nonzero, masked_select)",
            "measure instead: `mixprec memory ... --measure`, or memory_breakdown(..., estimate=False); or "
            "move the read out of forward (a logging line)",
        ) from err


def _estimate_notes(model: nn.Module) -> tuple[str, ...]:
    """What an estimate cannot count: torch's fake kernels give a recurrent layer's workspace (oneDNN's on
    the CPU, cuDNN's reserve on a GPU) no bytes, though the real kernel saves it for backward (an LSTM of
    hidden size 64 over 16 steps of batch 4: 264 KiB, twice the rest of what it saves)."""
    rnns = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.RNNBase)})
    if not rnns:
        return ()
    return (f"activations leave out the workspace of {', '.join(rnns)} layers, which the estimate cannot "
            "size (torch's fake kernels give it 0 bytes): measure to count it (--measure, or "
            "estimate=False)",)


def _extra_bytes(trainable: list[Tensor], mode: UpdateMode | None) -> int:
    """Bytes of the buffers a LowPrecisionOptimizer in ``mode`` allocates for ``trainable`` (made by the
    optimizer itself, so the count follows its rules)."""
    if mode is None or not trainable:
        return 0
    wrapper = LowPrecisionOptimizer(torch.optim.SGD(trainable, lr=0.0), mode)  # lr unused: never stepped
    return _nbytes(wrapper.extra_tensors())


def _held_frozen(model: nn.Module, step_model: nn.Module, optimizer: OptimizerLike) -> list[Tensor]:
    """The parameters of ``step_model`` (the breakdown's copy) whose originals in ``model`` are frozen and
    held by ``optimizer`` (an instance: a function builds its optimizer over the trainable ones)."""
    if isinstance(optimizer, MasterWeights):
        held = {id(p) for p in optimizer.model_params()}
        held |= {id(p) for g in optimizer.param_groups for p in g["params"]}  # its fp32 ones
    elif isinstance(optimizer, torch.optim.Optimizer):
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    else:
        return []
    pairs = zip(model.parameters(), step_model.parameters(), strict=True)  # deepcopy keeps the order
    return [copy for p, copy in pairs if id(p) in held and not p.requires_grad]


def _masters_and_stepped(
    trainable: list[Tensor], recipe: Recipe, maker: _Maker
) -> tuple[list[Tensor], list[Tensor]]:
    """The fp32 masters, and the tensors the optimizer steps: the masters plus the parameters that are not
    half (apex steps kept-fp32 BatchNorm parameters directly, without a copy), or all parameters."""
    if not recipe.uses_masters:
        return [], trainable
    # Only half parameters get a master, as in MasterWeights; fp32 (kept-fp32 BatchNorm) and fp64 ones are
    # stepped directly.
    masters = [maker.like(p, torch.float32) for p in trainable if p.dtype in HALF_DTYPES]
    return masters, [*masters, *(p for p in trainable if p.dtype not in HALF_DTYPES)]


def _new_fake_mode() -> FakeTensorMode:
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Real tensors that are not parameters or buffers (constants a module keeps as plain attributes) are
    # turned into fakes on first use instead of raising.
    return FakeTensorMode(allow_non_fake_inputs=True)


def _batch_norm_stats_fix() -> contextlib.AbstractContextManager[Any]:
    """A dispatch mode that corrects one fake-kernel dtype, so estimates match measurements.

    torch's meta kernel of ``native_batch_norm`` returns the saved batch mean and inverse std in the input's
    dtype. The CPU kernel, given a half input with fp32 weights or running statistics (O1, O2: BatchNorm
    kept in fp32), returns them in the parameters' dtype, and autograd saves them: without this fix such
    a BatchNorm would be under-counted by 4 bytes per channel. (Other devices keep torch's meta answer.)
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = {torch.ops.aten.native_batch_norm.default}

    class _Fix(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if func in ops and args[0].device.type == "cpu":
                params = [t for t in args[1:5] if isinstance(t, Tensor)]
                stats_dtype = params[0].dtype if params else args[0].dtype
                result, mean, invstd = out
                out = (result, mean.to(stats_dtype), invstd.to(stats_dtype))
            return out

    return _Fix()


def memory_breakdowns(
    model: nn.Module,
    optimizer: OptimizerLike,
    batch: Batch,
    precisions: Sequence[PrecisionLike] = ("fp32", "pure-fp16", "O1", "O2"),
    **kwargs: Any,
) -> list[MemoryBreakdown]:
    """:func:`memory_breakdown` for each of ``precisions`` (same keyword arguments)."""
    return [memory_breakdown(model, optimizer, batch, p, **kwargs) for p in precisions]


def memory_table(breakdowns: Sequence[MemoryBreakdown], title: str | None = None) -> Table:
    """A rich table: one row per component, one column per precision, in KiB, MiB or GiB (binary: 2**10,
    2**20, 2**30 bytes; :func:`memory_unit`), which the title names after ``title``."""
    from mixprec.diagnostics.tables import PlainTable as Table

    unit, per = memory_unit(breakdowns)
    table = Table(title=f"{title or 'Memory of one training step'} ({unit})", title_justify="left")
    table.add_column("component")
    for b in breakdowns:
        table.add_column(b.precision, justify="right")
    table.add_column("what is counted", style="dim")
    for key, label, what in COMPONENTS:
        values = [getattr(b, key) for b in breakdowns]
        if any(values):
            table.add_row(label, *(f"{v / per:,.2f}" for v in values), what)
    if any(b.arithmetic for b in breakdowns):
        table.add_row("half GEMMs", *(b.arithmetic or "-" for b in breakdowns),
                      "how the counted step's half GEMMs ran: emulated ones save fp32 weight copies")
    table.add_section()
    table.add_row("weights (params + masters)", *(f"{b.weights / per:,.2f}" for b in breakdowns),
                  "the published 'model memory'")
    table.add_row("bytes per parameter", *(f"{b.bytes_per_param:.1f}" for b in breakdowns),
                  "params + grads + masters/extras + optimizer state, per parameter")
    table.add_row("[bold]total[/bold]", *(f"[bold]{b.total / per:,.2f}[/bold]" for b in breakdowns),
                  "sum: upper bound of one step's live tensors")
    if breakdowns:
        base = breakdowns[0].total
        table.add_row(f"vs {breakdowns[0].precision}", *(f"{b.total / base:.2f}x" if base else "-"
                                                        for b in breakdowns), "")
    return table
