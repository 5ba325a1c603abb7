"""Mistakes around MasterWeights that used to drop the masters silently: casting the model after wrapping
it, and saving or loading the wrapped optimizer instead of the wrapper."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from mixprec.errors import ConfigError, MasterStateWarning
from mixprec.master import MasterWeights
from mixprec.scaler import GradScaler


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))


def _loss(model: nn.Module, dtype: torch.dtype, i: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    return nn.functional.cross_entropy(model(x.to(dtype)).float(), y)


@pytest.mark.parametrize("cast", ["bfloat16", "half"])
@pytest.mark.parametrize("with_scaler", [False, True])
def test_cast_after_wrapping_is_refused_at_step(cast: str, with_scaler: bool) -> None:
    """Built over fp32 parameters, the wrapper kept no masters; stepping the model in half precision
    without them is what it exists to prevent. The error names the order that works."""
    model = _net()
    opt = MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    getattr(model, cast)()
    dtype = next(model.parameters()).dtype
    before = [p.clone() for p in model.parameters()]
    scaler = GradScaler("cpu", enabled=with_scaler)
    with pytest.raises(ConfigError, match="cast the model first"):
        scaler.scale(_loss(model, dtype)).backward()
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_saving_the_wrapped_optimizer_warns_and_the_wrapper_does_not() -> None:
    model = _net().half()
    opt = MasterWeights(torch.optim.Adam(model.parameters(), lr=1e-3))
    _loss(model, torch.float16).backward()
    opt.step()
    with pytest.warns(MasterStateWarning, match=r"opt\.state_dict\(\)"):
        opt.optimizer.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sd = opt.state_dict()
        opt.load_state_dict(sd)


def test_loading_the_wrapped_optimizer_reseeds_masters_from_the_loaded_model() -> None:
    """Resume from the wrapped optimizer's state: the masters must not stay at their pre-load values
    (the first step would write those stale values over the loaded model)."""
    trained = _net().half()
    opt = MasterWeights(torch.optim.Adam(trained.parameters(), lr=1e-2))
    for i in range(3):
        _loss(trained, torch.float16, i).backward()
        opt.step()
        opt.zero_grad()
    with pytest.warns(MasterStateWarning):
        saved = (trained.state_dict(), opt.optimizer.state_dict())
    fresh = _net().half()
    resumed = MasterWeights(torch.optim.Adam(fresh.parameters(), lr=1e-2))
    fresh.load_state_dict(saved[0])
    with pytest.warns(MasterStateWarning, match="re-seeded"):
        resumed.optimizer.load_state_dict(saved[1])
    for m, p in zip(resumed.master_views(), fresh.parameters(), strict=True):
        assert torch.equal(m, p.float())


def test_a_plain_state_dict_loads_and_reseeds_the_masters_from_the_model() -> None:
    """apex O2 loaded an optimizer state saved before initialize; the masters then come from the model
    (an exact upcast of its half weights), never stale values of before the load, and a warning says so."""
    model = _net().half()
    opt = MasterWeights(torch.optim.Adam(model.parameters()))
    with torch.no_grad():
        for v in opt.master_views():
            v.add_(1.0)  # masters that differ from the model: stale if kept
    plain = torch.optim.Adam(_net().half().parameters())
    with pytest.warns(MasterStateWarning, match="re-seeded from the model"):
        opt.load_state_dict(plain.state_dict())
    for master, half in zip(opt.master_views(), opt.model_params(), strict=True):
        assert torch.equal(master, half.float())
