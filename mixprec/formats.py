"""Floating-point formats of mixed precision: range, precision and bit layout, from first principles.

A format is only three numbers (sign, exponent and mantissa widths) plus how it spends its top
exponent on inf/NaN; everything else (bias, max, smallest normal and subnormal, epsilon) follows
from them and is computed here, not looked up, so the tests can check it against ``torch.finfo``.
:func:`decode` rounds a Python float to a format with integer arithmetic (round to nearest, ties to
even) and takes the result apart into its bit fields: the tests check it against torch's own cast.

This module is pure Python and imports torch only when a torch dtype is asked for, so
``mixprec formats`` and the docs can use it without loading torch. It is longer than most modules because
it holds one concept whole: a format's definition and the rounding into it are two views of the same
three numbers, and the tests check them against each other.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mixprec.errors import ConfigError, UnknownFormatError  # re-exported: it was defined here

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMATS",
    "Decoded",
    "FloatFormat",
    "FormatInfo",
    "Overflow",
    "Specials",
    "UnknownFormatError",
    "ValueKind",
    "decode",
    "get_format",
    "info",
    "representable",
    "round_to_format",
    "dtype_label",
    "ulp",
]


class Specials(str, enum.Enum):
    """How a format spends its largest exponent field."""

    # IEEE 754: the all-ones exponent is reserved; mantissa 0 is +-inf, anything else NaN.
    IEEE = "ieee"
    # OCP fp8 "fn" (finite): no inf, the all-ones exponent holds normal numbers, and only the single
    # pattern S.1111.111 is NaN. This buys e4m3 one more binade: max 448 instead of 240.
    FINITE = "fn"


class Overflow(str, enum.Enum):
    """What a cast does with a value whose rounded magnitude exceeds the format's max."""

    INF = "inf"  # IEEE 754 default (round to nearest): +-inf
    NAN = "nan"  # OCP's non-saturating e4m3fn mode; older torch releases cast this way on CPU
    # Clamp to +-max: torch's e4m3fn cast since pytorch#178817 (2026; torch 2.13 here), inf included.
    SATURATE = "saturate"


