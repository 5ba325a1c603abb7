"""O2's unscale in the copy into the master gradients (mixprec/unscale_copy.py) against torch's two ops it
replaces -- ``_foreach_copy_`` into fp32, then ``_amp_foreach_non_finite_check_and_unscale_`` -- bit for bit
over every fp16 and bf16 value, and a GradScaler over MasterWeights with the loop against the same scaler
without it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec.master
from mixprec import native
from mixprec.master import MasterWeights
from mixprec.scaler import GradScaler
from mixprec.unscale_copy import unscale_copy_

pytestmark = pytest.mark.skipif(native.library_error() is not None,
                                reason=f"no native library: {native.library_error()}")

HALVES = [torch.float16, torch.bfloat16]
# 1: bf16's static scale (the upcast kept as it is); 2**-16: fp16's first dynamic scale; 1/3 and 0.75: no
# powers of two, so every product is rounded
INVERSE_SCALES = [1.0, 2.0**-16, 1 / 3, 0.75]


def _torch(src: list[torch.Tensor], inv_scale: float) -> tuple[list[torch.Tensor], float]:
    dst = [torch.empty(s.shape) for s in src]
    torch._foreach_copy_(dst, src)
    found = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_(dst, found, torch.tensor(inv_scale))
    return dst, found.item()


def _ours(src: list[torch.Tensor], inv_scale: float) -> tuple[list[torch.Tensor], float, bool | None]:
    dst = [torch.full(s.shape, 7.0) for s in src]
    found = torch.zeros(())
    by_one = unscale_copy_(dst, src, found, torch.tensor(inv_scale))
    return dst, found.item(), by_one


def _sevens(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A destination whose every value a write would change (torch.empty's may be NaN: unequal to itself)."""
    return torch.full(shape, 7.0, dtype=dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _flushed(t: torch.Tensor) -> torch.Tensor:
    """fp32 subnormals (exponent bits 0) set to a zero of their sign, bit by bit (no float arithmetic,
    which a flush-to-zero mode would change)."""
    bits = _bits(t)
    subnormal = (bits & 0x7F800000) == 0
    return torch.where(subnormal, bits & torch.tensor(-(2**31), dtype=torch.int32), bits).view(torch.float32)


@pytest.mark.parametrize("flush_denormal", [False, True])
@pytest.mark.parametrize("inv_scale", INVERSE_SCALES)
@pytest.mark.parametrize("dtype", HALVES)
def test_every_half_value_gives_torchs_bits_and_flag(dtype: torch.dtype, inv_scale: float,
                                                     flush_denormal: bool) -> None:
    """All 65536 bit patterns -- subnormals, +-0, inf, every NaN -- in one tensor and in pieces."""
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    was = torch.set_flush_denormal(flush_denormal)
    try:
        for src in ([patterns], list(patterns.split(5000))):
            ref, ref_found = _torch(src, inv_scale)
            dst, found, by_one = _ours(src, inv_scale)
            assert by_one is (inv_scale == 1.0)
            assert found == ref_found == 1.0
            for d, r in zip(dst, ref, strict=True):
                if flush_denormal:  # flushed on some threads only, torch's as ours: subnormal or zero
                    d, r = _flushed(d), _flushed(r)
                assert torch.equal(_bits(d), _bits(r))  # NaN payloads, quiet bits and signs included
            finite = [s[torch.isfinite(s)] for s in src]
            assert _ours(finite, inv_scale)[1] == 0.0
    finally:
        torch.set_flush_denormal(was and flush_denormal)


@pytest.mark.parametrize("dtype", HALVES)
def test_an_inf_anywhere_is_found_and_an_empty_tensor_is_skipped(dtype: torch.dtype) -> None:
    clean = torch.linspace(-3, 3, 50_000).to(dtype)  # above the loop's threshold for threads
    for at in (0, 24_999, 49_999):
        bad = clean.clone()
        bad[at] = float("inf")
        src = [clean[:100], torch.empty(0, dtype=dtype), bad.view(250, 200)]
        ref, ref_found = _torch(src, 0.5)
        dst, found, _ = _ours(src, 0.5)
        assert found == ref_found == 1.0
        assert all(torch.equal(d, r) for d, r in zip(dst, ref, strict=True))


def test_what_it_cannot_read_is_left_to_the_caller_unwritten() -> None:
    """None, with nothing written: the caller then copies and unscales with torch's ops."""
    half = torch.randn(6, 4).bfloat16()
    cases = {
        "a gap in memory": ([_sevens(6, 2)], [half[:, ::2]]),
        "layouts that differ": ([_sevens(4, 6).t()], [half]),
        "an fp32 source": ([_sevens(6, 4)], [half.float()]),
        "two half dtypes": ([_sevens(6, 4)] * 2, [half, half.half()]),
        "an fp16 destination": ([_sevens(6, 4, dtype=torch.float16)], [half]),
        "lists of unequal length": ([_sevens(6, 4)], [half, half]),
    }
    for name, (dst, src) in cases.items():
        sentinel = [d.clone() for d in dst]
        found = torch.zeros(())
        assert unscale_copy_(dst, src, found, torch.tensor(0.5)) is None, name
        assert found.item() == 0.0 and all(torch.equal(d, s) for d, s in zip(dst, sentinel, strict=True))
    fp64 = torch.tensor(0.5, dtype=torch.float64)  # torch's op takes an fp32 inverse scale
    assert unscale_copy_([torch.empty(6, 4)], [half], torch.zeros(()), fp64) is None


def _o2_step(dtype: torch.dtype, init_scale: float, flat: bool, inf: bool, fused: bool,
             monkeypatch: pytest.MonkeyPatch, unscale: bool = True,
             ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """One step of a half model through MasterWeights and a GradScaler: the fp32 master gradients after
    unscale_ (without ``unscale``: none, the fused AdamW unscales in its step), the masters after the step,
    and how many tensors each call of the loop copied."""
    calls: list[int] = []

    def spied(dst, src, found, inv_scale):  # noqa: ANN001, ANN202
        calls.append(len(dst))
        return unscale_copy_(dst, src, found, inv_scale) if fused else None

    with monkeypatch.context() as patched:
        patched.setattr(mixprec.master, "unscale_copy_", spied)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)).to(dtype)
        model[1].float()  # an fp32 parameter beside the masters: its gradient is still torch's to unscale
        opt = MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2), flat=flat)
        scaler = GradScaler("cpu", init_scale=init_scale, allow_fp16_grads=True)
        x = torch.randn(32, 8, dtype=dtype)
        out = model[2](model[1](model[0](x).float()).to(dtype))
        loss = out.float().square().mean() * (float("inf") if inf else 1.0)
        scaler.scale(loss).backward()
        if unscale:
            scaler.unscale_(opt)
        grads = [m.grad.clone() for m in opt.master_params() if m.grad is not None and unscale]
        scaler.step(opt)
        scaler.update()
    return grads, [m.detach().clone() for m in opt.master_params()], calls


