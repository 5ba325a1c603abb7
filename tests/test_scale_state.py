"""The scaler's settings and state as one record each (issue 13 item 4), and every way a scale enters is
validated (issue 14 items 1, 4, 9): references are torch.amp.GradScaler's behaviour and IEEE-754 values."""

from __future__ import annotations

import collections
import copy
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from mixprec.errors import ConfigError, PersistentOverflowError, ScalerStateError
from mixprec.scale_state import ScaleState
from mixprec.scaler import GradScaler


def _net() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _iterate(scaler: Any, model: nn.Module, opt: torch.optim.Optimizer, poison: bool) -> None:
    scaler.scale(model(torch.ones(3, 4)).square().mean()).backward()
    if poison:
        model.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


# ------------------------------------------------------------------------------------------ the record
def test_record_round_trips_through_the_device() -> None:
    values = dict(
        scale=256.0, growth_tracker=3, hysteresis_left=2, skipped=7, last_skipped=True, consecutive=2
    )
    state = ScaleState(**values, history=[1024.0, 512.0, 256.0], updates=3, history_size=4)  # type: ignore[arg-type]
    dev = state.to_device(torch.device("cpu"))
    assert dev.scale.dtype is torch.float32 and dev.growth_tracker.dtype is torch.int32
    fresh = ScaleState(scale=0.0, history_size=4, updates=3, device=dev).to_python()
    assert {k: getattr(fresh, k) for k in values} == values
    assert fresh.history == [1024.0, 512.0, 256.0]


def test_state_dict_has_torch_entries_and_pickle_uses_it() -> None:
    ours, ref = (
        GradScaler("cpu", init_scale=2.0**10, growth_interval=2),
        torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2),
    )
    for scaler in (ours, ref):
        model, opt = _net()
        for i in range(7):
            _iterate(scaler, model, opt, poison=i in {1, 4})
    mine, theirs = ours.state_dict(), ref.state_dict()
    assert {k: mine[k] for k in theirs} == theirs
    assert (mine["skipped_steps"], mine["last_step_skipped"]) == (2, False)
    clone = pickle.loads(pickle.dumps(ours))
    assert clone.state_dict() == mine
    assert copy.deepcopy(ours).state_dict() == mine


# ------------------------------------------------------------------------------------------ the floor
def test_scale_never_falls_below_the_floor_and_weights_stay_finite() -> None:
    """Issue 14.1: ~146 overflows from 2**16 take torch's scale below 2**-126; the next clean step then
    writes inf/NaN into the weights. Ours stops at the floor (1.0) and the clean step is finite."""
    results = {}
    for name, cls in (("ours", GradScaler), ("torch", torch.amp.GradScaler)):
        model, opt = _net()
        scaler = cls("cpu")
        for _ in range(160):
            _iterate(scaler, model, opt, poison=True)
        _iterate(scaler, model, opt, poison=False)
        results[name] = (scaler.get_scale(), all(torch.isfinite(p).all() for p in model.parameters()))
    assert results["ours"] == (1.0, True)
    assert results["torch"][0] < 2.0**-126  # the failure we guard against is real in the reference


def test_tiny_backoff_factor_is_stopped_by_the_floor() -> None:
    model, opt = _net()
    scaler = GradScaler("cpu", init_scale=2.0**10, backoff_factor=1e-50)  # 2**10 * 1e-50 is 0 in fp32
    _iterate(scaler, model, opt, poison=True)
    assert scaler.get_scale() == scaler.scale_floor == 1.0
    _iterate(scaler, model, opt, poison=False)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_explicit_min_scale_lowers_the_floor() -> None:
    model, opt = _net()
    scaler = GradScaler("cpu", init_scale=1.0, min_scale=0.25)
    for _ in range(5):
        _iterate(scaler, model, opt, poison=True)
    assert scaler.get_scale() == 0.25


# ------------------------------------------------------------------------------------------ validation
BAD_SCALES = [0.0, -8.0, float("nan"), float("inf"), 1e-45, 1e39, 0.5]  # 1e39 is inf in fp32; 0.5 < floor