class ValueKind(str, enum.Enum):
    """The class of an encoded value."""

    ZERO = "zero"
    SUBNORMAL = "subnormal"
    NORMAL = "normal"
    INF = "inf"
    NAN = "nan"


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: 1 sign bit, ``exponent_bits`` and ``mantissa_bits``.

    ``mantissa_bits`` counts the stored fraction bits; normal numbers carry one more, implicit, leading
    1, so the precision is ``mantissa_bits + 1`` bits. The exponent is stored with the IEEE bias
    ``2**(exponent_bits - 1) - 1``.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    specials: Specials = Specials.IEEE
    # The rounding of a cast is always to nearest, ties to even; only the overflow differs by format.
    overflow: Overflow = Overflow.INF
    # Attribute of the torch module ("float16"); None where torch has no such dtype.
    torch_name: str | None = None
    aliases: tuple[str, ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        # decode() computes in float64, so every format must embed exactly in float64.
        if not 2 <= self.exponent_bits <= 11 or not 1 <= self.mantissa_bits <= 52:
            raise ConfigError(
                f"format {self.name!r} has exponent_bits={self.exponent_bits}, "
                f"mantissa_bits={self.mantissa_bits}: decode() works in float64 and cannot hold it",
                "use 2 <= exponent_bits <= 11 and 1 <= mantissa_bits <= 52",
            )
        if self.overflow is Overflow.INF and self.specials is not Specials.IEEE:
            raise ConfigError(
                f"format {self.name!r} has no inf, so it cannot overflow to inf",
                "use overflow=Overflow.NAN or Overflow.SATURATE",
            )

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        return (1 << (self.exponent_bits - 1)) - 1

    @property
    def has_inf(self) -> bool:
        return self.specials is Specials.IEEE

    @property
    def min_exponent(self) -> int:
        """True exponent of the smallest normal number; subnormals share it (with a leading 0)."""
        return 1 - self.bias

    @property
    def max_exponent(self) -> int:
        """True exponent of the largest finite binade."""
        top_field = (1 << self.exponent_bits) - 1
        # IEEE reserves the all-ones exponent for inf/NaN; "fn" formats use it for numbers.
        return (top_field - 1 if self.has_inf else top_field) - self.bias

    @property
    def max_significand(self) -> int:
        """Largest integer significand (implicit 1 included) at ``max_exponent``."""
        all_ones = (1 << (self.mantissa_bits + 1)) - 1
        # In "fn" formats the all-ones mantissa of the top binade is the NaN pattern.
        return all_ones if self.has_inf else all_ones - 1

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype, or None where this torch has none. Imports torch."""
        if self.torch_name is None:
            return None
        import torch

        return getattr(torch, self.torch_name, None)


# The formats of mixed precision training, widest first. Canonical name -> format.
FORMATS: dict[str, FloatFormat] = {
    f.name: f
    for f in (
        FloatFormat("fp64", 11, 52, torch_name="float64", aliases=("float64", "double"),
                    description="IEEE double: Python's float, the reference"),
        FloatFormat("fp32", 8, 23, torch_name="float32", aliases=("float32", "float", "single"),
                    description="IEEE single: master weights, accumulators, reductions"),
        FloatFormat("fp16", 5, 10, torch_name="float16", aliases=("float16", "half"),
                    description="IEEE half: needs loss scaling, small gradients underflow"),
        FloatFormat("bf16", 8, 7, torch_name="bfloat16", aliases=("bfloat16",),
                    description="brain float: fp32's range with 8 bits of precision"),
        FloatFormat("fp8_e4m3", 4, 3, Specials.FINITE, Overflow.SATURATE, torch_name="float8_e4m3fn",
                    aliases=("e4m3", "e4m3fn", "fp8_e4m3fn", "float8_e4m3fn"),
                    description="OCP fp8 e4m3fn: no inf, max 448; forward activations and weights"),
        FloatFormat("fp8_e5m2", 5, 2, torch_name="float8_e5m2", aliases=("e5m2", "float8_e5m2"),
                    description="OCP fp8 e5m2: fp16's range with 3 bits of precision; gradients"),
    )
}


def _normalize(name: str) -> str:
    key = name.strip().lower().replace("-", "_")
    return key.removeprefix("torch.")


_BY_ALIAS: dict[str, FloatFormat] = {
    _normalize(alias): fmt
    for fmt in FORMATS.values()
    for alias in (fmt.name, *fmt.aliases, *((fmt.torch_name,) if fmt.torch_name else ()))
}


def get_format(fmt: str | FloatFormat | torch.dtype) -> FloatFormat:
    """The format named ``fmt``: a canonical name ("fp16"), an alias ("half", "e4m3") or a torch dtype."""
    if isinstance(fmt, FloatFormat):
        return fmt
    key = _normalize(fmt if isinstance(fmt, str) else str(fmt))
    try:
        return _BY_ALIAS[key]
    except KeyError:
        aliases = ", ".join(sorted(a for a in _BY_ALIAS if a not in FORMATS))
        raise UnknownFormatError(
            f"unknown float format {str(fmt)!r}", f"use one of {', '.join(FORMATS)} (aliases: {aliases})"
        ) from None


def dtype_label(dtype: object) -> str:
    """Short name of a torch dtype for tables: ``torch.float16`` -> ``"fp16"``; dtypes that are not float
    formats (int64, bool) keep torch's name without the ``torch.`` prefix."""
    try:
        return get_format(dtype).name  # type: ignore[arg-type]
    except UnknownFormatError:
        return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class FormatInfo:
    """Range and precision of a format, computed from its bit layout. Mirrors ``torch.finfo``."""

    name: str
    bits: int
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_exponent: int  # true exponent of the largest binade
    min_exponent: int  # true exponent of the smallest normal binade (1 - bias)
    max: float  # largest finite value
    min: float  # most negative finite value, -max (torch.finfo's meaning, not the smallest positive)
    smallest_normal: float  # 2**min_exponent; torch.finfo calls it smallest_normal and tiny
    smallest_subnormal: float  # 2**(min_exponent - mantissa_bits); half of it rounds to 0
    eps: float  # 2**-mantissa_bits: the gap between 1 and the next larger number
    precision: int  # decimal digits always kept: floor(mantissa_bits * log10 2), as torch.finfo
    resolution: float  # 10**-precision, as torch.finfo
    decimal_digits: float  # (mantissa_bits + 1) * log10 2: significant decimal digits, roughly
    has_inf: bool
    overflow: Overflow

    @property
    def tiny(self) -> float:
        """Alias of ``smallest_normal``, as in ``torch.finfo``."""
        return self.smallest_normal


@functools.cache
def _info(fmt: FloatFormat) -> FormatInfo:
    m = fmt.mantissa_bits
    largest = math.ldexp(fmt.max_significand, fmt.max_exponent - m)
    precision = math.floor(m * math.log10(2))  # m*log10(2) is irrational for m >= 1: no edge case
    return FormatInfo(
        name=fmt.name,
        bits=fmt.bits,
        exponent_bits=fmt.exponent_bits,
        mantissa_bits=m,
        bias=fmt.bias,
        max_exponent=fmt.max_exponent,
        min_exponent=fmt.min_exponent,
        max=largest,
        min=-largest,
        smallest_normal=math.ldexp(1.0, fmt.min_exponent),
        smallest_subnormal=math.ldexp(1.0, fmt.min_exponent - m),
        eps=math.ldexp(1.0, -m),
        precision=precision,
        resolution=10.0**-precision,
        decimal_digits=(m + 1) * math.log10(2),
        has_inf=fmt.has_inf,
        overflow=fmt.overflow,
    )


def info(fmt: str | FloatFormat | torch.dtype) -> FormatInfo:
    """Range and precision of ``fmt`` (a name, alias, :class:`FloatFormat` or torch dtype)."""
    return _info(get_format(fmt))


@dataclass(frozen=True)
class Decoded:
    """A value rounded to a format and taken apart into its bit fields.

    ``sign``, ``biased_exponent`` and ``mantissa`` are the integer fields; ``sign_bits``,
    ``exponent_bits`` and ``mantissa_bits`` the same as bit strings. ``stored`` is the value the
    format actually holds (exactly, as a Python float).
    """

    value: float  # the input
    format: FloatFormat
    stored: float
    kind: ValueKind
    sign: int
    biased_exponent: int
    mantissa: int
    overflowed: bool  # a finite input whose rounded magnitude is beyond max
    underflowed: bool  # a nonzero finite input that became zero

    @property
    def exponent(self) -> int | None:
        """True (unbiased) exponent: ``stored = +-significand * 2**exponent``; None for 0, inf, NaN."""
        if self.kind is ValueKind.NORMAL:
            return self.biased_exponent - self.format.bias
        # Subnormals have biased exponent 0 but scale like the smallest normal, with a leading 0.
        return self.format.min_exponent if self.kind is ValueKind.SUBNORMAL else None

    @property
    def significand(self) -> float:
        """``1.mantissa`` for normal numbers, ``0.mantissa`` for subnormals and zero; NaN for inf, NaN."""
        if self.kind in (ValueKind.INF, ValueKind.NAN):
            return math.nan
        lead = 1 if self.kind is ValueKind.NORMAL else 0
        return lead + math.ldexp(self.mantissa, -self.format.mantissa_bits)

    @property
    def encoding(self) -> int:
        """The whole bit pattern as an unsigned integer."""
        fmt = self.format
        return (self.sign << (fmt.bits - 1)) | (self.biased_exponent << fmt.mantissa_bits) | self.mantissa

    @property
    def sign_bits(self) -> str:
        return str(self.sign)

    @property
    def exponent_bits(self) -> str:
        return format(self.biased_exponent, f"0{self.format.exponent_bits}b")

    @property
    def mantissa_bits(self) -> str:
        return format(self.mantissa, f"0{self.format.mantissa_bits}b")

    @property
    def bit_string(self) -> str:
        """Fields separated by spaces, e.g. ``0 10000 1001001000`` for pi in fp16."""
        return f"{self.sign_bits} {self.exponent_bits} {self.mantissa_bits}"

    @property
    def is_zero(self) -> bool:
        return self.kind is ValueKind.ZERO

    @property
    def is_subnormal(self) -> bool:
        return self.kind is ValueKind.SUBNORMAL

    @property
    def is_inf(self) -> bool:
        return self.kind is ValueKind.INF

    @property
    def is_nan(self) -> bool:
        return self.kind is ValueKind.NAN

    @property
    def exact(self) -> bool:
        """True when the format holds the input exactly (NaN counts as exact)."""
        return self.stored == self.value or (math.isnan(self.stored) and math.isnan(self.value))

    @property
    def abs_error(self) -> float:
        """``|stored - value|``. Exact in float64 unless the value overflowed: a rounded ``stored`` is 0
        or within a factor 2 of ``value`` (Sterbenz lemma)."""
        if self.exact:
            return 0.0
        return abs(self.stored - self.value)

    @property
    def rel_error(self) -> float:
        """``abs_error / |value|``; 0 for an exact input (including 0), inf or NaN where undefined."""
        if self.exact:
            return 0.0
        if math.isinf(self.value) or math.isnan(self.value):
            return math.nan
        return self.abs_error / abs(self.value)

    @property
    def notes(self) -> tuple[str, ...]:
        """Short explanations of what happened to the value, e.g. ``("underflows to 0 ...",)``."""
        return _notes(self)

    @property
    def note(self) -> str:
        return "; ".join(self.notes)


def _pow2(x: float) -> str:
    """``2^-24`` for an exact power of two, else ``%g``."""
    mantissa, exponent = math.frexp(x)
    return f"2^{exponent - 1}" if mantissa == 0.5 else f"{x:g}"


def _notes(d: Decoded) -> tuple[str, ...]:
    fmt = d.format
    fi = _info(fmt)
    if math.isnan(d.value):
        if not fmt.has_inf:  # an fn format has one NaN pattern per sign: the one shown
            return ("not a number",)
        return ("not a number; the bits shown are IEEE's quiet NaN, torch's casts may set others",)
    if math.isinf(d.value):
        if d.is_inf:
            return ("infinity",)
        becomes = "NaN" if d.is_nan else f"max {fi.max:g} (saturates)"
        return (f"inf becomes {becomes}: {fmt.name} has no inf",)
    if d.overflowed:
        what = {
            Overflow.INF: f"overflows to inf: max is {fi.max:g}",
            Overflow.NAN: f"overflows to NaN: max is {fi.max:g} and {fmt.name} has no inf",
            Overflow.SATURATE: f"overflows: saturates to max {fi.max:g}",
        }
        return (what[fmt.overflow],)
    if d.underflowed:
        tiny = fi.smallest_subnormal
        return (f"underflows to 0: |x| ≤ {_pow2(tiny / 2)}, half the smallest subnormal {_pow2(tiny)}",)
    if d.value == 0:
        return ("zero",)
    notes = []
    if d.is_subnormal:
        kept, bits = d.mantissa.bit_length(), fmt.mantissa_bits + 1
        below = _pow2(fi.smallest_normal)
        notes.append(f"subnormal (below {below}): keeps {kept} of {bits} significant bits")
    notes.append("exact" if d.exact else "rounded")
    return tuple(notes)


def _round_shift(n: int, shift: int) -> int:
    """``n / 2**shift`` rounded to nearest, ties to even (``n >= 0``; a negative shift multiplies)."""
    if shift <= 0:
        return n << -shift
    quotient, remainder = divmod(n, 1 << shift)
    half = 1 << (shift - 1)
    if remainder > half or (remainder == half and quotient & 1):
        quotient += 1
    return quotient


def _special(
    value: float, fmt: FloatFormat, sign: int, kind: ValueKind, overflowed: bool = False
) -> Decoded:
    """Encode +-inf, NaN, or (for saturating overflow) +-max."""
    top = (1 << fmt.exponent_bits) - 1
    m = fmt.mantissa_bits
    if kind is ValueKind.INF:
        return Decoded(value, fmt, -math.inf if sign else math.inf, kind, sign, top, 0, overflowed, False)
    if kind is ValueKind.NAN:
        # IEEE 754 leaves NaN payloads open; we show its quiet NaN with no payload (top mantissa bit only;
        # fn formats: their one NaN pattern, all ones). torch's casts do not always give it: from fp32 on
        # CPU, fp16 gets 0x7e00 but bf16 0xffff (sign and all mantissa bits set) and e5m2 0x7f.
        mantissa = 1 << (m - 1) if fmt.has_inf else (1 << m) - 1
        return Decoded(value, fmt, math.nan, kind, sign, top, mantissa, overflowed, False)
    largest = _info(fmt).max
    biased = fmt.max_exponent + fmt.bias
    mantissa = fmt.max_significand - (1 << m)
    stored = -largest if sign else largest
    return Decoded(value, fmt, stored, ValueKind.NORMAL, sign, biased, mantissa, overflowed, False)


def _overflow(value: float, fmt: FloatFormat, sign: int) -> Decoded:
    kind = {Overflow.INF: ValueKind.INF, Overflow.NAN: ValueKind.NAN, Overflow.SATURATE: ValueKind.NORMAL}
    return _special(value, fmt, sign, kind[fmt.overflow], overflowed=math.isfinite(value))


def _overflow_policy(overflow: Overflow | str) -> Overflow:
    try:
        return Overflow(overflow)
    except ValueError:
        choices = ", ".join(repr(o.value) for o in Overflow)
        raise ConfigError(f"unknown overflow policy {overflow!r}", f"use one of {choices}") from None


def decode(
    value: float, fmt: str | FloatFormat | torch.dtype, *, overflow: Overflow | str | None = None
) -> Decoded:
    """Round ``value`` to ``fmt`` (to nearest, ties to even) and take the result apart into bit fields.

    The rounding is of the exact value of the Python float (float64). torch rounds float64 inputs
    (``torch.tensor(x, dtype=torch.float16)``, ``.to()`` from float64) through float32 first, which
    differs when the first rounding lands exactly on a tie of the second (``1 + 2**-11 + 2**-40`` in
    fp16). For float32 inputs, which is what mixed precision casts, the two agree bit for bit.

    ``overflow`` overrides the format's overflow policy, e.g. ``Overflow.NAN`` for e4m3fn as the OCP
    non-saturating mode and older torch releases do.
    """
    fmt = get_format(fmt)
    if overflow is not None:
        fmt = dataclasses.replace(fmt, overflow=_overflow_policy(overflow))
    value = float(value)
    sign = 1 if math.copysign(1.0, value) < 0 else 0
    if math.isnan(value):
        return _special(value, fmt, sign, ValueKind.NAN)
    if math.isinf(value):
        return _special(value, fmt, sign, ValueKind.INF) if fmt.has_inf else _overflow(value, fmt, sign)
    if value == 0:
        return Decoded(value, fmt, value, ValueKind.ZERO, sign, 0, 0, False, False)
    return _decode_finite(value, fmt, sign)


def _decode_finite(value: float, fmt: FloatFormat, sign: int) -> Decoded:
    m = fmt.mantissa_bits
    # |value| = frac * 2**e exactly, frac in [0.5, 1): as an integer, |value| = n * 2**(e - 53).
    frac, e = math.frexp(abs(value))
    n = int(frac * (1 << 53))
    # The format's spacing (ulp) at |value| is 2**q: m fraction bits below the leading bit, but never
    # finer than at the smallest normal binade, which is what makes subnormals evenly spaced.
    q = max(e - 1, fmt.min_exponent) - m
    significand = _round_shift(n, q - (e - 53))  # stored magnitude = significand * 2**q
    top_q = fmt.max_exponent - m
    # Overflow is judged after rounding, as IEEE 754 says: 65519 rounds down to 65504 in fp16.
    if q > top_q or (q == top_q and significand > fmt.max_significand):
        return _overflow(value, fmt, sign)
    if significand == 0:
        return Decoded(value, fmt, -0.0 if sign else 0.0, ValueKind.ZERO, sign, 0, 0, False, True)
    if significand >> (m + 1):  # rounding carried into the next binade: 1.111 -> 10.000
        significand >>= 1
        q += 1
    stored = math.copysign(math.ldexp(significand, q), value)
    if significand >> m:  # leading 1 present: normal
        biased, mantissa = q + m + fmt.bias, significand - (1 << m)
        return Decoded(value, fmt, stored, ValueKind.NORMAL, sign, biased, mantissa, False, False)
    return Decoded(value, fmt, stored, ValueKind.SUBNORMAL, sign, 0, significand, False, False)


def round_to_format(value: float, fmt: str | FloatFormat | torch.dtype) -> float:
    """The value ``fmt`` stores for ``value`` (round to nearest even, the format's overflow policy)."""
    return decode(value, fmt).stored


def representable(value: float, fmt: str | FloatFormat | torch.dtype) -> bool:
    """True when ``fmt`` holds ``value`` exactly (NaN is representable in every format here)."""
    return decode(value, fmt).exact


def ulp(value: float, fmt: str | FloatFormat | torch.dtype) -> float:
    """Spacing of ``fmt`` at ``value``: the gap from the stored value to the next one away from 0.

    ``ulp(1.0, f) == info(f).eps``; for zero and subnormals it is the smallest subnormal; NaN for
    inf and NaN.
    """
    d = decode(value, fmt)
    if d.kind in (ValueKind.INF, ValueKind.NAN):
        return math.nan
    exponent = d.exponent if d.exponent is not None else d.format.min_exponent
    return math.ldexp(1.0, exponent - d.format.mantissa_bits)
