"""A fastai-style ``Learner``: data + model + loss + optimizer, a training loop with fastai v1's callback
events, and one-line switches between precision recipes.

    learn = Learner(mixprec.digits(), model, metrics=[accuracy]).to_fp16()
    learn.fit_one_cycle(3, 1e-3)

The loop itself (:meth:`Learner.fit`) knows no precision: mixed precision is a callback
(:class:`~mixprec.callbacks.MixedPrecision`) that arranges a :class:`~mixprec.recipe.Recipe` from the same
half model, GradScaler and MasterWeights that the other interfaces use. The event order is documented in
:mod:`mixprec.callbacks.core`, and so is the state a callback reads (``LearnerState``).

Gradient accumulation: ``callbacks=[GradientAccumulation(n_acc)]`` (fastai v2's).
Real models: ``fit(steps=...)`` counts optimizer steps (batches under GradientAccumulation);
``loss_func=None`` takes the loss from models that return ``(logits, loss)`` or a mapping with both (Hugging
Face's ``ModelOutput``); ``opt_func`` may build its own param groups, or ``wd=`` splits decay/no-decay.
Checkpoints: ``fit(..., checkpoint="run.pt")`` saves at every epoch end; ``fit(..., resume="run.pt")``
continues from it, bit for bit (see :class:`~mixprec.callbacks.Checkpoint`).
"""
from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from mixprec.callbacks import (
    Callback,
    CancelBatchException,
    CancelStepException,
    CancelTrainException,
    Checkpoint,
    MixedPrecision,
    OneCycleScheduler,
    ProgressBar,
    Recorder,
    callback_for,
    fastai_recipe,
)
from mixprec.callbacks.core import check_callback, check_event_result
from mixprec.data import DataBunch
from mixprec.errors import ConfigError
from mixprec.recipe import APEX_MAX_LOSS_SCALE, FASTAI_MAX_NOSKIP, Recipe, get_recipe
from mixprec.scaler import GradScaler, OptState
from mixprec.tree import map_tensors

if TYPE_CHECKING:
    from rich.console import Console
    from torch.utils.data import DataLoader

__all__ = ["Learner", "accuracy", "error_rate", "decay_groups", "trainable_params", "DEFAULT_LR",
           "default_opt_func"]

Metric = Callable[[Tensor, Tensor], Tensor]
LossFunc = Callable[[Tensor, Tensor], Tensor]
OptFunc = Callable[..., torch.optim.Optimizer]
ParamGroups = list[dict[str, Any]]

DEFAULT_LR = 3e-3  # fastai's default learning rate for Adam-style optimizers

# fastai v1's default optimizer: Adam with beta2 0.99 (quicker to adapt than 0.999 on short schedules) and
# decoupled ("true") weight decay 0.01.
default_opt_func: OptFunc = functools.partial(torch.optim.AdamW, betas=(0.9, 0.99), weight_decay=0.01)


def accuracy(pred: Tensor, targ: Tensor) -> Tensor:
    """Fraction of rows whose largest output is the target class."""
    return (pred.argmax(dim=-1) == targ).float().mean()


def error_rate(pred: Tensor, targ: Tensor) -> Tensor:
    """1 - accuracy."""
    return 1 - accuracy(pred, targ)


