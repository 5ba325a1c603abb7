"""``amp._amp_state``: the loss scale as apex scripts read it (Megatron-LM's
``_amp_state.loss_scalers[0].loss_scale()``), against apex's scaler rules: start at 2**16, halve on an
overflow and count clean iterations from 0 again, a forced ``_loss_scale`` that changes only the scale."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import mixprec
from mixprec import amp
from mixprec.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.usefixtures("fresh_amp_state")


def _initialized(dtype: torch.dtype = torch.float16, **kwargs: object) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return mixprec.initialize(model, opt, "O2", dtype=dtype, verbosity=0, **kwargs)


def _iteration(model: nn.Module, opt: torch.optim.Optimizer, overflow: bool = False) -> None:
    # small enough that 2**16 times its gradients stays finite in fp16 (the clean iterations are clean)
    loss = model(torch.randn(4, 8)).float().mean() * (float("inf") if overflow else 1e-3)
    with mixprec.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()


def test_the_loss_scale_follows_apexs_rules() -> None:
    from mixprec.amp import _amp_state  # the import apex scripts write, with mixprec for apex

    model, opt = _initialized()
    scaler = _amp_state.loss_scalers[0]
    assert scaler.loss_scale() == 2.0**16 and scaler.dynamic  # apex's dynamic default
    _iteration(model, opt)
    _iteration(model, opt)
    assert (scaler.loss_scale(), scaler._unskipped, scaler._has_overflow) == (2.0**16, 2, False)
    _iteration(model, opt, overflow=True)
    assert (scaler.loss_scale(), scaler._unskipped, scaler._has_overflow) == (2.0**15, 0, True)
    assert scaler._loss_scale == amp.loss_scaler().get_scale() == 2.0**15


def test_setting_the_loss_scale_changes_the_scale_alone() -> None:
    model, opt = _initialized()
    _iteration(model, opt)
    scaler = amp._amp_state.loss_scalers[0]
    scaler._loss_scale = 1024.0
    assert amp.loss_scaler().get_scale() == 1024.0
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 1  # no iteration counted, none reset
    with pytest.raises(ConfigError, match="below the scale floor"):
        scaler._loss_scale = 0.25
    assert amp.loss_scaler().get_scale() == 1024.0


def test_one_view_per_loss_and_the_opt_properties() -> None:
    _initialized(num_losses=2, loss_scale=128.0)
    state = amp._amp_state
    assert [s.loss_scale() for s in state.loss_scalers] == [128.0, 128.0]
    assert not state.loss_scalers[0].dynamic
    props = state.opt_properties
    assert (props.opt_level, props.cast_model_type, props.master_weights, props.loss_scale) == (
        "O2", torch.float16, True, 128.0)
    state.verbosity = 2
    assert state.verbosity == 2 == amp._state().verbosity


def test_before_initialize_the_state_has_no_scalers_as_in_apex() -> None:
    """Scripts ask ``hasattr(amp._amp_state, "loss_scalers")`` whether amp is on: False, not an error."""
    assert not hasattr(amp._amp_state, "loss_scalers")
    with pytest.raises(AttributeError, match="initialize has not been called"):
        amp._amp_state.opt_properties  # noqa: B018
    _initialized()
    assert hasattr(amp._amp_state, "loss_scalers")
    amp.reset()
    assert not hasattr(amp._amp_state, "loss_scalers")


def test_what_the_view_lacks_names_the_scaler_that_has_it() -> None:
    _initialized()
    with pytest.raises(AttributeError, match=r"loss_scaler\(i\) is the GradScaler"):
        amp._amp_state.loss_scalers[0].clear_overflow_state()
    with pytest.raises(AttributeError, match="not 'hard_override'"):
        amp._amp_state.hard_override  # noqa: B018


def test_a_loss_id_past_num_losses_is_named() -> None:
    """``amp.loss_scaler(3)`` after ``num_losses=3`` raised a bare IndexError."""
    _initialized(num_losses=3)
    with pytest.raises(ConfigError, match="loss_id 3 is out of range: initialize was called with num_losses"):
        amp.loss_scaler(3)
    assert amp.loss_scaler(2) is amp._state().scalers[2]


def test_a_bf16_runs_amp_state_is_refused_by_an_fp16_run_but_apexs_two_keys_load() -> None:
    """The full state made the fp16 run's scalers static at 1 (bf16's): its small gradients then flushed
    to zero in fp16, silently (a DCGAN trial). apex loaded only the scale and the clean count."""
    _initialized(torch.bfloat16)
    saved = amp.state_dict()
    amp.reset()
    _initialized()
    with pytest.raises(CheckpointError, match="static .* this run's is dynamic"):
        amp.load_state_dict(saved)
    assert amp.loss_scaler().is_dynamic and amp.loss_scaler().get_scale() == 2.0**16  # nothing changed
    apex_keys = {k: {"loss_scale": v["loss_scale"], "unskipped": v["unskipped"]} for k, v in saved.items()}
    amp.load_state_dict(apex_keys)
    assert amp.loss_scaler().is_dynamic and amp.loss_scaler().get_scale() == 1.0  # apex's load: the scale
