"""The fp32 masters of one param group and their gradients: per parameter, or one flat buffer.

``MasterWeights`` (master.py) owns the protocol (when to copy, step, copy back); this module owns the
tensors. Rules every layout keeps, because torch.optim keeps them for its own parameters:

* A parameter without a gradient in a step is not stepped: its master has no ``.grad`` (per parameter).
  A flat buffer has no holes, so its slices without a gradient get a zero gradient for the kernel and are
  put back afterwards (:class:`HoleGuard`): the master and the optimizer's per-element state there end the
  step as they began it.
* Frozen parameters (``requires_grad=False``) never enter a flat buffer (fastai's ``flat_master`` rule);
  they get a master of their own, so unfreezing them later trains them like any other parameter.
* A group with no gradient at all in a step detaches its master gradients: a master never steps on a
  gradient left over from an earlier step (the case of loops that clear grads with ``model.zero_grad()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec.errors import ConfigError, UnsupportedParameterError

__all__ = ["GroupMasters", "HoleGuard", "make_masters", "views_like"]


def views_like(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive views of ``flat`` shaped like the tensors of ``like``."""
    views, offset = [], 0
    for p in like:
        views.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return views


def _no_sparse(model: list[torch.Tensor]) -> None:
    sparse = [p for p in model if p.grad is not None and p.grad.is_sparse]
    if sparse:
        p = sparse[0]
        raise UnsupportedParameterError(
            f"A parameter with an fp32 master ({p.dtype} now, shape {tuple(p.shape)}) has a sparse gradient; "
            "fp32 master weights are dense, and a dense copy of an embedding's gradient costs as much as the "
            "embedding.",
            "keep the table fp32 (it is then its own master and its sparse gradient goes to its optimizer, "
            "e.g. torch.optim.SparseAdam): initialize and the Learner keep nn.Embedding and nn.EmbeddingBag "
            "built with sparse=True fp32 when they cast the model (a model cast by hand: leave the table out "
            "of the cast). A table cast to fp32 after initialize keeps the master made for it. Or build the "
            "embedding with sparse=False.",
        )


@dataclass
class GroupMasters:
    """The model's half parameters of one param group and the fp32 tensors that shadow them."""

    model: list[torch.Tensor]  # half-precision model parameters, in group order
    views: list[torch.Tensor]  # their fp32 masters, same order (views of `flat` where `in_flat`)
    flat: torch.Tensor | None  # the contiguous fp32 buffer of the flat layout's trainable params, else None
    in_flat: list[bool]  # which of `model` live in `flat`
    # Persistent fp32 gradient storage, allocated once and re-attached as `.grad` after each
    # zero_grad(set_to_none): users see None between iterations, the step allocates nothing.
    # False for the fused step that reads the half gradients itself (master_fused.py).
    keep_grads: bool = True
    buffers: list[torch.Tensor | None] = field(default_factory=list)  # per master, allocated on first use
    flat_grad: torch.Tensor | None = None
    holes: list[int] = field(default_factory=list)  # flat members without a gradient in this step
    # each model parameter's version counter when the masters last wrote it (or were made from it): one
    # that moved since was written by someone else (model.load_state_dict, DDP's broadcast, an edit)
    versions: list[int] = field(default_factory=list)
    # whether every parameter was compared by value once (the first take_model_edits): writes through
    # .data move no version counter, and a data-dependent init (Glow's ActNorm) writes so in the first forward
    values_compared: bool = False

    def record_versions(self) -> None:
        self.versions = [p._version for p in self.model]

    @torch.no_grad()
    def take_model_edits(self) -> None:
        """Masters of model parameters written since :meth:`record_versions` take the model's values,
        which their next rounding would overwrite otherwise: element by element, each changed element's
        exact upcast (its fp32 bits below the half value are gone, as in apex, whose masters are made from
        the model at the first step); an element still at the value its master rounds to keeps its master,
        so a write of a few rows (an Embedding's max_norm, a clamp) leaves the others' fp32 bits alone.
        Writes through ``.data`` do not move a version counter: those before the first call (the first
        forward's data-dependent init, rosinality's Glow) are found by comparing every value once, later
        ones are not seen."""
        now = [p._version for p in self.model]
        if now != self.versions or not self.values_compared:  # one list comparison in the usual case
            every = not self.values_compared
            for p, master, old, new in zip(self.model, self.views, self.versions, now, strict=True):
                if new != old or every:
                    master.copy_(torch.where(master.to(p.dtype) == p, master, p.float()))
        self.versions, self.values_compared = now, True

    def shadow(self) -> list[torch.Tensor]:
        """What the optimizer sees in place of ``model``: the flat buffer, then the masters outside it."""
        alone = [v for v, f in zip(self.views, self.in_flat, strict=True) if not f]
        return ([self.flat] if self.flat is not None else []) + alone

    def relink(self) -> None:
        """Make the flat members views of ``flat`` again. Plain pickle saves each tensor with its own copy
        of the memory, so after a round trip the step would update the buffer while the model kept being
        rounded from the stale copies (torch.save and deepcopy keep the views). Gradient storage is made
        anew on first use."""
        if self.flat is None:
            return
        # of the buffer's data, as make_masters makes them: leaves, which deepcopy and .numpy() accept
        inside = [v for v, f in zip(self.views, self.in_flat, strict=True) if f]
        members = iter(views_like(self.flat.detach(), inside))
        self.views = [next(members) if f else v for v, f in zip(self.views, self.in_flat, strict=True)]
        self.buffers, self.flat_grad = [], None

    def _buffer(self, i: int) -> torch.Tensor:
        if not self.buffers:
            self.buffers = [None] * len(self.views)
            if self.flat is not None:
                self.flat_grad = torch.empty_like(self.flat)
                members = [v for v, f in zip(self.views, self.in_flat, strict=True) if f]
                inner = iter(views_like(self.flat_grad, members))
                self.buffers = [next(inner) if f else None for f in self.in_flat]
        buffer = self.buffers[i]
        if buffer is None:
            buffer = self.buffers[i] = torch.empty_like(self.views[i])
        return buffer

    def grads_without_model_grad(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model parameter, master gradient) where the master holds a gradient the model's ``.grad`` does
        not (another loss's of this iteration, added to the masters after this loss's were copied). A
        flat buffer's entries are left out: there such a gradient's slice was recorded as a hole."""
        return [(p, master.grad) for master, p, f in zip(self.views, self.model, self.in_flat, strict=True)
                if not f and p.grad is None and master.grad is not None]

    def attach_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Attach the fp32 gradient storage where the model has a gradient, detach it elsewhere, and
        return the (fp32 master grad, half model grad) pairs to copy. Flat holes are zeroed and recorded."""
        _no_sparse(self.model)
        if not self.keep_grads:
            return [], []
        have = [p.grad is not None for p in self.model]
        dst, src, self.holes = [], [], []
        for i, (master, p, h, f) in enumerate(zip(self.views, self.model, have, self.in_flat, strict=True)):
            if h:
                dst.append(self._buffer(i))
                src.append(p.grad)
            elif f:
                self.holes.append(i)
            if not f:
                master.grad = self._buffer(i) if h else None
        if self.flat is not None:
            in_step = any(h for h, f in zip(have, self.in_flat, strict=True) if f)
            self.flat.grad = self.flat_grad if in_step else None
            if in_step and self.holes:
                torch._foreach_zero_([self._buffer(i) for i in self.holes])
            if not in_step:
                self.holes = []
        return dst, src


