"""The native read-only inf/NaN check of gradients (mixprec/non_finite.py) against torch: every fp16 and bf16
bit pattern and fp32's inf/NaN patterns against torch.isfinite, whole gradient lists against torch's fused
check-and-unscale at scale 1, and the scaler's use of it only where the scale is known to be exactly 1."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec import native
from mixprec.non_finite import EXPONENT_MASK, check_grads_
from mixprec.scale_state import ScaleConfig
from mixprec.scaler import GradScaler

pytestmark = pytest.mark.skipif(native.library_error() is not None,
                                reason=f"no native library: {native.library_error()}")

HALVES = [torch.float16, torch.bfloat16]
CHECKED = [*HALVES, torch.float32]
ONE = torch.ones(())  # the inverse scale at which unscaling is the identity


def _torch_flag(grads: list[torch.Tensor]) -> float:
    """torch's own check at scale 1, on copies (it writes the gradients)."""
    found = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_([g.clone() for g in grads], found, torch.ones(()))
    return found.item()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _flag(grads: list[torch.Tensor]) -> float:
    found = torch.zeros(())
    assert check_grads_(grads, found, ONE)
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


def test_fp32_inf_and_nan_patterns_are_flagged_and_finite_extremes_are_not() -> None:
    """2**32 patterns are too many to try: every pattern with all exponent bits set (inf, NaN) at the
    fraction's extremes and 2000 random fractions, both signs; and the finite values next to them."""
    gen = torch.Generator().manual_seed(0)
    extremes = torch.tensor([0, 1, 2**22, 2**23 - 1])
    fractions = torch.cat([extremes, torch.randint(0, 2**23, (2000,), generator=gen)])
    top = (0xFF << 23) | fractions
    bad = torch.cat([top, top | -(2**31)]).to(torch.int32).view(torch.float32)
    assert not torch.isfinite(bad).any()
    edges = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.17e-38, 3.4028235e38, -3.4028235e38])  # subnormal, max
    clean = torch.cat([edges, torch.randn(40_000, generator=gen)])
    assert _flag([clean]) == 0.0
    for i in range(len(bad)):
        at = (i * 7919) % len(clean)
        grads = [clean[:at], bad[i : i + 1], clean[at:]]
        assert _flag(grads) == 1.0 == _torch_flag(grads), f"pattern {bad[i].view(torch.int32).item():#010x}"


@pytest.mark.parametrize("dtype", CHECKED)
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
            assert torch.equal(_bits(g), _bits(b))  # read only, bit for bit


def test_a_set_flag_stays_set_and_others_are_left_to_torch() -> None:
    found = torch.ones(())
    assert check_grads_([torch.zeros(10, dtype=torch.bfloat16)], found, ONE) and found.item() == 1.0
    untouched = torch.zeros(())
    inf = torch.full((10, 10), float("inf"), dtype=torch.bfloat16)
    for grads, inv_scale in [
        ([inf[:, ::2]], ONE),  # gaps between elements
        ([torch.full((4,), float("inf"), dtype=torch.float64)], ONE),  # fp64: not checked natively
        ([torch.zeros(4, dtype=torch.float16), torch.zeros(4, dtype=torch.bfloat16)], ONE),  # one dtype
        ([], ONE),
        ([inf], torch.tensor(0.5)),  # any other scale: the gradients must be multiplied
        ([inf], torch.tensor(1.0 + 2**-23)),  # the next fp32 above 1
        ([inf], torch.ones((), dtype=torch.float64)),  # not the fp32 factor torch's op takes
    ]:
        assert not check_grads_(grads, untouched, inv_scale)
    assert untouched.item() == 0.0
    assert set(EXPONENT_MASK) == set(CHECKED)


# ---- the scaler --------------------------------------------------------------------------------------


def _half_model_with_grads(inf: bool, dtype: torch.dtype = torch.bfloat16
                           ) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 200), nn.Tanh(), nn.Linear(200, 3)).to(dtype)
    model(torch.randn(8, 300, dtype=dtype)).float().sum().backward()
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # fp32: O1's and O2's master gradients
@pytest.mark.parametrize("inf", [False, True])
def test_a_static_scale_of_one_checks_natively_with_torchs_result(monkeypatch: pytest.MonkeyPatch,
                                                                   inf: bool, dtype: torch.dtype) -> None:
    calls = _spy(monkeypatch)
    model, opt = _half_model_with_grads(inf, dtype)
    before = [p.grad.clone() for p in model.parameters()]
    ours = GradScaler.from_config("cpu", ScaleConfig.static(1.0), allow_fp16_grads=True)
    ours.scale(torch.ones(()))  # makes the device state, as a scaled loss does
    ours.unscale_(opt)
    assert calls == []  # the native check, not torch's op
    ref_model, ref_opt = _half_model_with_grads(inf, dtype)
    ref = torch.amp.GradScaler("cpu", init_scale=1.0)
    ref.scale(torch.ones(()))
    monkeypatch.undo()
    ref.unscale_(ref_opt)
    found_ref = sum(v.item() for v in ref._per_optimizer_states[id(ref_opt)]["found_inf_per_device"].values())
    assert ours.found_inf_async(opt).item() == found_ref == float(inf)
    for p, b, q in zip(model.parameters(), before, ref_model.parameters(), strict=True):
        assert torch.equal(_bits(p.grad), _bits(b))
        assert torch.equal(_bits(p.grad), _bits(q.grad))  # torch's x1 leaves them too


def test_any_scale_but_one_is_unscaled_by_torchs_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop reads the scale itself, so however it was changed (a dynamic update, a user's fill_, a
    write through .data or a collective, which bump no version counter) the gradients are multiplied."""
    calls = _spy(monkeypatch)
    model, opt = _half_model_with_grads(False)
    before = [p.grad.clone() for p in model.parameters()]
    scaler = GradScaler.from_config("cpu", ScaleConfig.static(1.0), allow_fp16_grads=True)
    scaler.scale(torch.ones(()))
    scaler._scale.data.fill_(2.0)  # torch-internal poke, through .data: no version bump
    scaler.unscale_(opt)
    assert calls == [len(before)]
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.grad, b * 0.5)
    # a dynamic scale at its floor of 1 is checked natively; once it grows, torch's op multiplies
    calls.clear()
    dynamic = GradScaler("cpu", init_scale=1.0, growth_interval=1, allow_fp16_grads=True)
    dynamic.scale(torch.ones(()))
    dynamic.unscale_(opt)
    assert calls == []
    dynamic.update()  # one clean iteration: the scale grows to 2
    assert dynamic.get_scale() == 2.0
    dynamic.unscale_(opt)
    assert calls == [len(before)]


def test_a_scaler_first_used_under_inference_mode_still_scales_and_unscales() -> None:
    """A scale tensor made under torch.inference_mode (no version counter): nothing raises (an earlier
    version of the check read the counter)."""
    model, opt = _half_model_with_grads(False)
    before = [p.grad.clone() for p in model.parameters()]
    scaler = GradScaler.from_config("cpu", ScaleConfig.static(1.0), allow_fp16_grads=True)
    with torch.inference_mode():
        assert scaler.scale(torch.ones(())).item() == 1.0
    scaler.unscale_(opt)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))
