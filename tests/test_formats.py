"""mixprec.formats and `mixprec formats`, checked against torch.finfo, torch's casts and brute force."""

from __future__ import annotations

import bisect
import functools
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec import formats
from mixprec.cli import main
from mixprec.commands.formats import MAX_DEPTH, ValueSyntaxError, parse_value
from mixprec.formats import FORMATS, Overflow, Specials, decode, info

# Formats this torch has a dtype for: the ones we can check against torch.
TORCH_FORMATS = [f for f in FORMATS.values() if f.torch_dtype is not None]
HALF_FORMATS = [FORMATS[name] for name in ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")]
SMALL_FORMATS = HALF_FORMATS  # at most 16 bits: all their encodings can be enumerated

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]

_INT_OF_WIDTH = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}

# torch's e4m3fn cast saturates at +-448 (2.13) but returned NaN in older releases: follow the installed one.
E4M3_TORCH_OVERFLOW = (
    Overflow.NAN if math.isnan(float(torch.tensor(1e4, dtype=torch.float8_e4m3fn))) else Overflow.SATURATE
)


def _ids(fmts: list[formats.FloatFormat]) -> list[str]:
    return [f.name for f in fmts]


def torch_stored(x: float, fmt: formats.FloatFormat) -> float:
    return float(torch.tensor(x, dtype=fmt.torch_dtype))


def torch_bits(x: float, fmt: formats.FloatFormat) -> int:
    t = torch.tensor([x], dtype=fmt.torch_dtype).view(_INT_OF_WIDTH[fmt.bits])
    return int(t[0]) & ((1 << fmt.bits) - 1)


def decode_like_torch(x: float, fmt: formats.FloatFormat) -> formats.Decoded:
    overflow = E4M3_TORCH_OVERFLOW if fmt.name == "fp8_e4m3" else None
    return decode(x, fmt, overflow=overflow)


