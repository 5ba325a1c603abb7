"""Tensors inside nested containers: a model's inputs and outputs, an op's arguments.

Built on torch's pytree, which knows lists, tuples, dicts, namedtuples, OrderedDict and every class a
library registered (HF's ``ModelOutput`` registers itself). A Mapping that pytree does not know (a dict
subclass, an unregistered ``ModelOutput`` look-alike) is walked too: its copy gets the mapped values, so
its type and attributes survive. A dataclass instance is walked the same way only when asked
(``dataclasses=True``: a model's outputs): an input dataclass may be a cache the forward writes into,
whose copy would lose the writes. Anything else is left as it is.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["map_tensors", "iter_tensors", "cast_floating"]

TensorFn = Callable[[torch.Tensor], torch.Tensor]


def _map_leaf(fn: TensorFn, leaf: Any, records: bool, seen: tuple[int, ...]) -> Any:
    if isinstance(leaf, torch.Tensor):
        return fn(leaf)
    if isinstance(leaf, MutableMapping):  # a Mapping pytree does not know: keep its type and attributes
        return _copy_mapped(fn, leaf, records, seen, leaf.items(), type(leaf).__setitem__)
    if records and dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):  # an instance
        # hasattr: a field(init=False) may be unset; object.__setattr__: frozen dataclasses too
        fields = [(f.name, getattr(leaf, f.name)) for f in dataclasses.fields(leaf) if hasattr(leaf, f.name)]
        return _copy_mapped(fn, leaf, records, seen, fields, object.__setattr__)
    return leaf


def _copy_mapped(
    fn: TensorFn,
    leaf: Any,
    records: bool,
    seen: tuple[int, ...],
    items: Any,
    put: Callable[[Any, Any, Any], Any],
) -> Any:
    """A copy of ``leaf`` whose ``items`` are mapped and ``put`` back; a back-reference (a record holding its
    parent) is left as it is."""
    if id(leaf) in seen:
        return leaf
    out = copy.copy(leaf)
    for key, value in items:
        put(out, key, _map(fn, value, records, (*seen, id(leaf))))
    return out


def _map(fn: TensorFn, value: Any, records: bool, seen: tuple[int, ...]) -> Any:
    if isinstance(value, torch.Tensor):  # the common case, without pytree's flatten/unflatten
        return fn(value)
    return pytree.tree_map(lambda leaf: _map_leaf(fn, leaf, records, seen), value)


def map_tensors(fn: TensorFn, value: Any, *, dataclasses: bool = False) -> Any:
    """``value`` with ``fn`` applied to every tensor in it, containers rebuilt with their own types
    (dataclass instances too with ``dataclasses=True``, as copies)."""
    return _map(fn, value, dataclasses, ())


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value``, in pytree order."""
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            yield leaf
        elif isinstance(leaf, Mapping):
            for item in leaf.values():
                yield from iter_tensors(item)


def cast_floating(
    value: Any, dtype: torch.dtype, only: tuple[torch.dtype, ...] | None = None, *, dataclasses: bool = False
) -> Any:
    """``value`` with its floating tensors cast to ``dtype`` (only those of a dtype in ``only``, if
    given); integer tensors (token ids, labels) are left alone. ``dataclasses``: see :func:`map_tensors`."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dtype == dtype or (only is not None and t.dtype not in only):
            return t
        return t.to(dtype)

    return map_tensors(cast, value, dataclasses=dataclasses)
