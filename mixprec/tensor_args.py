"""Walking the tensors in an op's arguments: nested lists, tuples and dicts of exactly those types.

torch passes op arguments in these shapes, so an exact-type walk is all the cast engine needs, and it is
several times cheaper per call than ``torch.utils._pytree`` (this runs once per intercepted op). For model
inputs and outputs of any shape (namedtuples, ``OrderedDict``, registered classes) use torch's pytree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["iter_tensors", "map_tensors"]


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """Apply ``fn`` to every tensor in nested lists, tuples and dicts (the shapes of op arguments)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    kind = type(value)
    if kind is tuple or kind is list:
        # a list comprehension, tensors mapped in place: a generator and a call per element cost ~2 us
        # more for an op's three arguments, on every op the cast engine changes
        return kind([fn(v) if isinstance(v, torch.Tensor) else map_tensors(fn, v) for v in value])
    if kind is dict:
        return {k: map_tensors(fn, v) for k, v in value.items()} if value else value
    return value


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in nested lists, tuples and dicts (exact types, as torch passes op arguments)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif type(value) in (list, tuple):
        for v in value:
            yield from iter_tensors(v)
    elif type(value) is dict:
        for v in value.values():
            yield from iter_tensors(v)
