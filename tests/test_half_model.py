"""The half model: cast, hooks, fp32 state_dict, restore."""

from __future__ import annotations

import torch
from torch import nn

from mixprec.half_model import prepare
from mixprec.recipe import RECIPES


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))


def test_prepare_casts_hooks_and_restore_undoes_everything() -> None:
    model = _net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    half = prepare(model, RECIPES["O2"], "cpu", fp32_state_dict=True)
    assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32
    out = model.eval()(torch.randn(4, 6, dtype=torch.float64))  # any floating input: cast to the model dtype
    assert out.dtype == torch.float32
    assert all(v.dtype != torch.float16 for v in model.state_dict().values())  # apex O2's state_dict hook
    half.restore()
    assert model[0].weight.dtype == torch.float32 and not model._forward_hooks
    for k, v in model.state_dict().items():  # back to fp32; weights hold their fp16 rounding (no masters)
        torch.testing.assert_close(v, before[k].to(torch.float16).to(v.dtype) if v.is_floating_point()
                                   else before[k], atol=0, rtol=0)  # fmt: skip


def test_fp32_state_dict_loads_into_an_fp32_model_and_back() -> None:
    model = _net()
    prepare(model, RECIPES["O2"], "cpu", fp32_state_dict=True)
    fp32 = _net()
    fp32.load_state_dict(model.state_dict())
    torch.testing.assert_close(fp32[0].weight, model[0].weight.float(), atol=0, rtol=0)
    model.load_state_dict(_net().state_dict())  # fp32 into the half model: copied across dtypes
    assert model[0].weight.dtype == torch.float16


def test_fp32_recipe_changes_nothing() -> None:
    model = _net()
    half = prepare(model, RECIPES["fp32"], "cpu")
    assert not half.handles and not half.converted and model[0].weight.dtype == torch.float32