def same_float(a: float, b: float) -> bool:
    """Equal including the sign of zero; NaN equals NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


# --------------------------------------------------------------------------------------------------
# info() against torch.finfo


@pytest.mark.parametrize("fmt", TORCH_FORMATS, ids=_ids(TORCH_FORMATS))
def test_info_matches_torch_finfo(fmt: formats.FloatFormat) -> None:
    fi, ref = info(fmt), torch.finfo(fmt.torch_dtype)
    assert fi.bits == ref.bits
    assert fi.max == ref.max
    assert fi.min == ref.min
    assert fi.eps == ref.eps
    assert fi.smallest_normal == ref.smallest_normal
    assert fi.tiny == ref.tiny
    assert fi.resolution == ref.resolution


@pytest.mark.parametrize("fmt", TORCH_FORMATS, ids=_ids(TORCH_FORMATS))
def test_smallest_subnormal_is_encoding_one(fmt: formats.FloatFormat) -> None:
    # Bit pattern 0...01 is the smallest positive number in every IEEE-style format.
    one = torch.tensor([1], dtype=_INT_OF_WIDTH[fmt.bits]).view(fmt.torch_dtype)
    ref = torch.finfo(fmt.torch_dtype)
    assert info(fmt).smallest_subnormal == float(one[0]) == ref.smallest_normal * ref.eps


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_smallest_subnormal_is_nextafter_zero(dtype: torch.dtype) -> None:
    zero = torch.zeros((), dtype=dtype)
    assert info(dtype).smallest_subnormal == float(torch.nextafter(zero, zero + 1))


@functools.cache
def encodings(fmt: formats.FloatFormat) -> tuple[list[float], list[int]]:
    """Every finite value >= 0 of a <= 16-bit format, sorted, with its encoding; enumerated by torch."""
    ints = torch.arange(0, 1 << fmt.bits, dtype=torch.int32)
    ints = torch.where(ints >= 1 << (fmt.bits - 1), ints - (1 << fmt.bits), ints)  # two's complement
    values = ints.to(_INT_OF_WIDTH[fmt.bits]).view(fmt.torch_dtype).double().tolist()
    positive = [code >> (fmt.bits - 1) == 0 for code in range(len(values))]
    pairs = sorted((v, code) for code, v in enumerate(values) if positive[code] and math.isfinite(v))
    return [v for v, _ in pairs], [code for _, code in pairs]


@pytest.mark.parametrize("fmt", SMALL_FORMATS, ids=_ids(SMALL_FORMATS))
def test_info_matches_enumerated_encodings(fmt: formats.FloatFormat) -> None:
    values, _ = encodings(fmt)
    fi = info(fmt)
    positive_normals = [v for v in values if v >= fi.smallest_normal]
    assert (values[0], values[1], values[-1]) == (0.0, fi.smallest_subnormal, fi.max)
    assert positive_normals[0] == fi.smallest_normal
    assert values[values.index(1.0) + 1] - 1.0 == fi.eps
    all_values = torch.arange(0, 1 << fmt.bits, dtype=torch.int32).to(_INT_OF_WIDTH[fmt.bits])
    decoded = all_values.view(fmt.torch_dtype).double()
    n_nan, n_inf = int(decoded.isnan().sum()), int(decoded.isinf().sum())
    # IEEE: every nonzero mantissa under the all-ones exponent is NaN; fn: only S.1111.111.
    assert n_nan == (2 * ((1 << fmt.mantissa_bits) - 1) if fmt.has_inf else 2)
    assert n_inf == (2 if fmt.has_inf else 0)


def test_e4m3_is_the_fn_variant() -> None:
    fmt = formats.get_format("e4m3")
    assert fmt.specials is Specials.FINITE and info(fmt).max == 448.0 and not info(fmt).has_inf
    assert decode(math.nan, fmt).bit_string == "0 1111 111"


# --------------------------------------------------------------------------------------------------
# decode(): the facts a student checks first, each also against torch's cast


@pytest.mark.parametrize(
    ("x", "name", "stored"),
    [
        (math.pi, "fp16", 3.140625),
        (math.pi, "bf16", 3.140625),
        (1 + 1e-4, "fp16", 1.0),
        (2.0**-25, "fp16", 0.0),
        (2.0**-25, "bf16", 2.0**-25),
        (65520.0, "fp16", math.inf),
        (65519.0, "fp16", 65504.0),
    ],
)
def test_facts(x: float, name: str, stored: float) -> None:
    d = decode(x, name)
    assert d.stored == stored == torch_stored(x, d.format)


def test_underflow_at_half_the_smallest_subnormal() -> None:
    tiny = info("fp16").smallest_subnormal
    half = decode(tiny / 2, "fp16")  # exactly half: ties to even, and 0 is even
    assert half.underflowed and half.is_zero and "underflows to 0" in half.note
    just_above = tiny / 2 * (1 + 2.0**-23)  # the next float32 number
    above = decode(just_above, "fp16")
    assert above.stored == tiny == torch_stored(just_above, above.format)
    assert above.is_subnormal and not above.underflowed


def test_fields_of_pi_in_fp16() -> None:
    d = decode(math.pi, "fp16")
    assert (d.sign, d.biased_exponent, d.exponent) == (0, 16, 1)
    assert d.bit_string == "0 10000 1001001000" == _torch_bit_string(math.pi, d.format)
    assert d.significand * 2.0**d.exponent == d.stored
    assert d.abs_error == abs(math.pi - 3.140625) and d.rel_error == d.abs_error / math.pi


def test_subnormal_fields() -> None:
    d = decode(3 * 2.0**-24, "fp16")
    assert d.is_subnormal and d.biased_exponent == 0 and d.mantissa == 3
    assert d.exponent == info("fp16").min_exponent == -14
    assert d.significand * 2.0**d.exponent == d.stored == 3 * 2.0**-24
    assert d.encoding == torch_bits(d.stored, d.format)


def _torch_bit_string(x: float, fmt: formats.FloatFormat) -> str:
    bits = format(torch_bits(x, fmt), f"0{fmt.bits}b")
    return f"{bits[0]} {bits[1:1 + fmt.exponent_bits]} {bits[1 + fmt.exponent_bits:]}"


SAMPLES = [0.0, -0.0, 1.0, -2.5, math.pi, 1e-4, 2.0**-25, 1e-8, 65504.0, 65520.0, 448.0, 1000.0, 1e5, 3e38,
           -1e-40, math.inf, -math.inf]


@pytest.mark.parametrize("fmt", TORCH_FORMATS, ids=_ids(TORCH_FORMATS))
@pytest.mark.parametrize("x", SAMPLES)
def test_bits_match_torch(x: float, fmt: formats.FloatFormat) -> None:
    d = decode_like_torch(x, fmt)
    assert same_float(d.stored, torch_stored(x, fmt))
    if not d.is_nan:  # torch's NaN payloads and signs vary by dtype; the value is what matters
        assert d.encoding == torch_bits(x, fmt)
        assert d.bit_string.replace(" ", "") == format(torch_bits(x, fmt), f"0{fmt.bits}b")


def test_nan_and_overflow_policies() -> None:
    assert decode(math.nan, "fp16").is_nan and decode(math.nan, "fp16").exact
    assert decode(-math.inf, "fp16").stored == -math.inf
    assert decode(1e4, "e4m3").stored == 448.0 and decode(-math.inf, "e4m3").stored == -448.0
    assert decode(1e4, "e4m3", overflow="nan").is_nan
    assert decode(math.inf, "e4m3", overflow=Overflow.NAN).is_nan
    assert decode(1e9, "fp16", overflow="saturate").stored == 65504.0
    assert decode(464.0, "e4m3").stored == 448.0  # a tie below the NaN slot rounds down to even 448
    with pytest.raises(ValueError, match="no inf"):
        decode(1e4, "e4m3", overflow="inf")
    with pytest.raises(ValueError, match="'saturate'"):
        decode(1e4, "e4m3", overflow="clamp")


# --------------------------------------------------------------------------------------------------
# decode() against torch's cast on random inputs


@st.composite
def fp32_values(draw: st.DrawFn, fmt: formats.FloatFormat) -> float:
    """float32 numbers (what mixed precision casts) spread over ``fmt``'s range and a bit beyond it:
    underflow, subnormals, normals and overflow."""
    low = max(fmt.min_exponent - fmt.mantissa_bits - 3, -149)
    high = min(fmt.max_exponent + 2, 127)
    exponent = draw(st.integers(low, high))
    significand = draw(st.integers(1 << 23, (1 << 24) - 1))
    if exponent < -126:  # float32 subnormal: fewer significant bits
        significand &= ~((1 << (-126 - exponent)) - 1)
    sign = draw(st.sampled_from([1.0, -1.0]))
    return sign * math.ldexp(significand, exponent - 23)


@pytest.mark.parametrize("fmt", HALF_FORMATS, ids=_ids(HALF_FORMATS))
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_decode_matches_torch_cast_on_fp32_values(fmt: formats.FloatFormat, data: st.DataObject) -> None:
    x = data.draw(fp32_values(fmt) | st.floats(width=32), label="x")
    d = decode_like_torch(x, fmt)
    assert same_float(d.stored, torch_stored(x, fmt))
    if not d.is_nan:
        assert d.encoding == torch_bits(x, fmt)
    if math.isfinite(d.stored) and d.exponent is not None:
        assert math.copysign(d.significand * 2.0**d.exponent, d.stored) == d.stored


@pytest.mark.parametrize("fmt", TORCH_FORMATS, ids=_ids(TORCH_FORMATS))
@settings(max_examples=200, deadline=None)
@given(x=st.floats(allow_nan=False))
def test_decode_of_float64_matches_torch_through_fp32(fmt: formats.FloatFormat, x: float) -> None:
    # torch casts a Python float (float64) to a half format through float32: two roundings.
    via_fp32 = decode(x, "fp32").stored if fmt.bits < 32 else x
    assert same_float(decode_like_torch(via_fp32, fmt).stored, torch_stored(x, fmt))


def nearest_even(x: float, fmt: formats.FloatFormat) -> float:
    """Brute force: the representable value nearest to ``x`` (0 <= x <= max), ties to the even encoding."""
    values, codes = encodings(fmt)
    i = bisect.bisect_left(values, x)
    if values[i] == x:
        return x
    lo, hi = i - 1, i
    # float64 holds both gaps exactly: the values are short and close together.
    below, above = x - values[lo], values[hi] - x
    if below != above:
        return values[lo] if below < above else values[hi]
    return values[lo] if codes[lo] % 2 == 0 else values[hi]


@st.composite
def near_ties(draw: st.DrawFn, fmt: formats.FloatFormat) -> float:
    """Midpoints between neighbouring values of ``fmt``, nudged by 0 or 1 float64 ulp."""
    values, _ = encodings(fmt)
    i = draw(st.integers(0, len(values) - 2))
    mid = (values[i] + values[i + 1]) / 2
    nudge = draw(st.sampled_from([-1, 0, 1]))
    return mid if nudge == 0 else math.nextafter(mid, nudge * math.inf)


@pytest.mark.parametrize("fmt", SMALL_FORMATS, ids=_ids(SMALL_FORMATS))
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_decode_rounds_float64_correctly(fmt: formats.FloatFormat, data: st.DataObject) -> None:
    wide = st.floats(min_value=0.0, max_value=info(fmt).max)
    x = data.draw(near_ties(fmt) | wide, label="x")
    assert decode(x, fmt).stored == nearest_even(x, fmt)
    assert decode(-x, fmt).stored == -nearest_even(x, fmt)


@pytest.mark.parametrize("fmt", SMALL_FORMATS, ids=_ids(SMALL_FORMATS))
def test_decode_rounds_once(fmt: formats.FloatFormat) -> None:
    # Just above the tie between 1 and 1 + eps: rounding to float32 first would make it an exact tie
    # (and then round down to 1). decode() rounds the float64 value once, as IEEE 754 does.
    x = 1 + info(fmt).eps / 2 + 2.0**-40
    assert decode(x, fmt).stored == nearest_even(x, fmt) == 1 + info(fmt).eps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", HALF_FORMATS, ids=_ids(HALF_FORMATS))
def test_decode_matches_tensor_cast(fmt: formats.FloatFormat, device: str) -> None:
    # The vectorized cast kernels (AVX-512 on CPU, CUDA) are separate code from the scalar path.
    gen = torch.Generator().manual_seed(0)
    fi = info(fmt)
    low, high = fi.min_exponent - fmt.mantissa_bits - 3, fi.max_exponent + 2
    exponents = torch.randint(low, high, (4096,), generator=gen)
    x = (torch.rand(4096, generator=gen, dtype=torch.float64) + 1) * torch.exp2(exponents.double())
    x = (x * torch.where(torch.rand(4096, generator=gen) < 0.5, -1.0, 1.0)).float()
    cast = x.to(device).to(fmt.torch_dtype).double().cpu().tolist()
    expected = [decode_like_torch(v, fmt).stored for v in x.double().tolist()]
    rows = zip(x.tolist(), cast, expected, strict=True)
    mismatches = [(v, c, e) for v, c, e in rows if not same_float(c, e)]
    assert not mismatches, mismatches[:5]


# --------------------------------------------------------------------------------------------------
# helpers


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("x", [1.0, math.pi, 3e-5, 1e-7, 1000.0, 0.0])
def test_ulp_is_the_gap_to_the_next_value(x: float, dtype: torch.dtype) -> None:
    stored = torch.tensor(x, dtype=dtype)
    gap = float(torch.nextafter(stored, torch.tensor(math.inf, dtype=dtype))) - float(stored)
    assert formats.ulp(x, dtype) == gap


def test_ulp_of_one_is_eps() -> None:
    assert all(formats.ulp(1.0, f) == info(f).eps for f in FORMATS.values())


@pytest.mark.parametrize("x", [65504.0, 65505.0, 2.0**-24, 2.0**-25, 0.1, 1 / 1024])
def test_representable_and_round_to_format(x: float) -> None:
    ref = torch_stored(x, FORMATS["fp16"])
    assert formats.round_to_format(x, "half") == ref
    assert formats.representable(x, torch.float16) == (ref == x)


@pytest.mark.parametrize(
    ("name", "canonical"),
    [("half", "fp16"), ("float16", "fp16"), (torch.float16, "fp16"), ("torch.bfloat16", "bf16"),
     ("BF16", "bf16"), ("E4M3", "fp8_e4m3"), ("float8_e4m3fn", "fp8_e4m3"), (torch.float8_e5m2, "fp8_e5m2"),
     ("float", "fp32")],
)
def test_get_format_aliases(name: object, canonical: str) -> None:
    assert formats.get_format(name).name == canonical  # type: ignore[arg-type]


def test_unknown_format_names_the_valid_ones() -> None:
    with pytest.raises(formats.UnknownFormatError, match="(?s)fp12.*fp16.*bf16"):
        formats.get_format("fp12")
    with pytest.raises(formats.UnknownFormatError, match="int8"):
        formats.get_format(torch.int8)


def test_format_validation() -> None:
    with pytest.raises(ValueError, match="cannot overflow to inf"):
        formats.FloatFormat("e4m3_inf", 4, 3, Specials.FINITE, Overflow.INF)
    with pytest.raises(ValueError, match="exponent_bits"):
        formats.FloatFormat("wide", 15, 112)


# --------------------------------------------------------------------------------------------------
# the command


@pytest.mark.parametrize(
    "text",
    ["2**-25", "-2**2", "2**-2**2", "1e-4", "65504", "1/3", "(1+2)*3", "1+1e-4", ".5", "3.", "2.5e+3",
     "-(-1)"],
)
def test_parse_value_agrees_with_python(text: str) -> None:
    assert parse_value(text) == eval(text)  # a fixed, trusted list: Python is the reference here


def test_parse_value_names_and_limits() -> None:
    assert parse_value("pi") == math.pi and parse_value("-e") == -math.e and parse_value("2^-24") == 2.0**-24
    assert parse_value("inf") == math.inf and math.isnan(parse_value("nan"))
    assert parse_value("2**2000") == math.inf and parse_value("1e400") == math.inf


@pytest.mark.parametrize(
    "text", ["__import__('os')", "x", "2**", "1/0", "()", "", "2 3", "1e", "(-8)**(1/3)", "1 if 1 else 2"]
)
def test_parse_value_rejects(text: str) -> None:
    with pytest.raises(ValueSyntaxError):
        parse_value(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("10**400/10**399", "inf / inf is undefined (nan)"),  # it showed nan; the value is 10
        ("1e400*0", "inf * 0.0 is undefined"),
        ("inf-inf", "inf - inf is undefined"),
        ("(" * 1000 + "1" + ")" * 1000, f"more than {MAX_DEPTH} deep"),  # RecursionError
        ("-" * 1000 + "1", "nests parentheses or signs more than"),
    ],
)
def test_parse_value_refuses_a_made_up_nan_and_deep_nesting(text: str, message: str) -> None:
    with pytest.raises(ValueSyntaxError, match=re.escape(message)):
        parse_value(text)


def test_parse_value_keeps_typed_nan_and_reasonable_nesting() -> None:
    """The references: a nan that was typed stays nan; nesting as deep as anyone writes still parses."""
    assert math.isnan(parse_value("nan*2")) and math.isnan(parse_value("nan-nan"))
    assert parse_value("(" * 50 + "-" * 40 + "2**-24" + ")" * 50) == 2.0**-24  # 40 minus signs: even


@pytest.mark.parametrize(
    ("argv", "second"),
    [(["1", "-d", "fp16", "--", "-2**-24"], -(2.0**-24)), (["1", "-d", "fp16", "2**-24"], 2.0**-24),
     (["-d", "fp16", "1", "--", "-2**-24"], -(2.0**-24))],
)
def test_cli_values_on_both_sides_of_an_option(argv: list[str], second: float,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """argparse took the VALUEs before -d only: the rest was refused, with a hint to use -- (already used)."""
    assert main(["formats", *argv]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith("fp16")]
    assert len(rows) == 2 and _torch_bit_string(1.0, FORMATS["fp16"]) in rows[0]
    assert _torch_bit_string(second, FORMATS["fp16"]) in rows[1]


def test_cli_takes_negative_numbers_in_exponent_form_and_infinity(capsys: pytest.CaptureFixture[str]) -> None:
    """A user trial: -1e-5 and -inf were read as unknown options (argparse's negative-number pattern knows
    only integers and plain decimals), and the top-level usage was printed."""
    assert main(["formats", "-d", "fp16", "-1e-5", "-inf", "-.5"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith("fp16")]
    assert [_torch_bit_string(v, FORMATS["fp16"]) in row for v, row in zip((-1e-5, -math.inf, -0.5), rows,
                                                                            strict=True)] == [True] * 3


@pytest.mark.parametrize("dtype", ["", ",", " , "])
def test_cli_dtype_that_names_no_format_is_refused(dtype: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The default formats were shown as if -d had not been given."""
    with pytest.raises(SystemExit) as exit_:
        main(["formats", "1", "-d", dtype])
    assert exit_.value.code == 2
    assert f"{dtype!r} names no format" in capsys.readouterr().err


