"""The checks ``save_checkpoint`` and ``load_checkpoint`` run before they touch anything.

Save refuses the two mistakes that write a checkpoint which resumes wrongly without any error:

- saving between ``scaler.step(opt)`` and ``scaler.update()``: the scale saved is the one before this
  iteration's update, so the resumed run repeats or misses a backoff;
- saving the optimizer wrapped by ``MasterWeights`` (``opt.optimizer``) instead of the wrapper: its
  parameters are the fp32 masters, which the file would hold as anonymous optimizer params, and the first
  step after the resume writes the stale masters back over the model.

Load compares the checkpoint with the objects it is about to fill -- how many of each kind, each object's
class, each model tensor's name, shape and dtype, each optimizer's param groups -- and names the first
differences, so that a mismatch raises before a single tensor is overwritten (a load is all or nothing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.errors import CheckpointError, listed
from mixprec.hardware import HALF_DTYPES
from mixprec.master import MasterWeights
from mixprec.scaler import OptState

MAX_LISTED = 3  # differences named in one message: enough to see the pattern, short enough to read


def describe(obj: Any) -> str:
    """The class of ``obj`` as the checkpoint records it; a wrapper shows what it wraps:
    ``MasterWeights(AdamW)``."""
    inner = getattr(obj, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        inner = getattr(obj, "inner", None)  # LowPrecisionOptimizer's name for it
    name = type(obj).__name__
    return f"{name}({type(inner).__name__})" if isinstance(inner, torch.optim.Optimizer) else name


# --------------------------------------------------------------------------------------------- at save
def check_can_save(models: Sequence[nn.Module], optimizers: Sequence[Any], scalers: Sequence[Any]) -> None:
    for i, model in enumerate(models):
        if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            # its state dict's keys start with "module.": the file would load only into another wrapper
            raise CheckpointError(
                f"model {i} is wrapped in {type(model).__name__}: its state dict's names start with "
                "'module.', and the checkpoint would not load into the model itself.",
                "pass the model it wraps: save_checkpoint(..., model=ddp.module) (and load into it).",
            )
    for i, opt in enumerate(optimizers):
        _refuse_inner_optimizer(models, opt, i)
        for scaler in scalers:
            stage = scaler.stage(opt) if callable(getattr(scaler, "stage", None)) else OptState.READY
            if stage is not OptState.READY:
                raise CheckpointError(
                    f"optimizer {i} is mid-iteration ({stage.name}: after scaler.unscale_/step, before "
                    "scaler.update()); the scale saved now would be the one before this iteration's update.",
                    "save after scaler.update(), at the end of the iteration.",
                )


def _refuse_inner_optimizer(models: Sequence[nn.Module], opt: Any, index: int) -> None:
    """Refuse an optimizer whose fp32 parameters are not the models' while the models are half: the
    optimizer inside a MasterWeights. Foreign parameters in an fp32 run (a learnable loss weight) pass."""
    if isinstance(opt, MasterWeights):  # its param_groups are its masters, by design
        return
    owned = {id(p) for m in models for p in m.parameters()}
    if not any(p.dtype in HALF_DTYPES for m in models for p in m.parameters()):
        return
    foreign = [p for g in opt.param_groups for p in g["params"] if id(p) not in owned]
    if foreign and all(p.dtype == torch.float32 for p in foreign):
        raise CheckpointError(
            f"optimizer {index} ({describe(opt)}) updates {len(foreign)} fp32 tensors that are not "
            "parameters of the half-precision model: the fp32 masters of a MasterWeights. Its own "
            "state would resume without them, and the first step would write stale masters back.",
            "pass the MasterWeights wrapper (the object you call .step() on), not wrapper.optimizer.",
        )


# --------------------------------------------------------------------------------------------- at load
def check_counts(kind: str, objects: Sequence[Any], states: Sequence[Any]) -> None:
    if len(objects) != len(states):
        raise CheckpointError(
            f"The checkpoint holds {len(states)} {kind} state(s), but {len(objects)} were given to load "
            "into.",
            f"pass the same {kind}(s), in the same order, as to save_checkpoint.",
        )


def check_classes(kind: str, objects: Sequence[Any], saved: Sequence[str] | None) -> None:
    """Each object's class against the one saved (``saved`` is None for a checkpoint of format 1)."""
    for i, (obj, name) in enumerate(zip(objects, saved or [describe(o) for o in objects], strict=True)):
        # a bare class name: a wrapper whose inner optimizer went unrecorded (LowPrecisionOptimizer, before
        # 2026-11-26): the class alone is what can be checked
        if describe(obj) != name and name != type(obj).__name__:
            raise CheckpointError(
                f"{kind} {i} was saved as {name}, and is loaded into {describe(obj)}.",
                f"build it as the saved run did ({name}), or start afresh without the checkpoint.",
            )