@pytest.mark.parametrize(("dtype", "init_scale"), [(torch.bfloat16, 1.0), (torch.float16, 2.0**16),
                                                   (torch.bfloat16, 3.0)])
@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("inf", [False, True])
def test_a_scaler_over_master_weights_unscales_in_the_copy_with_the_same_result(
    dtype: torch.dtype, init_scale: float, flat: bool, inf: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    grads, masters, calls = _o2_step(dtype, init_scale, flat, inf, True, monkeypatch)
    ref_grads, ref_masters, _ = _o2_step(dtype, init_scale, flat, inf, False, monkeypatch)
    assert calls == [4]  # both linear layers' weight and bias, in one call
    assert len(grads) == len(ref_grads) == (3 if flat else 6)  # the flat buffer or 4 masters, + 2 fp32
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.equal(g, r) or (inf and torch.equal(g.isnan(), r.isnan()))
    for m, r in zip(masters, ref_masters, strict=True):
        assert torch.equal(m, r)  # stepped alike, or (inf) both skipped


@pytest.mark.parametrize(("dtype", "init_scale"), [(torch.bfloat16, 1.0), (torch.float16, 2.0**16)])
@pytest.mark.parametrize("inf", [False, True])
def test_a_step_that_unscales_itself_checks_in_the_copy_too(
    dtype: torch.dtype, init_scale: float, inf: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scaler.step(opt) without unscale_ (the fused AdamW unscales in its step): the copy into the master
    gradients checks them in the same pass (it was a plain copy, then a second read of every master
    gradient to check it), with the same masters and the same skip."""
    _, masters, calls = _o2_step(dtype, init_scale, False, inf, True, monkeypatch, unscale=False)
    _, ref_masters, _ = _o2_step(dtype, init_scale, False, inf, False, monkeypatch, unscale=False)
    assert calls == [4]
    for m, r in zip(masters, ref_masters, strict=True):
        assert torch.equal(m, r)


def test_without_a_compiler_o2_copies_and_unscales_with_torch_and_info_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mixprec.cli import main

    with monkeypatch.context() as m:
        m.setattr(native, "_LIBRARY", {})  # forget this process's build
        m.setenv("MIXPREC_CACHE_DIR", str(tmp_path))  # and the cached library
        m.setenv("CC", str(tmp_path / "no-such-cc"))
        assert unscale_copy_([_sevens(3)], [torch.ones(3).bfloat16()], torch.zeros(()), torch.ones(())) \
            is None
        grads, masters, _ = _o2_step(torch.float16, 2.0**16, False, False, True, m)
        assert main(["info"]) == 0
        assert "O2 unscale" in (out := capsys.readouterr().out) and "a copy, then torch's" in out
    ref_grads, ref_masters, _ = _o2_step(torch.float16, 2.0**16, False, False, False, monkeypatch)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))
    assert all(torch.equal(g, r) for g, r in zip(masters, ref_masters, strict=True))


def test_a_subclass_that_copies_its_own_way_is_called_and_unscaled_by_the_scaler() -> None:
    """copy_grads_to_master is the scaler's documented hook: a subclass overriding it must not be bypassed."""
    calls: list[str] = []

    class Logged(MasterWeights):
        def copy_grads_to_master(self) -> None:
            calls.append("copied")
            super().copy_grads_to_master()

    torch.manual_seed(0)
    model = nn.Linear(4, 3).half()
    opt = Logged(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = GradScaler("cpu", init_scale=2.0**10, allow_fp16_grads=True)
    scaler.scale(model(torch.randn(8, 4).half()).float().sum()).backward()
    expected = [p.grad.float() / 2.0**10 for p in model.parameters()]
    scaler.unscale_(opt)
    assert calls == ["copied"]
    assert all(torch.equal(m.grad, e) for m, e in zip(opt.master_params(), expected, strict=True))
