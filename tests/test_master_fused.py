"""The fused O2 step without persistent fp32 master gradients (``master_grads=False``): the memory it keeps,
counted from the live tensors, and its results against the default step (persistent fp32 master
gradients, torch's fused Adam over them) with the same GradScaler, bit for bit: both run the same fused
kernel on the same fp32 values (the half gradients upcast exactly), only in chunks instead of at once."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from mixprec import master_fused
from mixprec.errors import ConfigError
from mixprec.master import MasterWeights
from mixprec.scaler import GradScaler

SMALL_CHUNK = 2**12  # so that this small model is cut into many chunks, some across a parameter


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(master_fused, "CHUNK", SMALL_CHUNK)


def _net(dtype: torch.dtype = torch.bfloat16, bn: bool = True) -> nn.Module:
    torch.manual_seed(0)
    # 300*256 > SMALL_CHUNK: the first weight is cut across chunks; BatchNorm kept fp32 (its own master)
    layers = [nn.Linear(300, 256), nn.BatchNorm1d(256) if bn else nn.Identity(), nn.ReLU(), nn.Linear(256, 5)]
    model = nn.Sequential(*layers).to(dtype)
    model[1].float()
    assert model[0].weight.numel() > SMALL_CHUNK
    return model


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    groups = [{"params": list(model[0].parameters()) + list(model[1].parameters())},
              {"params": list(model[3].parameters()), "lr": 3e-3, "weight_decay": 0.0}]
    if kind == "adam":
        return torch.optim.Adam(groups, lr=1e-2, weight_decay=1e-2)  # L2 in the gradient
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, amsgrad=kind == "amsgrad")


def _run(master_grads: bool, flat: bool, kind: str, dtype: torch.dtype, unscale: bool,
         compile_step: bool = False) -> tuple:
    model = _net(dtype)
    opt = MasterWeights(_optimizer(model, kind), flat=flat, fused=True, master_grads=master_grads,
                        compile_step=compile_step)
    scaler = GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    for i in range(6):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(32, 300, generator=g), torch.randint(0, 5, (32,), generator=g)
        loss = nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
        scaler.scale(loss).backward()
        if i == 2:  # an overflowing step: skipped, the scale backs off
            model[3].weight.grad[0, 0] = float("inf")
        if unscale:
            scaler.unscale_(opt)  # the gradients arrive at the step already unscaled
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return model, opt, scaler


def _state_tensors(opt: MasterWeights) -> list[torch.Tensor]:
    return [v for p in opt.master_params() for v in opt.state[p].values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize(("kind", "flat", "dtype", "unscale"), [
    ("adamw", False, torch.bfloat16, False),
    ("adamw", True, torch.float16, False),
    ("adam", False, torch.float16, False),
    ("amsgrad", True, torch.bfloat16, False),
    ("adamw", False, torch.bfloat16, True),
])
def test_fused_step_equals_the_step_with_master_grads(
    kind: str, flat: bool, dtype: torch.dtype, unscale: bool
) -> None:
    ref_model, ref, ref_scaler = _run(True, flat, kind, dtype, unscale)
    model, opt, scaler = _run(False, flat, kind, dtype, unscale)
    assert scaler.skipped_steps == ref_scaler.skipped_steps == 1
    assert scaler.get_scale() == ref_scaler.get_scale()
    for a, b in zip(ref.master_params(), opt.master_params(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(ref_model.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(_state_tensors(ref), _state_tensors(opt), strict=True):
        assert torch.equal(a, b)  # moments and step counts (the skipped step not counted)


@pytest.mark.parametrize("unscale", [False, True])
def test_compile_step_runs_the_fused_kernel_where_the_compiled_pass_does_not_run(
    unscale: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU (COMPILED_ON holds only the CPU; emptied here to take that path on the CPU): compile_step=True
    steps with torch's fused kernel, bit for bit the step with master gradients, and leaves the scaler its
    own inf check (the compiled one is slower there)."""
    monkeypatch.setattr(master_fused, "COMPILED_ON", frozenset())
    monkeypatch.setattr(master_fused, "adam_pass", lambda *a, **k: pytest.fail("the compiled pass ran"))
    ref_model, ref, ref_scaler = _run(True, False, "adamw", torch.bfloat16, unscale)
    model, opt, scaler = _run(False, False, "adamw", torch.bfloat16, unscale, compile_step=True)
    assert opt.non_finite_check is None
    assert scaler.skipped_steps == ref_scaler.skipped_steps == 1
    for a, b in zip(ref.master_params(), opt.master_params(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(ref_model.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_the_scratch_is_no_larger_than_the_half_gradients_it_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU's chunk (DEVICE_CHUNK, 64 MiB of fp32) would be a small model's scratch; it is sized by what
    a chunk holds."""
    sizes: list[int] = []
    real_empty = torch.empty

    def spy(*shape: int, **kwargs: object) -> torch.Tensor:
        sizes.append(shape[0])
        return real_empty(*shape, **kwargs)  # type: ignore[arg-type]

    model = nn.Sequential(nn.Linear(10, 10)).bfloat16()
    opt = MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-3), master_grads=False)
    model(torch.randn(2, 10).bfloat16()).float().sum().backward()
    monkeypatch.setattr(torch, "empty", spy)
    opt.step()
    assert sizes == [110]  # the weight and bias of one step, in one chunk


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize(("master_grads", "expected"), [(False, 16), (True, 20)])
def test_bytes_per_param_of_o2_adam(
    master_grads: bool, expected: int, flat: bool, live_bytes: Callable[..., int]
) -> None:
    """half param 2 + half grad 2 + master 4 + Adam's moments 8 = 16 (plain fp32 training's figure);
    persistent fp32 master gradients add 4. Counted after a step, gradients still held (the peak at rest).
    The scalar step counts (4 bytes per tensor) are the only excess: 1e-3 per parameter here."""
    model = _net(bn=False)
    opt = MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-3), flat=flat, master_grads=master_grads)
    x, y = torch.randn(8, 300).bfloat16(), torch.zeros(8).long()
    nn.functional.cross_entropy(model(x).float(), y).backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    assert live_bytes(model, opt) / n == pytest.approx(expected, abs=1e-3)


def test_without_scaler_the_fused_step_reads_the_half_gradients() -> None:
    """bf16 with no loss scaling: the same as the default step with no grad_scale."""
    runs = []
    for master_grads in (True, False):
        model = _net()
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt = MasterWeights(adamw, fused=True, master_grads=master_grads)
        for i in range(3):
            x = torch.randn(16, 300, generator=torch.Generator().manual_seed(i)).bfloat16()
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append(copy.deepcopy(list(opt.master_params())))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_fused_step_needs_adam() -> None:
    model = _net()
    with pytest.raises(ConfigError, match="Adam or AdamW"):
        MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1), master_grads=False)
    with pytest.raises(ConfigError, match="fused=False"):
        MasterWeights(torch.optim.Adam(model.parameters()), master_grads=False, fused=False)
