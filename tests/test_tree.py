"""Tensors in nested containers, as real models take and return them."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import torch

import mixprec
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


@dataclasses.dataclass(frozen=True)
class _Output:
    logits: torch.Tensor
    extras: dict[str, torch.Tensor]
    name: str = "out"


def test_a_dataclass_output_is_cast_and_keeps_its_type() -> None:
    """A model returning a plain @dataclass kept half logits under O1/O2 (its loss outside ran in half),
    where namedtuples, dicts and ModelOutputs came back fp32."""
    out = _Output(torch.ones(2, dtype=torch.bfloat16), {"h": torch.ones(1, dtype=torch.float16)}, "mine")
    cast = cast_floating(out, torch.float32, dataclasses=True)
    assert type(cast) is _Output and cast.name == "mine"
    assert cast.logits.dtype == cast.extras["h"].dtype == torch.float32
    assert out.logits.dtype == torch.bfloat16  # the model's own record is not changed


@dataclasses.dataclass
class _Cache:
    k: torch.Tensor | None = None
    pos: int = 0
    parent: object = None


def test_an_input_dataclass_is_passed_as_it_is_and_back_references_end_the_walk() -> None:
    """An input record may be a cache the forward writes into: a copy would lose the writes."""
    cache = _Cache(torch.ones(1))
    assert cast_floating((cache,), torch.float16)[0] is cache
    cache.parent = _Output(torch.ones(1), {"cache": cache})  # type: ignore[arg-type]
    cast = cast_floating(cache, torch.float16, dataclasses=True)
    assert cast.k.dtype == cast.parent.logits.dtype == torch.float16 and cast.parent.extras["cache"] is cache


def test_an_o2_model_returning_a_dataclass_gives_fp32_logits() -> None:
    model = torch.nn.Linear(4, 3)
    forward = model.forward
    model.forward = lambda x: _Output(forward(x), {})  # type: ignore[method-assign]
    model, opt = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", verbosity=0)
    try:
        assert model(torch.randn(2, 4)).logits.dtype == torch.float32
    finally:
        mixprec.amp.reset()