def check_model(index: int, model: nn.Module, saved: Mapping[str, Any]) -> None:
    """Names, shapes and dtypes of the saved tensors against the model's. A dtype difference is a
    precision difference: ``load_state_dict`` would cast silently."""
    own = model.state_dict()
    # the tensors' own dtypes too: a split-masters model's state dict holds fp32 masters where its weights
    # are bf16, and a checkpoint written before it did so holds the bf16 weights (its load keeps them exact)
    live = {name: t.dtype for name, t in [*model.named_parameters(remove_duplicate=False),
                                          *model.named_buffers(remove_duplicate=False)]}
    problems = [f"missing {k!r}" for k in sorted(saved.keys() - own.keys())]
    problems += [f"unexpected {k!r}" for k in sorted(own.keys() - saved.keys())]
    casts: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}  # (saved, here) -> tensor names
    for key in sorted(own.keys() & saved.keys()):
        mine, theirs = own[key], saved[key]
        if not isinstance(mine, torch.Tensor) or not isinstance(theirs, torch.Tensor):
            continue
        if mine.shape != theirs.shape:
            problems.append(f"{key!r} is {tuple(theirs.shape)} in the checkpoint, {tuple(mine.shape)} here")
        elif theirs.dtype not in (mine.dtype, live.get(key)):
            casts.setdefault((theirs.dtype, mine.dtype), []).append(key)
    problems += [f"{len(keys)} tensor(s) ({keys[0]!r}, ...) are {was} in the checkpoint, {now} here "
                 "(another precision)" for (was, now), keys in casts.items()]
    if problems:
        raise CheckpointError(
            f"model {index} does not match the checkpoint: {listed(problems, MAX_LISTED, '; ')}.",
            "build the model with the same architecture and precision (e.g. the same to_fp16/to_bf16, "
            "opt level or .half()) as the saved run, before loading.",
        )


def check_optimizer(index: int, opt: Any, saved: Mapping[str, Any]) -> None:
    """Param groups and their sizes: torch checks them too, but only after it replaced the groups."""
    inner = saved.get("optimizer", saved)  # a MasterWeights state holds the wrapped optimizer's
    groups = inner.get("param_groups") if isinstance(inner, Mapping) else None
    if groups is None:
        raise CheckpointError(f"optimizer {index}'s saved state has no param groups.",
                              "save the optimizer with save_checkpoint.")
    sizes = [len(g["params"]) for g in opt.param_groups]
    saved_sizes = [len(g["params"]) for g in groups]
    if sizes != saved_sizes:
        raise CheckpointError(
            f"optimizer {index} has param groups of sizes {sizes}, the checkpoint {saved_sizes}.",
            "build the optimizer over the same parameters and groups as the saved run.",
        )
    if "flat" in saved and getattr(opt, "flat", saved["flat"]) != saved["flat"]:
        raise CheckpointError(
            f"optimizer {index} keeps its masters flat={opt.flat}, the checkpoint flat={saved['flat']}.",
            f"construct MasterWeights(..., flat={saved['flat']}) (--flat-master in the CLI) to resume it.",
        )


def check_scaler(index: int, scaler: Any, saved: Mapping[str, Any]) -> None:
    """A disabled scaler ignores a saved scale and an enabled one cannot start from an empty state: both
    are a precision difference (fp16 with scaling against fp32/bf16 without)."""
    enabled = bool(getattr(scaler, "is_enabled", lambda: True)())
    if enabled != bool(saved):
        was, now = ("with", "without") if saved else ("without", "with")
        raise CheckpointError(
            f"scaler {index}: the checkpoint was saved {was} loss scaling, this run is {now} it "
            "(another precision).",
            "resume at the precision the run was saved at (fp16 scales the loss; fp32 and bf16 do not).",
        )
    dynamic = getattr(scaler, "is_dynamic", None)
    if enabled and isinstance(dynamic, bool) and "dynamic" in saved and bool(saved["dynamic"]) != dynamic:
        # initialize's scalers are always enabled: an fp16 O2 run (dynamic) and a bf16 one (a static 1)
        # differ only here, and loading one into the other replaced its scaling silently
        kinds = {True: "dynamic", False: "static"}
        raise CheckpointError(
            f"scaler {index}: the checkpoint's loss scale is {kinds[bool(saved['dynamic'])]} (at "
            f"{saved.get('scale')}), this run's is {kinds[dynamic]}: loading it would replace this run's "
            "loss scaling (another precision, or another loss_scale=).",
            "resume at the precision and loss scaling the run was saved with (initialize's dtype= and "
            "loss_scale=, GradScaler's dynamic=).",
        )
