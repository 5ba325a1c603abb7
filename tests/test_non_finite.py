"""The native read-only inf/NaN check of half gradients (mixprec/non_finite.py) against torch: every fp16
and bf16 bit pattern against torch.isfinite, whole gradient lists against torch's fused check-and-unscale at
scale 1, and the scaler's use of it only where the scale is known to be exactly 1."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec import native
from mixprec.non_finite import EXPONENT_MASK, check_half_grads_
from mixprec.scale_state import ScaleConfig
from mixprec.scaler import GradScaler

pytestmark = pytest.mark.skipif(native.library_error() is not None,
                                reason=f"no native library: {native.library_error()}")

HALVES = [torch.float16, torch.bfloat16]


def _torch_flag(grads: list[torch.Tensor]) -> float:
    """torch's own check at scale 1, on copies (it writes the gradients)."""
    found = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_([g.clone() for g in grads], found, torch.ones(()))
    return found.item()


def _flag(grads: list[torch.Tensor]) -> float:
    found = torch.zeros(())
    assert check_half_grads_(grads, found)
    return found.item()


@pytest.mark.parametrize("dtype", HALVES)
def test_every_bit_pattern_is_flagged_exactly_when_torch_says_it_is_not_finite(dtype: torch.dtype) -> None:
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = torch.isfinite(patterns)
    assert _flag([patterns[finite]]) == 0.0  # every finite value at once: subnormals, +-0, the largest
    bad = patterns[~finite]
    assert len(bad) == (256 if dtype is torch.bfloat16 else 2048)  # both signs, every fraction: inf, NaNs
    clean = torch.linspace(-3, 3, 40_000).to(dtype)  # above the loop's threshold for threads
    for i in range(len(bad)):
        at = (i * 7919) % len(clean)  # a different place each time, both threads' shares
        grads = [clean[:at], bad[i : i + 1], clean[at:]]
        assert _flag(grads) == 1.0 == _torch_flag(grads), f"pattern {bad[i].view(torch.int16).item():#06x}"


