"""Tensors in nested containers, as real models take and return them."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import torch

from mixprec.tree import cast_floating, iter_tensors


class FakeModelOutput(OrderedDict):
    """An unregistered OrderedDict subclass with attribute access, as HF's ModelOutput."""

    def __getattr__(self, name: str) -> object:
        try:
            return self[name]
        except KeyError as err:
            raise AttributeError(name) from err


Pair = namedtuple("Pair", "x ids")


def test_namedtuple_ordered_dict_and_mapping_subclasses_are_cast() -> None:
    half, ids = torch.ones(2, dtype=torch.float16), torch.arange(2)
    value = [Pair(half, ids), OrderedDict(a=half), FakeModelOutput(logits=half, labels=ids), {"k": (half,)}]
    out = cast_floating(value, torch.float32)
    assert isinstance(out[0], Pair) and out[0].x.dtype == torch.float32 and out[0].ids.dtype == torch.int64
    assert type(out[1]) is OrderedDict and out[1]["a"].dtype == torch.float32
    assert type(out[2]) is FakeModelOutput and out[2].logits.dtype == torch.float32
    assert out[3]["k"][0].dtype == torch.float32
    assert value[2]["logits"].dtype == torch.float16  # the input is not changed in place


def test_only_limits_which_dtypes_are_cast() -> None:
    out = cast_floating((torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.float16)),
                        torch.float32, only=(torch.float16,))  # fmt: skip
    assert [t.dtype for t in out] == [torch.float64, torch.float32]


def test_iter_tensors_finds_every_tensor() -> None:
    a, b = torch.zeros(1), torch.ones(1)
    found = list(iter_tensors({"x": Pair(a, 3), "y": FakeModelOutput(z=b)}))
    assert len(found) == 2 and any(t is a for t in found) and any(t is b for t in found)