def trainable_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters with ``requires_grad``, tied ones once: what the Learner's optimizer is built over
    (fastai's default splitter of the same name)."""
    return [p for p in model.parameters() if p.requires_grad]  # model.parameters() yields tied ones once


def decay_groups(model: nn.Module, weight_decay: float) -> ParamGroups:
    """Two param groups: tensors of 2 or more dimensions (matmul weights, embeddings) with
    ``weight_decay``, the rest (biases, norm weights) without. Decaying a bias or a LayerNorm gain pulls it
    towards 0, which is no regularisation (it only shifts or shrinks activations); nanoGPT and most
    transformer recipes split this way. Tied and shared parameters appear once; frozen ones not at all.
    Empty groups are left out."""
    params = trainable_params(model)
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _pred_and_loss(out: Any) -> tuple[Any, Tensor]:
    """Split the ``(pred, loss)`` a model returns when it computes its own loss (``loss_func=None``): a
    tuple or list as nanoGPT returns, or a mapping with ``logits`` and ``loss`` as Hugging Face models do."""
    if isinstance(out, Mapping) and isinstance(out.get("loss"), Tensor) and "logits" in out:
        return out["logits"], out["loss"]
    if isinstance(out, tuple | list) and len(out) >= 2 and isinstance(out[1], Tensor):
        return out[0], out[1]
    raise ConfigError(
        f"loss_func=None means the model computes its loss: model(xb, yb) must return (pred, loss) or a "
        f"mapping with 'logits' and 'loss'; it returned {_described(out)}.",
        "return (logits, loss) from forward when given targets (as nanoGPT does), or pass a loss_func.",
    )


def _pairs(loader: Iterable[Any]) -> Iterator[tuple[Any, Any]]:
    """The loader's batches as (inputs, targets), fastai's layout; a dict batch (a Hugging Face collator's)
    or another shape is refused naming the adapter, where unpacking raised "too many values to unpack"."""
    for batch in loader:
        if isinstance(batch, Mapping) or not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            what = _batch_kind(batch)
            raise ConfigError(
                f"the loader yielded {what}; the Learner takes (inputs, targets) batches, as fastai's.",
                "wrap the loader's batches, e.g. for a Hugging Face collator's dicts "
                "((b['input_ids'], b['attention_mask']), b['labels']), and call the model on them as the "
                "Learner's docstring shows (loss_func=None for a model that computes its own loss).",
            )
        yield batch[0], batch[1]


def _batch_kind(batch: Any) -> str:
    if isinstance(batch, Mapping):
        return f"a {type(batch).__name__} with keys {', '.join(map(str, batch))}"
    size = f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""
    return f"a {type(batch).__name__}{size}"


def _prediction(out: Any) -> Any:
    """The prediction in a model's output without targets: ``logits`` of a mapping, the first item of a
    tuple (``(logits, None)``), else the output itself."""
    if isinstance(out, Mapping) and "logits" in out:
        return out["logits"]
    if isinstance(out, tuple | list) and out:
        return out[0]
    return out


def _described(out: Any) -> str:
    if isinstance(out, Mapping):
        return f"a {type(out).__name__} with keys {sorted(map(str, out))}"
    if isinstance(out, tuple | list):
        return f"a {type(out).__name__} of {len(out)} ({', '.join(type(o).__name__ for o in out)})"
    return type(out).__name__


def _targets(yb: Any) -> tuple[Any, ...]:
    """The loss's and metrics' arguments after the prediction: ``yb`` itself, or a tuple/list's items."""
    return tuple(yb) if isinstance(yb, (tuple, list)) else (yb,)


def _concatenated(batches: Sequence[Any]) -> Any:
    """Batches' tensors joined along the batch dimension; batches of several tensors position by
    position (a tuple of joined tensors)."""
    if isinstance(batches[0], (tuple, list)):
        return tuple(_concatenated(column) for column in zip(*batches, strict=True))
    tensors = list(batches)
    if len({t.shape[1:] for t in tensors}) > 1:
        # outputs padded per batch (a sequence model's lengths differ): one tensor per sample, as fastai's
        # to_concat falls back to, where torch.cat raised "Sizes of tensors must match"
        return [sample for t in tensors for sample in t.unbind(0)]
    return torch.cat(tensors)


def _check_prediction(pred: Any) -> None:
    """A loss_func gets the model's output as it is; a default one (cross_entropy) fed a tuple or mapping
    would fail inside torch with no word on the cause, so say it here."""
    if isinstance(pred, Tensor):
        return
    raise ConfigError(
        f"the model returned {_described(pred)}, and the loss_func (loss_func(pred, yb)) takes the model's "
        "output as it is; the default, cross_entropy, needs the logits tensor.",
        "if the model computes its own loss from targets (forward(x, targets) -> (logits, loss), as nanoGPT "
        "and Hugging Face models do), pass loss_func=None; else return the logits alone, or pass a "
        "loss_func that takes this output.",
    )


def _builds_an_optimizer(value: Any) -> bool:
    """An optimizer class, or a functools.partial of one (fastai's ``opt_func`` form)."""
    target = value.func if isinstance(value, functools.partial) else value
    return isinstance(target, type) and issubclass(target, torch.optim.Optimizer)


def _check_fastai_v1_order(loss_func: Any) -> None:
    """fastai v1's Learner(data, model, opt_func, loss_func) put the optimizer third, where this Learner
    takes the loss: said here, not at the first batch as "cross_entropy() got an unexpected keyword"."""
    if _builds_an_optimizer(loss_func):
        raise ConfigError(
            "Learner's third argument is loss_func, and it got an optimizer (fastai v1's order is "
            "Learner(data, model, opt_func, loss_func)).",
            "pass them by keyword: Learner(data, model, opt_func=..., loss_func=...).",
        )


def _check_data(data: Any) -> None:
    """The Learner reads ``data.train`` and ``data.valid`` (fastai's DataLoaders, a DataBunch): a pair of
    loaders or one loader failed only at fit, as "'tuple' object has no attribute 'train'" (a user
    trial)."""
    if hasattr(data, "train") and hasattr(data, "valid"):
        return
    got = "a tuple" if isinstance(data, tuple) else f"a {type(data).__name__}"
    raise ConfigError(
        f"Learner's first argument is the data, with .train and .valid loaders; it got {got}.",
        "wrap the loaders: mixprec.DataBunch(train_dl, valid_dl, n_classes, input_shape, name), "
        "input_shape being one sample's shape as the loaders yield it (predict reads it).",
    )


def _check_loss(loss: Any) -> None:
    """A loss_func's result must carry a graph back to the model: torch's own errors for a number (a
    ``.item()`` in the loss) name neither the loss_func nor the fix, and differ with the precision."""
    if isinstance(loss, Tensor) and loss.is_floating_point():
        return
    got = f"a {loss.dtype} tensor" if isinstance(loss, Tensor) else type(loss).__name__
    raise ConfigError(
        f"the loss_func returned {got}; the Learner backpropagates through it, so it must return a "
        "floating-point tensor (mean over the batch).",
        "return the loss tensor itself: no .item(), float() or .tolist() on it (log those in a callback's "
        "on_batch_end from learn.loss).",
    )


# fastai v2's to_fp16 keywords (torch's GradScaler's), and how this v1-signature to_fp16 says each
_V2_TO_FP16: dict[str, str] = {
    "init_scale": "loss_scale=...",
    "growth_interval": "max_noskip=...",
    "growth_factor": "to_recipe(r.replace(scale=dataclasses.replace(r.scale, growth_factor=...))) with "
                     "r = Recipe.fastai()",
    "backoff_factor": "to_recipe(r.replace(scale=dataclasses.replace(r.scale, backoff_factor=...))) with "
                      "r = Recipe.fastai()",
    "enabled": "to_fp16() to turn it on, to_fp32() to turn it off",
    "device": "nothing: the model's device decides",
}


def _unknown_to_fp16_arguments(unknown: dict[str, Any]) -> str:
    """The TypeError's message: fastai v2's names with their equivalents here, any other name as Python
    says it."""
    v2 = [f"{name} -> {_V2_TO_FP16[name]}" for name in unknown if name in _V2_TO_FP16]
    other = [name for name in unknown if name not in _V2_TO_FP16]
    parts = []
    if v2:
        parts.append("to_fp16() takes fastai v1's arguments (see docs/migrating-from-fastai.md); fastai v2's "
                     "are said so here: " + "; ".join(v2) + " (Recipe: mixprec.recipe)")
    if other:
        parts.append("to_fp16() got an unexpected keyword argument " + ", ".join(repr(n) for n in other))
    return ". ".join(parts)


class Learner:
    """Trains ``model`` on ``data`` with ``loss_func`` and an optimizer made by ``opt_func(params, lr=lr)``.

    Args:
        data: a :class:`~mixprec.data.DataBunch` (train and valid loaders).
        model: the model; it stays where it is (batches are moved to its device).
        loss_func: ``loss_func(pred, yb)`` -> a scalar tensor (mean over the batch); targets that are a
            tuple (CTC's targets and lengths) are passed as ``loss_func(pred, *yb)``, as fastai v2 does.
            None: the model computes its own loss (nanoGPT's convention): the learner calls
            ``model(xb, yb)``, which
            returns ``(pred, loss)`` or a mapping with ``logits`` and ``loss`` (a Hugging Face
            ``ModelOutput``); metrics and ``predict`` see ``pred``. A Hugging Face model takes ``labels=``
            by keyword (its second positional argument is the attention mask): pass a small adapter module
            whose ``forward(x, y)`` returns ``hf(input_ids=x, labels=y)``. With a ``loss_func`` such a
            model's tuple or mapping is an error that says to pass ``loss_func=None``.
        opt_func: builds the optimizer as ``opt_func(params, lr=lr)``; each ``fit`` builds a fresh one, so
            optimizer state does not carry over from one ``fit`` call to the next. It may ignore ``params``
            and return an optimizer with param groups of its own (e.g. the model's
            ``configure_optimizers``); every group follows the fit's learning-rate schedule, a group built
            at a multiple of ``lr`` (``{"params": ..., "lr": 10 * lr}``) at that multiple of it.
        wd: when set, ``params`` is :func:`decay_groups` (weight decay ``wd`` on matmul weights and
            embeddings only) instead of one group of the trainable parameters (:func:`trainable_params`:
            frozen ones are left out, as fastai does) with ``opt_func``'s weight decay.
        metrics: ``metric(pred, yb)`` -> scalar tensor, averaged over the validation set (weighted by batch
            size) and shown per epoch under the function's name.
        callbacks: extra callbacks, kept for every fit.
        silent: no progress bar and no results table.
        console: the rich console to print to (default: a new one on stdout).
    """

    def __init__(
        self,
        data: DataBunch,
        model: nn.Module,
        loss_func: LossFunc | None = F.cross_entropy,
        opt_func: OptFunc = default_opt_func,
        metrics: Sequence[Metric] | Metric = (),
        callbacks: Iterable[Callback] = (),
        silent: bool = False,
        console: Console | None = None,
        *,
        wd: float | None = None,
    ) -> None:
        _check_data(data)
        _check_fastai_v1_order(loss_func)
        self.data, self.model, self.loss_func, self.opt_func = data, model, loss_func, opt_func
        self.wd = wd
        self.metrics = [metrics] if callable(metrics) else list(metrics)  # one metric: fastai v1 takes it too
        self.callbacks: list[Callback] = []
        self.recorder = Recorder()
        self.mp_cb: Callback | None = None
        for cb in (self.recorder, *([] if silent else [ProgressBar(console)]), *callbacks):
            self.add_cb(cb)
        self.opt: torch.optim.Optimizer | None = None
        self.scaler: GradScaler | None = None
        self.epoch = self.n_epochs = self.n_steps = self.iteration = self.start_epoch = 0
        self.training = self._cancelled = False
        self.valid_loss, self.valid_metrics = math.nan, [math.nan] * len(self.metrics)

    # ------------------------------------------------------------------ callbacks
    def add_cb(self, cb: Callback) -> Learner:
        check_callback(cb)
        cb.learn = self
        self.callbacks.append(cb)
        self.callbacks.sort(key=lambda c: c.order)  # stable: equal orders keep the order they were added
        return self

    def remove_cb(self, cb: Callback) -> Learner:
        self.callbacks.remove(cb)
        return self

    def _event(self, name: str) -> None:
        # every callback gets the event (on_train_end restores the model) before a v1 result is refused
        results = [(cb, getattr(cb, name)()) for cb in list(self.callbacks)]
        for cb, result in results:
            check_event_result(cb, name, result)

    @property
    def metric_names(self) -> list[str]:
        return [getattr(m, "__name__", type(m).__name__) for m in self.metrics]

    @property
    def batch_size(self) -> int:
        """The current batch's size: its first target's length (fastai's rule). Except CTC's targets (all
        the batch's labels concatenated, then their lengths): where the first target is 1-D and the other
        targets agree with each other and with the first input's leading size, and not with it, theirs.
        The first target's length counted tokens there: GradientAccumulation stepped on tokens, not samples
        (a trial), and validation weighted batches by them."""
        targets = _targets(self.yb)
        first = len(targets[0])
        others = {len(t) for t in targets[1:] if isinstance(t, Tensor) and t.dim()}
        leading = next((t.shape[0] for t in tree_leaves(self.xb) if isinstance(t, Tensor) and t.dim()), None)
        if targets[0].dim() == 1 and len(others) == 1 and first not in others and leading in others:
            return leading
        return first

    @property
    def device(self) -> torch.device:
        param = next(self.model.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    # ------------------------------------------------------------------ precision
    def to_fp16(
        self,
        loss_scale: float | None = None,
        max_noskip: int = FASTAI_MAX_NOSKIP,
        dynamic: bool = True,
        clip: float | None = None,
        flat_master: bool = False,
        max_scale: float = APEX_MAX_LOSS_SCALE,
        loss_fp32: bool = True,
        *,
        min_scale: float | None = None,
        skip_limit: int | None = None,
        cast_inputs: bool = True,
        **unknown: Any,
    ) -> Learner:
        """Train in fp16 with fp32 master weights and loss scaling. The positional arguments are fastai v1's
        ``to_fp16``, in its order; mixprec's extras are keyword-only. The recipe is
        :meth:`Recipe.fastai <mixprec.recipe.Recipe.fastai>` (its defaults and their reasons live there).

        ``dynamic=True`` starts the dynamic scale at ``loss_scale`` (by default 2**16, fastai's), halves it
        on an overflowing step (which is skipped) and doubles it after ``max_noskip`` clean steps, up to
        ``max_scale`` (and down to ``min_scale``). ``dynamic=False`` keeps ``loss_scale`` fixed (by default
        512, fastai's; steps with inf/NaN gradients are still skipped). ``clip`` bounds the fp32 gradient
        norm after unscaling. ``skip_limit`` stops training with
        :class:`~mixprec.errors.PersistentOverflowError` after that many consecutive skipped steps, instead
        of skipping for ever when every batch overflows (e.g. NaN in the data).

        Where this differs from fastai v1's ``to_fp16``, on purpose:
            * the masters start from the model's fp32 values, and ``fit`` ends with the model fp32 again,
              holding them; fastai cast the model to fp16 in ``to_fp16`` and made the masters from that
              rounding, again at every ``fit``;
            * an overflowing step is skipped outright, as apex and torch.amp skip it; fastai still called
              its optimizer's step after zeroing the gradients (with torch >= 2, whose ``zero_grad`` sets
              them to None, that step applies only fastai's own weight decay; with torch 1.x Adam's
              moments and step count moved too), and at a static scale (or one at 1) applied the inf/NaN;
            * ``max_scale`` is a ceiling the scale never passes; fastai doubled a scale below it once more
              (48 -> 96 past a ceiling of 64);
            * the scale starts anew at every ``fit`` (as fastai v2's); fastai v1 kept it between fits;
            * ``clip`` is one norm over all masters, as torch and apex clip; fastai clipped each parameter
              group (weights; biases and norm layers) on its own.
        """
        if unknown:
            raise TypeError(_unknown_to_fp16_arguments(unknown))
        recipe = fastai_recipe(torch.float16, loss_scale, max_noskip, dynamic, flat_master, max_scale,
                               loss_fp32, min_scale=min_scale, skip_limit=skip_limit)  # fmt: skip
        return self.to_recipe(recipe.replace(cast_inputs=cast_inputs), clip=clip)

    def to_bf16(
        self, flat_master: bool = False, clip: float | None = None, loss_fp32: bool = True, *,
        cast_inputs: bool = True,
    ) -> Learner:
        """Train in bf16 with fp32 master weights. No loss scaling: bf16 has fp32's exponent range, so
        gradients do not underflow; its 8-bit significand is why the fp32 masters matter even more.
        ``cast_inputs=False`` (here and in ``to_fp16``) leaves the batch's floating inputs as given, where
        fastai v1 casts them to half: for inputs whose low bits matter (coordinates; docs/recipes.md)."""
        recipe = fastai_recipe(torch.bfloat16, flat_master=flat_master, loss_fp32=loss_fp32)
        return self.to_recipe(recipe.replace(cast_inputs=cast_inputs), clip=clip)

    def to_recipe(self, recipe: Recipe | str, clip: float | None = None) -> Learner:
        """Train with any precision recipe: a :class:`~mixprec.recipe.Recipe` or a preset's name
        (``"O1"``, ``"O2"``, ``"fp16-static"``, ... see ``mixprec.recipe.RECIPES``); an fp32 one removes
        mixed precision. ``clip`` bounds the fp32 gradient norm after unscaling."""
        cb = callback_for(get_recipe(recipe), clip)
        self.to_fp32()
        if cb is not None:
            self.mp_cb = cb
            self.add_cb(cb)
        return self

    def to_fp32(self) -> Learner:
        """Back to plain fp32 training: removes every mixed precision callback, as fastai's does (also one
        passed in ``callbacks=``, which ``to_fp16`` would otherwise stack a second one on)."""
        for cb in [c for c in self.callbacks if isinstance(c, MixedPrecision)]:
            self.remove_cb(cb)
        self.mp_cb = None
        return self

    # ------------------------------------------------------------------ training
    def fit(
        self,
        epochs: int | None = None,
        lr: float = DEFAULT_LR,
        callbacks: Iterable[Callback] = (),
        checkpoint: str | os.PathLike[str] | None = None,
        resume: str | os.PathLike[str] | None = None,
        *,
        steps: int | None = None,
    ) -> None:
        """Train for ``epochs`` epochs, or for ``steps`` optimizer steps (language models count steps, not
        epochs), at learning rate ``lr``; ``callbacks`` apply to this fit only. A step-based fit validates
        at every epoch end and after its last step (its last epoch may be cut short). Under
        :class:`~mixprec.callbacks.GradientAccumulation` ``steps`` counts batches, as fastai's
        ``train_iter`` and schedules do (N optimizer steps of k batches each: ``steps=N * k``).

        ``checkpoint``: save everything that decides the next epoch to this file at every epoch end.
        ``resume``: load such a file and train the epochs after it (up to ``epochs`` in all); the fit must
        be set up as the saved one. A resumed fit keeps saving to ``resume`` unless ``checkpoint`` names
        another file."""
        if isinstance(callbacks, int | float):
            raise ConfigError(
                f"fit's third argument is callbacks, and it got {callbacks!r} (fastai's fit(epochs, lr, wd) "
                "takes the weight decay there).",
                "set weight decay on the Learner: Learner(..., wd=1e-4) (matmul weights and embeddings "
                "only), or in opt_func.",
            )
        n_epochs, n_steps = self._fit_length(epochs, steps)
        extra = list(callbacks)
        if checkpoint is not None or resume is not None:
            extra.append(Checkpoint(checkpoint if checkpoint is not None else resume, resume_from=resume))
        try:
            for cb in extra:  # inside: a refused one (add_cb checks it) leaves none of this fit's attached
                self.add_cb(cb)
            self.lr, self.opt = lr, self._make_optimizer(lr)
            self.scaler, self.iteration, self.start_epoch = None, 0, 0
            self.n_epochs, self.n_steps = n_epochs, n_steps
            self._fit()
        finally:
            for cb in extra:
                if cb in self.callbacks:
                    self.remove_cb(cb)

    def _fit_length(self, epochs: int | None, steps: int | None) -> tuple[int, int]:
        """(epochs, steps) of a fit given one of them."""
        for name, value in (("epochs", epochs), ("steps", steps)):
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}.", f"e.g. learn.fit({name}=3).")
        if (epochs is None) == (steps is None):
            raise ConfigError(
                f"fit needs exactly one of epochs and steps, got epochs={epochs!r}, steps={steps!r}.",
                "e.g. learn.fit(3) for three epochs, or learn.fit(steps=500).",
            )
        per_epoch = len(self.data.train)
        if steps is None:
            return epochs, epochs * per_epoch  # type: ignore[operator,return-value]
        return math.ceil(steps / per_epoch), steps

    def _make_optimizer(self, lr: float) -> torch.optim.Optimizer:
        # The trainable parameters only, as fastai's default splitter (trainable_params): a frozen one in
        # the optimizer would get an fp32 master under to_fp16() (4 bytes each: a LoRA's frozen base).
        params = trainable_params(self.model) if self.wd is None else decay_groups(self.model, self.wd)
        if not params:
            raise ConfigError(
                f"every parameter of the {type(self.model).__name__} is frozen (requires_grad=False): "
                "fit has nothing to train.",
                "unfreeze what should train (p.requires_grad_(True)), or use learn.validate() / "
                "learn.get_preds() to evaluate a frozen model.",
            )
        opt = self.opt_func(params, lr=lr)
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(
                f"opt_func returned a {type(opt).__name__}, not a torch.optim.Optimizer.",
                "make opt_func(params, lr=lr) return an optimizer, e.g. torch.optim.AdamW(params, lr=lr).",
            )
        return opt

    def fit_one_cycle(
        self,
        epochs: int | None = None,
        lr_max: float | None = None,  # None: DEFAULT_LR (or max_lr)
        div_factor: float = 25.0,
        pct_start: float = 0.3,
        final_div: float | None = None,
        moms: tuple[float, float] = (0.95, 0.85),
        checkpoint: str | os.PathLike[str] | None = None,
        resume: str | os.PathLike[str] | None = None,
        *,
        steps: int | None = None,
        callbacks: Iterable[Callback] = (),
        max_lr: float | None = None,
    ) -> None:
        """Train with the 1cycle schedule (:class:`~mixprec.callbacks.OneCycleScheduler`) over ``epochs``
        or ``steps``; ``checkpoint`` and ``resume`` as in :meth:`fit` (resume with the same length: the
        schedule spans it all); ``callbacks`` for this fit only, beside the schedule (fastai v1's
        ``fit_one_cycle(..., callbacks=)``: ``GradientClipping``, say). ``max_lr`` is fastai v1's name for
        ``lr_max`` (v2's), taken as it."""
        if lr_max is not None and max_lr is not None:
            raise ConfigError(f"fit_one_cycle got lr_max={lr_max!r} and max_lr={max_lr!r}: one rate.",
                              "pass one of them (max_lr is fastai v1's name for lr_max).")  # fmt: skip
        lr_max = next((r for r in (lr_max, max_lr) if r is not None), DEFAULT_LR)
        if isinstance(div_factor, tuple | list):  # v1's moms, a pair
            raise ConfigError(
                f"fit_one_cycle's third argument is div_factor, and it got {div_factor!r} (fastai v1's order "
                "is fit_one_cycle(epochs, max_lr, moms, div_factor, ...)).",
                "pass moms= and div_factor= by keyword: learn.fit_one_cycle(epochs, lr, moms=(0.95, 0.85)).",
            )
        sched = OneCycleScheduler(lr_max, div_factor, pct_start, final_div, moms)
        self.fit(epochs, lr_max / div_factor, [sched, *callbacks], checkpoint, resume, steps=steps)

    def _fit(self) -> None:
        try:
            self._event("on_train_begin")
            start, end = self.start_epoch, self.n_epochs  # after on_train_begin: a resume moves start
            for self.epoch in range(start, end):
                self._event("on_epoch_begin")
                self._train_epoch()
                self.valid_loss, self.valid_metrics = self._evaluate(self.data.valid, events=True)
                self._event("on_epoch_end")
        except CancelTrainException:
            pass
        finally:
            self.training = False
            self._event("on_train_end")

    def _train_epoch(self) -> None:
        self.model.train()
        self.training = True
        for xb, yb in _pairs(self.data.train):
            if self.iteration >= self.n_steps:  # a step-based fit ends mid-epoch
                break
            self._train_batch(xb, yb)
            self.iteration += 1

    def _train_batch(self, xb: Tensor, yb: Tensor) -> None:
        self.loss = None  # type: ignore[assignment]  # until this batch computes one (a cancel may come first)
        try:
            self._forward(xb, yb, events=True)
            self.loss_grad = self.loss
            self._event("on_backward_begin")
            self.loss_grad.backward()
            self._step()
        except CancelBatchException:
            # fastai's meaning: the rest of this batch is skipped, zero_grad included, so its gradients stay
            # for the next batch to add to (GradientAccumulation); no step was taken.
            self._check_cancelled_before_step()
            self._cancelled = True
        self._event("on_batch_end")

    def _check_cancelled_before_step(self) -> None:
        """A batch cancelled after the scaler unscaled its gradients (into the masters) would leave the
        next batch adding scaled gradients to unscaled ones, and the scaler refusing a second unscale."""
        if self.scaler is None or not self.scaler.is_enabled():
            return
        state = self.scaler._per_optimizer_states.get(id(self._optimizer))
        if state is not None and state["stage"] is not OptState.READY:  # unscaled, or stepped already
            raise ConfigError(
                "CancelBatchException was raised after the loss scaler unscaled this batch's gradients "
                "(MixedPrecision's on_backward_end, order 100, had run) or stepped.",
                "raise it before the step, from a callback ordered before MixedPrecision (order < 100, as "
                "GradientAccumulation is) in on_backward_end at the latest, or raise CancelStepException to "
                "skip the step and clear the gradients.",
            )

    def _forward(self, xb: Tensor | Sequence[Tensor], yb: Tensor, events: bool) -> None:
        device = self.device
        # xb: one tensor (or anything with .to: a tokenizer's batch), or a tuple/list of the model's several
        # inputs (fastai's model(*xb))
        several = isinstance(xb, (tuple, list))
        self.xb = map_tensors(lambda t: t.to(device), xb) if several else xb.to(device)  # type: ignore[union-attr]
        # yb: one target tensor, or a tuple/list of them (CTC's targets and their lengths): fastai v2 calls
        # loss_func(pred, *yb) and metric(pred, *yb)
        self.yb = map_tensors(lambda t: t.to(device), yb)
        if events:
            self._event("on_batch_begin")
        inputs = tuple(self.xb) if several else (self.xb,)  # (a callback's cast keeps the container)
        model_loss = None
        if self.loss_func is None:
            self.pred, model_loss = _pred_and_loss(self.model(*inputs, *_targets(self.yb)))
        else:
            self.pred = self.model(*inputs)
        if events:
            self._event("on_loss_begin")
        if model_loss is not None:
            # The model's own loss goes on in fp32 like a loss_func's (exact: every fp16 or bf16 value is an
            # fp32 value), so the Recorder's averages and the scaled loss are fp32 whatever the model used.
            self.loss = model_loss.float()
        else:
            if self.loss_func is F.cross_entropy or isinstance(self.loss_func, nn.modules.loss._Loss):
                _check_prediction(self.pred)  # torch's losses take tensors only
            self.loss = self.loss_func(self.pred, *_targets(self.yb))  # type: ignore[misc]
            _check_loss(self.loss)

    def _step(self) -> None:
        self._cancelled = False
        try:
            self._event("on_backward_end")  # a callback may cancel the step
            opt = self._optimizer  # callbacks may have wrapped learn.opt (MasterWeights): read it now
            if self.scaler is not None and self.scaler.is_enabled():
                # The scaler unscales (into the fp32 masters), checks for inf/NaN and skips: on the device
                # when the optimizer is fused (no sync), else with one sync.
                self.scaler.step(opt)
            else:
                opt.step()
        except CancelStepException:
            self._cancelled = True
        self._event("on_step_end")
        self._optimizer.zero_grad()

    def step_skipped_async(self) -> bool | Tensor:
        """Whether this iteration's step was skipped, without a sync: a Python bool when a callback
        cancelled it (CancelStepException, or CancelBatchException: a GradientAccumulation micro-batch takes
        no step) or no scaler took part, else the scaler's 0-dim device flag (True: inf/NaN found)."""
        if self._cancelled:
            return True
        if self.scaler is None or not self.training:
            return False
        flag = self.scaler.skipped_async()
        return False if flag is None else flag

    @property
    def step_skipped(self) -> bool:
        """Whether this iteration's optimizer step was skipped (cancelled, or inf/NaN gradients). Read from
        the scaler, so it syncs when a scaler took part: read it when you need it, not every step."""
        return bool(self.step_skipped_async())

    @property
    def _optimizer(self) -> torch.optim.Optimizer:
        assert self.opt is not None, "fit() creates the optimizer before the first batch"
        return self.opt

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def _evaluate(self, dl: DataLoader, events: bool) -> tuple[float, list[float]]:
        self.model.eval()
        self.training = False
        total = 0
        # Sums stay on the device (fp64: many batches), converted once at the end: a float() per batch
        # would wait for the device at every batch.
        sums: list[Tensor] = []
        cancelled = 0
        for xb, yb in _pairs(dl):
            try:
                self._forward(xb, yb, events)
            except CancelBatchException:  # fastai's meaning in validation too: this batch is left out
                cancelled += 1
                if events:
                    self._event("on_batch_end")
                continue
            n = self.batch_size
            total += n
            values = [self.loss, *(metric(self.pred, *_targets(self.yb)) for metric in self.metrics)]
            batch = torch.stack([v.detach().double().reshape(()) for v in values]) * n
            sums.append(batch)
            if events:
                self._event("on_batch_end")
        if total == 0 and cancelled:
            raise ConfigError(
                "Every validation batch was cancelled (CancelBatchException): no loss to report.",
                "let at least one validation batch run (check self.training in the callback).",
            )
        if total == 0:
            raise ConfigError("The validation set is empty.", "build the data with a valid_pct > 0.")
        loss_sum, *metric_sums = torch.stack(sums).sum(0).tolist()
        return loss_sum / total, [s / total for s in metric_sums]

    def validate(self, dl: DataLoader | None = None) -> list[float]:
        """``[loss, *metrics]`` on ``dl`` (default: the validation set), with the model as it is now.

        Outside ``fit`` no callback runs: after mixed precision training the model is fp32 again (holding
        the masters' values), so this evaluates in fp32."""
        loss, metrics = self._evaluate(self.data.valid if dl is None else dl, events=False)
        return [loss, *metrics]

    @torch.no_grad()
    def predict(self, x: Tensor | Sequence[Tensor]) -> Tensor:
        """The model's output (fp32, eval mode, no gradient) for a batch ``x``, or for one sample (then
        without the batch dimension); ``predict(x).argmax(-1)`` is the class. One sample has as many
        dimensions as ``data.input_shape`` (its sizes may differ: a prompt shorter than the context). A
        model of several inputs takes a batch of them as its loader yields it (``(tokens, lengths)``:
        ``model(*x)``)."""
        several = isinstance(x, (tuple, list))
        single = not several and x.dim() == len(self.data.input_shape)  # type: ignore[union-attr]
        if single:
            x = x.unsqueeze(0)  # type: ignore[union-attr]
        device = self.device
        inputs = map_tensors(lambda t: t.to(device), tuple(x) if several else (x,))
        self.model.eval()
        out = self.model(*inputs)
        if self.loss_func is None:
            out = _prediction(out)  # (logits, loss) models return (logits, None) without targets
        # several outputs (a CTC model's log-probs and lengths) keep their container; floating ones go fp32
        out = map_tensors(lambda t: t.float() if t.is_floating_point() else t, out)
        return map_tensors(lambda t: t[0], out) if single else out

    def get_preds(self, split: str = "valid") -> tuple[Tensor, Tensor]:
        """(outputs, targets) over a whole split, "valid" or "train" (in loader order). Batch-first outputs
        whose batches differ beyond the batch dimension (padded per batch) come back as a list of
        per-sample tensors, as fastai's get_preds gives them (a seq-first output would be split by time
        step: transpose it in the model or the loss)."""
        loaders = {"valid": self.data.valid, "train": self.data.train}
        if split not in loaders:
            raise ConfigError(f"split must be 'valid' or 'train', got {split!r}.", "use split='valid'.")
        preds, targs = zip(*[(self.predict(xb), yb) for xb, yb in _pairs(loaders[split])], strict=True)
        return _concatenated(preds), _concatenated(targs)

    def __repr__(self) -> str:
        cbs = ", ".join(repr(c) for c in self.callbacks)
        return f"Learner(data={self.data.name!r}, model={type(self.model).__name__}, callbacks=[{cbs}])"