class HoleGuard:
    """Puts back the slices of a flat buffer (master and per-element optimizer state) whose parameters
    had no gradient in this step: the optimizer stepped the whole buffer, torch.optim would not have
    touched them. State the optimizer created in this very step is zeroed there, torch's initial value
    for SGD momentum, Adam(W) and RMSprop. The ``step`` count of Adam-like optimizers is one number per
    buffer and cannot be put back per slice: use ``flat=False`` when parameters of an Adam group skip
    steps and the bias correction of their first step matters. Costs a copy of the holes only."""

    def __init__(self, groups: list[GroupMasters], state: Mapping[torch.Tensor, Any]) -> None:
        self._state = state
        # per flat buffer with holes: (buffer, hole ranges, kept slices by state key; None = the master)
        self._saved: list[tuple[torch.Tensor, list[tuple[int, int]], dict[str | None, list[torch.Tensor]]]]
        self._saved = []
        for g in groups:
            if g.flat is None or not g.holes:
                continue
            ranges = [(g.views[i].storage_offset(), g.views[i].numel()) for i in g.holes]
            tensors = {None: g.flat.detach(), **_per_element(state.get(g.flat, {}), g.flat)}
            kept = {k: [t[o : o + n].clone() for o, n in ranges] for k, t in tensors.items()}
            self._saved.append((g.flat, ranges, kept))

    def restore(self) -> None:
        with torch.no_grad():
            for flat, ranges, kept in self._saved:
                tensors = {None: flat.detach(), **_per_element(self._state.get(flat, {}), flat)}
                for key, tensor in tensors.items():
                    holes = [tensor[o : o + n] for o, n in ranges]
                    if key in kept:
                        torch._foreach_copy_(holes, kept[key])
                    else:
                        torch._foreach_zero_(holes)


def _per_element(state: Mapping[str, Any], flat: torch.Tensor) -> dict[str | None, torch.Tensor]:
    """The optimizer state tensors with one value per element of the flat buffer (moments, momentum)."""
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == flat.shape}


