"""mixprec.emulation: half-precision GEMM numerics against exact references."""

from __future__ import annotations

import torch

from mixprec.emulation import emulated, round_to_half


def test_round_to_half_is_ieee_round_to_nearest_even() -> None:
    # 1 + 2**-11 lies halfway between fp16's 1 and 1 + 2**-10: ties go to the even significand (1).
    # 1 + 3 * 2**-11 lies halfway between 1 + 2**-10 and 1 + 2**-9: ties go to 1 + 2**-9.
    x = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-11, 70000.0, 2.0**-25])
    got = round_to_half(x)
    assert got.dtype == torch.float32
    assert got.tolist() == [1.0, 1 + 2.0**-9, float("inf"), 0.0]  # 70000 > fp16 max; 2**-25 ties to 0
    assert round_to_half(torch.tensor([3], dtype=torch.int64)).dtype == torch.int64  # non-floats untouched


def test_emulated_mm_is_exact_products_rounded_once() -> None:
    # fp16 x fp16 products are exact in fp32 and these sums too (small integers times 2**-8), so the
    # emulated GEMM must equal the float64 GEMM of the fp16-rounded inputs, rounded once to fp16.
    torch.manual_seed(0)
    a = torch.randint(-8, 9, (8, 16)).float() / 256 + 2.0**-13  # the offset is lost to fp16 rounding
    b = torch.randint(-8, 9, (16, 4)).float() / 256
    got = emulated(torch.mm, (a, b), {})
    ref = (a.half().double() @ b.half().double()).half()
    assert got.dtype == torch.float16
    assert torch.equal(got, ref)


def test_emulated_writes_out_and_returns_it() -> None:
    a, b = torch.randint(-3, 4, (4, 8)).float(), torch.randint(-3, 4, (8, 2)).float()  # exact sums
    out = torch.empty(4, 2, dtype=torch.float16)
    assert emulated(torch.mm, (a, b), {"out": out}) is out
    assert torch.equal(out, (a.half().double() @ b.half().double()).half())
