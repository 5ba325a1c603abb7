"""apex's property overrides, tested against apex's documented rules (apex/amp/frontend.py's Properties):
any property may be overridden at any level; only four O1-related combinations were refused, with a
RuntimeError; keep_batchnorm_fp32 also took the strings "True"/"False"."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec import amp
from mixprec.master import MasterWeights

pytestmark = pytest.mark.usefixtures("fresh_amp_state")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))


def _init(level: str, **overrides: object) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return mixprec.initialize(model, opt, opt_level=level, verbosity=0, **overrides)


def _one_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    with mixprec.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()


def test_o2_without_casting_the_model_keeps_fp32_weights_and_trains() -> None:
    with pytest.warns(UserWarning, match="master_weights=True with fp32 weights"):
        model, opt = _init("O2", cast_model_type=False)
    assert model[0].weight.dtype == torch.float32
    before = model[0].weight.detach().clone()
    _one_step(model, opt)
    assert not torch.equal(before, model[0].weight)


def test_o2_without_master_weights_steps_the_half_weights() -> None:
    model, opt = _init("O2", master_weights=False)
    assert model[0].weight.dtype == torch.float16 and not isinstance(opt, MasterWeights)
    before = model[0].weight.detach().clone()
    _one_step(model, opt)
    assert not torch.equal(before, model[0].weight)


@pytest.mark.parametrize("flag, bn_dtype", [("False", torch.float16), ("True", torch.float32)])
def test_keep_batchnorm_fp32_takes_apexs_strings(flag: str, bn_dtype: torch.dtype) -> None:
    model, _ = _init("O2", keep_batchnorm_fp32=flag)
    assert model[1].weight.dtype == bn_dtype


def test_o3_with_batchnorm_in_fp32_is_accepted() -> None:
    model, _ = _init("O3", keep_batchnorm_fp32=True)
    assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32


def test_a_static_loss_scale_override_at_o2() -> None:
    _init("O2", loss_scale=128.0)
    assert mixprec.amp.loss_scaler().get_scale() == 128.0


@pytest.mark.parametrize(
    "level, overrides",
    [
        ("O1", dict(cast_model_type=torch.float16)),
        ("O1", dict(keep_batchnorm_fp32=True)),
        ("O1", dict(master_weights=True)),
        ("O2", dict(patch_torch_functions=True)),
    ],
)
def test_apexs_four_refusals_raise_runtime_error(level: str, overrides: dict[str, object]) -> None:
    with pytest.raises(RuntimeError, match="apex refused"):
        _init(level, **overrides)


def test_o1_accepts_what_apex_accepted() -> None:
    model, _ = _init("O1", cast_model_type=torch.float32, keep_batchnorm_fp32=None)
    assert model[0].weight.dtype == torch.float32


def test_bad_keep_batchnorm_value_names_apexs_choices() -> None:
    with pytest.raises(mixprec.ConfigError, match="the string 'True' or 'False'"):
        _init("O2", keep_batchnorm_fp32="yes")


@pytest.mark.parametrize("verbosity", [1, 2])
def test_the_banner_is_apexs_unless_mixprecs_master_step_options_are_set(
    verbosity: int, capsys: pytest.CaptureFixture[str]
) -> None:
    def banner(**options: object) -> list[str]:
        model = _net()
        opt = torch.optim.AdamW(model.parameters())
        mixprec.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=verbosity, **options)
        amp.reset()  # initialize() keeps process-wide state: a second call needs a reset
        return capsys.readouterr().out.splitlines()

    plain = banner()
    assert plain[0].startswith("Selected optimization level O2") and "mixprec" not in "".join(plain)
    extended = banner(master_grads=False, compile_step=True)
    assert extended[:-1] == plain  # apex's lines, unchanged
    assert extended[-1] == "mixprec master step: master_grads=False, compile_step=True"


@pytest.mark.parametrize(("dtype", "says_bf16"), [(torch.bfloat16, True), (torch.float16, False)])
def test_the_o1_banner_names_bf16(
    dtype: torch.dtype, says_bf16: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """O1's heading (apex's text) named no dtype, where O2's says "BF16 training": an O1 bf16 run read
    as fp16. fp16's heading stays apex's."""
    model = _net()
    mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", dtype=dtype)
    amp.reset()
    heading = capsys.readouterr().out.splitlines()[0]
    assert heading.startswith("Selected optimization level O1: Insert automatic casts")
    assert ("bf16" in heading) is says_bf16