def make_masters(
    half: list[torch.Tensor], flat: bool, initial: Mapping[torch.Tensor, torch.Tensor], keep_grads: bool
) -> GroupMasters:
    """fp32 copies of ``half``, or of their fp32 values in ``initial`` (what they were before rounding).
    Converting fp16/bf16 to fp32 is exact, so without ``initial`` the masters start equal to the model.
    With ``flat``, the trainable parameters share one buffer; frozen ones get masters of their own."""
    values = [initial.get(p, p).detach() for p in half]
    in_flat = [flat and p.requires_grad for p in half]
    with torch.no_grad():
        # clone: .float() of an fp32 value is that tensor, and a master must never alias the model
        pairs = zip(values, in_flat, strict=True)
        alone = [None if f else v.float().clone().requires_grad_(True) for v, f in pairs]
        if not any(in_flat):
            return GroupMasters(half, alone, None, in_flat, keep_grads)  # type: ignore[arg-type]
        devices = {p.device for p, f in zip(half, in_flat, strict=True) if f}
        if len(devices) > 1:
            raise ConfigError(
                f"flat=True needs one device per param group, found {sorted(map(str, devices))}.",
                "put parameters of different devices in separate param groups, or use flat=False.",
            )
        members = [v for v, f in zip(values, in_flat, strict=True) if f]
        buffer = torch.cat([v.reshape(-1).float() for v in members]).requires_grad_(True)
        inner = iter(views_like(buffer.detach(), members))
        views = [next(inner) if f else a for a, f in zip(alone, in_flat, strict=True)]
        return GroupMasters(half, views, buffer, in_flat, keep_grads)


@dataclass
class _Mirrored:
    """A model gradient we overwrote with the unscaled master gradient (rounded to the model's dtype)."""

    param: torch.Tensor  # the half model parameter
    master_grad: torch.Tensor  # the fp32 gradient the step reads
    grad: torch.Tensor  # the half gradient tensor we wrote
    version: int  # its version counter after our write: any in-place edit (a clip) bumps it
    master_version: int  # the master gradient's, after our last write of it

    def edited(self) -> bool:
        """The model's gradient was edited (or replaced) since, and the master's was not: once the master
        gradient itself was edited (``opt.clip_grad_norm_``, a clip of ``master_params``), it is what the
        step uses, whatever touches the model's gradient later (a norm logged with
        ``clip_grad_norm_(model.parameters(), inf)`` multiplies it by 1 in place)."""
        grad = self.param.grad
        model_edited = grad is not None and (grad is not self.grad or grad._version != self.version)
        return model_edited and self.master_grad._version == self.master_version

    def taken(self) -> None:
        """After the model's gradient was copied into the master's: both are the new reference."""
        self.grad = self.param.grad
        self.version, self.master_version = self.grad._version, self.master_grad._version


class GradMirror:
    """Makes torch.amp's clipping recipe work on the fp32 master gradients: after the scaler unscaled them,
    :meth:`mirror` writes them into the model's ``.grad``, where ``clip_grad_norm_(model.parameters())``
    reads and scales them; :meth:`take_edits` copies whatever was edited there back into the masters'
    gradients before the step (the version counters tell which, at no cost)."""

    def __init__(self) -> None:
        self.copied: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (param, master grad, grad)
        self.mirrored: list[_Mirrored] = []

    def reset(self) -> None:
        self.copied, self.mirrored = [], []

    @torch.no_grad()
    def mirror(self, write: bool = True) -> None:
        """``write=False``: the master gradients are still the exact upcasts of the model's, whose rounding
        is the model's gradient itself (bit for bit): only record them, for :meth:`take_edits`."""
        if self.copied:
            if write:
                torch._foreach_copy_([h for _, _, h in self.copied], [m for _, m, _ in self.copied])  # round
            self.mirrored = [_Mirrored(p, m, h, h._version, m._version) for p, m, h in self.copied]

    @torch.no_grad()
    def remirror(self) -> None:
        """After a clip of the master gradients by the wrapper itself (``opt.clip_grad_norm_``): the model's
        ``.grad`` show it too, and an edit of them after this one is taken again."""
        live = [m for m in self.mirrored if m.param.grad is not None]
        if live:
            torch._foreach_copy_([m.param.grad for m in live], [m.master_grad for m in live])  # round
        for m in live:
            m.taken()

    @torch.no_grad()
    def take_edits(self, keep_watching: bool = False) -> None:
        """Copy the model gradients edited since the mirror (and whose master gradients were not) into the
        master gradients. ``keep_watching``: not before a step -- edits made after this one are taken
        again (the step's own call)."""
        edited = [m for m in self.mirrored if m.edited()]
        # kept watching: the masters the user edited since (they win), judged before our copy bumps their
        # version counters (flat masters are views of one buffer and share one counter)
        theirs = [m.master_grad._version != m.master_version for m in self.mirrored] if keep_watching else []
        # Whole tensors, as the model holds them (their half rounding): an element-wise "keep the master
        # where the model's value is still its rounding" took 35 ms against this copy's 2 ms (the GPT's
        # 14.8M gradients), every step of torch.amp's clip recipe.
        if edited:
            torch._foreach_copy_([m.master_grad for m in edited], [m.param.grad for m in edited])
        if not keep_watching:
            self.mirrored = []
            return
        for m in edited:
            m.taken()
        for m, user_edited in zip(self.mirrored, theirs, strict=True):
            if not user_edited:  # our copy moved a shared counter: still ours
                m.master_version = m.master_grad._version