@pytest.mark.parametrize("dtype", HALVES)
def test_gradient_lists_give_torchs_flag_and_stay_untouched(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = [(300, 200), (200,), (0,), (7, 1), (64, 3, 3, 3), (1,)]
    for trial in range(30):
        grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
        grads[4] = grads[4].to(memory_format=torch.channels_last)  # dense, not contiguous
        grads.append(torch.randn(50, 30, generator=gen).to(dtype).t())  # a transposed contiguous tensor
        value = (None, float("inf"), float("-inf"), float("nan"))[trial % 4]
        if value is not None:  # at a random place of a random non-empty tensor, whatever its layout
            t = [g for g in grads if g.numel()][trial % 6]
            t[tuple(int(torch.randint(0, n, (1,), generator=gen)) for n in t.shape)] = value
        before = [g.clone() for g in grads]
        assert _flag(grads) == _torch_flag(grads)
        for g, b in zip(grads, before, strict=True):
            assert torch.equal(g.view(torch.int16), b.view(torch.int16))  # read only, bit for bit


def test_a_set_flag_stays_set_and_others_are_left_to_torch() -> None:
    found = torch.ones(())
    assert check_half_grads_([torch.zeros(10, dtype=torch.bfloat16)], found) and found.item() == 1.0
    untouched = torch.zeros(())
    strided = torch.full((10, 10), float("inf"), dtype=torch.bfloat16)[:, ::2]  # gaps between elements
    assert not check_half_grads_([strided], untouched)
    assert not check_half_grads_([torch.full((4,), float("inf"))], untouched)  # fp32: not a half dtype
    assert not check_half_grads_([torch.zeros(4, dtype=torch.float16), torch.zeros(4, dtype=torch.bfloat16)],
                                 untouched)  # one dtype per call, as the scaler buckets them
    assert not check_half_grads_([], untouched)
    assert untouched.item() == 0.0
    assert set(EXPONENT_MASK) == set(HALVES)


# ---- the scaler --------------------------------------------------------------------------------------


def _half_model_with_grads(inf: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 200), nn.Tanh(), nn.Linear(200, 3)).to(torch.bfloat16)
    model(torch.randn(8, 300, dtype=torch.bfloat16)).float().sum().backward()
    if inf:
        model[0].weight.grad[5, 7] = float("inf")
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = torch._amp_foreach_non_finite_check_and_unscale_

    def counted(grads, found, inv_scale):  # type: ignore[no-untyped-def]
        calls.append(len(grads))
        return real(grads, found, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", counted)
    return calls


@pytest.mark.parametrize("inf", [False, True])
def test_a_static_scale_of_one_checks_natively_with_torchs_result(monkeypatch: pytest.MonkeyPatch,
                                                                   inf: bool) -> None:
    calls = _spy(monkeypatch)
    model, opt = _half_model_with_grads(inf)
    before = [p.grad.clone() for p in model.parameters()]
    ours = GradScaler.from_config("cpu", ScaleConfig.static(1.0), allow_fp16_grads=True)
    ours.scale(torch.ones(()))  # makes the device state, as a scaled loss does
    ours.unscale_(opt)
    assert calls == []  # the native check, not torch's op
    ref_model, ref_opt = _half_model_with_grads(inf)
    ref = torch.amp.GradScaler("cpu", init_scale=1.0)
    ref.scale(torch.ones(()))
    monkeypatch.undo()
    ref.unscale_(ref_opt)
    found_ref = sum(v.item() for v in ref._per_optimizer_states[id(ref_opt)]["found_inf_per_device"].values())
    assert ours.found_inf_async(opt).item() == found_ref == float(inf)
    for p, b, q in zip(model.parameters(), before, ref_model.parameters(), strict=True):
        assert torch.equal(p.grad.view(torch.int16), b.view(torch.int16))
        assert torch.equal(p.grad.view(torch.int16), q.grad.view(torch.int16))  # torch's x1 leaves them too


def test_a_scale_not_known_to_be_one_is_unscaled_by_torchs_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever changed the device scale since the host wrote it (a dynamic update, a user's fill_ on the
    tensor) makes the host not know it: the gradients are then multiplied, not only checked."""
    calls = _spy(monkeypatch)
    model, opt = _half_model_with_grads(False)
    before = [p.grad.clone() for p in model.parameters()]
    scaler = GradScaler.from_config("cpu", ScaleConfig.static(1.0), allow_fp16_grads=True)
    scaler.scale(torch.ones(()))
    scaler._scale.fill_(2.0)  # torch-internal poke: the host's record of 1 no longer holds
    scaler.unscale_(opt)
    assert calls == [len(before)]
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.grad, b * 0.5)
    # a dynamic scaler at its floor of 1 is not known to be there after an update: torch's op too
    calls.clear()
    dynamic = GradScaler("cpu", init_scale=1.0, allow_fp16_grads=True)
    dynamic.scale(torch.ones(()))
    dynamic.unscale_(opt)
    assert calls == []  # its first iteration: the scale is the one the host wrote
    dynamic.update()
    dynamic.unscale_(opt)
    assert calls == [len(before)]
    # update(new_scale) writes a known scale again
    calls.clear()
    dynamic.update(1.0)
    dynamic.unscale_(opt)
    assert calls == []


def test_a_scaler_first_used_under_inference_mode_still_scales_and_unscales() -> None:
    """A scale tensor made under torch.inference_mode keeps no version counter: the host then does not
    claim to know the scale (torch's op), and nothing raises."""
    model, opt = _half_model_with_grads(False)
    before = [p.grad.clone() for p in model.parameters()]
    scaler = GradScaler.from_config("cpu", ScaleConfig.static(1.0), allow_fp16_grads=True)
    with torch.inference_mode():
        assert scaler.scale(torch.ones(())).item() == 1.0
    assert scaler._state.known_scale() is None
    scaler.unscale_(opt)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))