def test_cli_shows_fp16_underflow(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["formats", "2**-25"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # no colour codes when not writing to a terminal
    fp16_row = next(line for line in out.splitlines() if "fp16" in line)
    assert "underflows to 0" in fp16_row
    assert _torch_bit_string(2.0**-25, FORMATS["fp16"]) in fp16_row
    bf16_row = next(line for line in out.splitlines() if "bf16" in line)
    assert _torch_bit_string(2.0**-25, FORMATS["bf16"]) in bf16_row and "exact" in bf16_row


def test_cli_overflow_and_chosen_formats(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["formats", "65520", "--dtype", "half,e4m3"]) == 0
    out = capsys.readouterr().out
    assert "overflows to inf" in out and "fp8_e4m3" in out and "bf16" not in out


def test_cli_table_of_formats(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    for fmt in FORMATS.values():
        assert fmt.name in out
    for dtype in (torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        assert f"{torch.finfo(dtype).max:.5g}" in out


def test_cli_bad_dtype_names_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["formats", "1", "--dtype", "fp16,fp12"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "fp12" in err and "fp16" in err and "bf16" in err and "fp8_e4m3" in err


def test_cli_bad_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["formats", "__import__('os')"])
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2"])
def test_caption_says_half_the_smallest_subnormal_itself_rounds_to_zero(
    name: str
) -> None:
    """The caption said "Below half the min subnormal": exactly half is a tie, rounded to even (0)."""
    from mixprec.commands.formats import _FORMATS_CAPTION

    fmt = FORMATS[name]
    half = info(fmt).smallest_subnormal / 2
    assert torch.tensor(half, dtype=torch.float64).to(fmt.torch_dtype).item() == 0.0
    assert torch.tensor(half * 1.0001, dtype=torch.float64).to(fmt.torch_dtype).item() > 0.0  # just above
    assert "At or below half the min subnormal a value rounds to 0" in " ".join(_FORMATS_CAPTION.split())


@pytest.mark.parametrize("fmt", TORCH_FORMATS, ids=_ids(TORCH_FORMATS))
def test_nan_bits_are_a_nan_and_the_note_says_torch_may_differ(fmt: formats.FloatFormat) -> None:
    """The docs said the NaN shown is "what torch produces"; fp32 -> bf16 on CPU gives 0xffff, not 0x7fc0."""
    d = decode(math.nan, fmt)
    ints = _INT_OF_WIDTH[fmt.bits]
    # torch reads the pattern shown as a NaN of its dtype: the bits are a real NaN encoding
    assert math.isnan(float(torch.tensor([d.encoding], dtype=torch.int64).to(ints).view(fmt.torch_dtype)))
    nan32 = torch.full((8,), math.nan, dtype=torch.float32)
    views = (nan32.to(fmt.torch_dtype).view(ints), torch.tensor([math.nan], dtype=fmt.torch_dtype).view(ints))
    casts = {bits & ((1 << fmt.bits) - 1) for view in views for bits in view.tolist()}
    if fmt.has_inf:  # the quiet NaN without payload: top mantissa bit only
        assert d.mantissa == 1 << (fmt.mantissa_bits - 1) and d.sign == 0
        if casts != {d.encoding}:  # torch set other NaN bits: the note must not claim they are torch's
            assert "torch's casts may set others" in " ".join(d.notes)
    else:  # fn formats have one NaN per sign; torch's positive NaN is it
        assert casts == {d.encoding} and d.notes == ("not a number",)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("1e400", "beyond float64's max"),  # float('1e400') is inf: every row showed inf, 'infinity'
        ("-1e400", "beyond float64's max"),
        ("1e-400", "below float64's range"),  # read as 0.0: every row showed 'zero'
        ("3.14159", "read as the nearest float64, 3.14158999999999988261834005243144929409027099609375"),
        ("0.5", None),  # a binary float: nothing to say
        ("65504", None),
        ("2**-25", None),  # an expression: computed in float64, as its title shows
        ("inf", None),
    ],
)
def test_a_decimal_that_float64_cannot_hold_is_said_so(text: str, said: str | None,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Reference: Python's decimal module, exact for every float64 (Decimal(float) is the float's value)."""
    from decimal import Decimal

    from mixprec.commands.formats import Value, as_read

    value = parse_value(text)
    if said is not None:
        assert Decimal(value) != Decimal(text)  # the cases that need a word do differ
    note = as_read(Value(text, value))
    assert (note is None) if said is None else (note is not None and said in note)
    assert main(["formats", "-d", "fp16", "--", text]) == 0
    assert (said is None) or said in " ".join(capsys.readouterr().out.split())