@pytest.mark.parametrize("value", BAD_SCALES)
def test_every_way_a_scale_enters_is_checked(value: float) -> None:
    with pytest.raises(ConfigError, match="init_scale"):
        GradScaler("cpu", init_scale=value)
    model, opt = _net()
    scaler = GradScaler("cpu", init_scale=2.0**10)
    _iterate(scaler, model, opt, poison=False)
    saved = scaler.state_dict()
    for new_scale in (value, torch.tensor(value)):
        scaler.scale(torch.ones(()))
        with pytest.raises(ConfigError, match="new_scale"):
            scaler.update(new_scale=new_scale)
        assert scaler.get_scale() == 2.0**10
    with pytest.raises(ConfigError, match="loaded scale"):
        scaler.load_state_dict({**saved, "scale": value})
    assert scaler.state_dict() == saved  # refused before anything changed


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda s: s.set_backoff_factor(2.0), "backoff factor"),
        (lambda s: s.set_growth_factor(0.5), "growth factor"),
        (lambda s: s.set_growth_interval(0), "growth_interval"),
        (lambda s: GradScaler("cpu", growth_factor=float("inf")), "growth factor"),
        (lambda s: GradScaler("cpu", growth_interval=True), "growth_interval"),
        (lambda s: GradScaler("cpu", growth_interval=2**70), "growth_interval"),
        (lambda s: GradScaler("cpu", hysteresis=2.5), "hysteresis"),
        (lambda s: GradScaler("cpu", skip_limit=0), "skip_limit"),
        (lambda s: GradScaler("cpu", hysteresis_rule="sometimes"), "hysteresis_rule"),
        (lambda s: (s.scale(torch.ones(())), s.update(1024)), r"update\(1024.0\)"),
    ],
)
def test_values_that_would_fail_later_are_refused_at_the_call(call: Any, name: str) -> None:
    scaler = GradScaler("cpu")
    before = (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval())
    with pytest.raises(ConfigError, match=name):
        call(scaler)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == before


def test_load_state_dict_names_missing_keys() -> None:
    scaler = GradScaler("cpu")
    with pytest.raises(ScalerStateError, match="lacks _growth_tracker"):
        scaler.load_state_dict(
            {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5}
        )


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(init_scale=np.float32(1024.0)),
        dict(init_scale=np.float64(1024.0)),
        dict(init_scale=torch.tensor(1024.0)),
        dict(init_scale=1024),
        dict(init_scale=1024.0, growth_factor=np.float32(4.0), growth_interval=np.int64(2)),
    ],
)
def test_numpy_and_tensor_numbers_are_accepted_where_torch_accepts_them(kwargs: dict[str, Any]) -> None:
    scales = {}
    for cls in (GradScaler, torch.amp.GradScaler):
        model, opt = _net()
        scaler = cls("cpu", **kwargs)
        scales[cls] = []
        for i in range(6):
            _iterate(scaler, model, opt, poison=i == 1)
            scales[cls].append(scaler.get_scale())
    assert scales[GradScaler] == scales[torch.amp.GradScaler]


@pytest.mark.parametrize(
    "new_scale", [np.float64(8.0), np.float32(8.0), torch.tensor(8.0), torch.tensor([8.0])]
)
def test_update_new_scale_accepts_floats_and_one_element_tensors(new_scale: Any) -> None:
    scaler = GradScaler("cpu")
    scaler.scale(torch.ones(()))
    scaler.update(new_scale)
    assert scaler.get_scale() == 8.0


# ------------------------------------------------------------------------------------------ scale()
Pair = collections.namedtuple("Pair", "a b")


def test_scale_keeps_the_structure_type() -> None:
    t = torch.randn(3)
    ours, ref = GradScaler("cpu", init_scale=4.0), torch.amp.GradScaler("cpu", init_scale=4.0)
    for nested in ([t, (t, [t])], (t, t)):  # what torch handles: same types back
        mine, theirs = ours.scale(nested), ref.scale(nested)
        assert type(mine) is type(theirs) and type(mine[1]) is type(theirs[1])
        torch.testing.assert_close(mine[0], theirs[0], rtol=0, atol=0)
    for mapping in ({"a": t, "b": [t]}, collections.OrderedDict(a=t)):  # torch returns a lazy map of keys
        scaled = ours.scale(mapping)
        assert type(scaled) is type(mapping) and list(scaled) == list(mapping)
        assert torch.equal(scaled["a"], t * 4.0)
    pair = ours.scale(Pair(t, t))  # torch raises TypeError
    assert isinstance(pair, Pair) and torch.equal(pair.b, t * 4.0)
    assert [torch.equal(x, t * 4.0) for x in ours.scale(x for x in (t, t))] == [True, True]
    with pytest.raises(ValueError, match="iterable of Tensors"):
        ours.scale("loss")


# ------------------------------------------------------------------------------------------ after an error
def test_scaler_is_reusable_after_persistent_overflow_error() -> None:
    """Issue 14.6: the iteration after PersistentOverflowError raised 'step() has already been called'."""
    model, opt = _net()
    scaler = GradScaler("cpu", init_scale=2.0**10, skip_limit=3)
    with pytest.raises(PersistentOverflowError):
        for _ in range(10):
            _iterate(scaler, model, opt, poison=True)
    opt.zero_grad()  # the error left the loop before its zero_grad
    before = model.weight.detach().clone()
    for _ in range(3):  # the data is fixed: train on with the same scaler
        _iterate(scaler, model, opt, poison=False)
    assert not torch.equal(model.weight, before)
    _iterate(scaler, model, opt, poison=True)  # a lone overflow does not raise again (the count restarted)
    assert scaler.skipped_steps == 4
