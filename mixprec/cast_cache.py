"""The cast cache of an autocast region: each fp32 parameter cast once per region, reused by every op."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from mixprec.func_transforms import inside_transform

__all__ = ["CastCache"]

_Entry = tuple["weakref.ref[torch.Tensor]", int, torch.Tensor]


class CastCache:
    """Casts of fp32 parameters, made once per region and reused by every op that reads them.

    Keyed by the tensor's id; a weakref guards against a new tensor reusing a freed id, the version
    counter against in-place updates (e.g. an optimizer step inside the region), and the grad mode
    against reusing a cast made under no_grad (which has no graph) for a forward that needs one.
    Compiled code does not use it (its keys would become Dynamo guards that change every step); there
    the compiler deduplicates the casts itself.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, object, bool], _Entry] = {}

    def get(self, tensor: torch.Tensor, kind: object, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        if inside_transform():  # a cast made at a torch.func level has no autograd link outside it
            return make()
        return self.get_outside_transforms(tensor, kind, make)

    def get_outside_transforms(
        self, tensor: torch.Tensor, kind: object, make: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """:meth:`get` for a caller that has checked that no torch.func transform is running (once per op,
        where ``get`` checks once per tensor)."""
        key = (id(tensor), kind, torch.is_grad_enabled())
        hit = self._entries.get(key)
        if hit is not None and hit[0]() is tensor and hit[1] == tensor._version:
            return hit[2]
        value = make()
        self._entries[key] = (weakref.ref(tensor), tensor._version, value)
        return value

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
