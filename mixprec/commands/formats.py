"""``mixprec formats``: the float formats of mixed precision, and what each does to a number.

With no values it prints a table of the formats (bit layout, range, epsilon). With values it shows,
for each value and format, the stored bit pattern coloured by field, the value actually stored, the
rounding error and what happened (rounded, subnormal, underflow, overflow): why 2**-25 vanishes in
fp16 but survives in bf16.
"""

from __future__ import annotations

import argparse
import decimal
import io
import math
import re
from typing import TYPE_CHECKING, NamedTuple

from mixprec import formats
from mixprec.commands.console import make_console

if TYPE_CHECKING:
    from collections.abc import Sequence

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

HELP = "Show the float formats (fp32, fp16, bf16, fp8) and how each stores a value, bit by bit."
INTERMIXED = True  # VALUEs on both sides of -d, and after -- (mixprec.cli parses them intermixed)

# The three formats a mixed precision run moves between: fp32 masters, fp16 or bf16 compute.
DEFAULT_FORMATS: tuple[str, ...] = ("fp32", "fp16", "bf16")

# Field colours of a bit pattern; the spaces between fields keep it readable without colour.
SIGN_STYLE = "bold magenta"
EXPONENT_STYLE = "bold green"
MANTISSA_STYLE = "bold cyan"


class ValueSyntaxError(ValueError):
    """A VALUE argument that the expression parser cannot read."""


class Value(NamedTuple):
    text: str  # as typed, shown as the title
    value: float


# ---------------------------------------------------------------------------------------------------
# A tiny expression parser for VALUE arguments: numbers, names, + - * / ** (or ^) and parentheses.
# No eval(): a command-line argument must never run code.

_CONSTANTS: dict[str, float] = {
    "pi": math.pi,
    "e": math.e,
    "tau": math.tau,
    "inf": math.inf,
    "infinity": math.inf,
    "nan": math.nan,
}
_TOKEN = re.compile(
    r"\s*(?:(?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)|(?P<name>[A-Za-z_]\w*)|(?P<op>\*\*|[-+*/^()]))"
)


def _tokenize(text: str) -> list[str]:
    tokens, pos = [], 0
    while pos < len(text.rstrip()):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ValueSyntaxError(f"cannot read {text!r} at {text[pos:]!r}: {_EXPRESSION_HELP}")
        tokens.append(match.group(match.lastgroup or 0))
        pos = match.end()
    return ["**" if t == "^" else t for t in tokens]


_EXPRESSION_HELP = "use numbers (1e-4, 65504), pi, e, inf, nan, + - * /, ** or ^, and parentheses"


def _power(base: float, exponent: float) -> float:
    try:
        return math.pow(base, exponent)
    except OverflowError:  # 2**2000: the value is beyond float64, which every format here stores as inf
        odd = exponent.is_integer() and int(exponent) % 2 == 1
        return -math.inf if base < 0 and odd else math.inf
    except ValueError:
        raise ValueSyntaxError(f"{base!r} ** {exponent!r} is not a real number") from None


def _divide(a: float, b: float) -> float:
    if b == 0:
        raise ValueSyntaxError(f"division by zero in {a!r} / {b!r}: write inf or nan directly")
    return a / b


_BINARY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": _divide}

# Deeper nesting of parentheses or signs is refused: the parser recurses once per level (Python's stack
# ends near 1000), and no value a user types needs more.
MAX_DEPTH = 100


def _no_new_nan(result: float, text: str, *operands: float) -> float:
    """A NaN made from operands that are not NaN: inf - inf, 0 * inf, inf / inf. Typed as such it is nan
    written the long way; more often an intermediate overflowed float64 (10**400/10**399 is 10, computed
    as inf/inf), and showing nan would be a wrong answer without a word."""
    if math.isnan(result) and not any(math.isnan(x) for x in operands):
        raise ValueSyntaxError(
            f"{text} is undefined (nan). If a part overflowed float64 (beyond about 1.8e308) and became inf, "
            "write the value closer to its result (10**400/10**399 as 10); if you meant nan, write nan"
        )
    return result


class _Parser:
    """expr := term (('+'|'-') term)*;  term := unary (('*'|'/') unary)*;
    unary := ('+'|'-') unary | power;  power := atom ('**' unary)?;  atom := number | name | '(' expr ')'.
    As in Python, ** binds tighter than a unary minus on its left: -2**2 == -4, 2**-25 works."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokenize(text)
        self.pos = 0
        self.depth = 0

    def parse(self) -> float:
        value = self.expr()
        if self.pos != len(self.tokens):
            raise self.error(f"unexpected {self.tokens[self.pos]!r}")
        return value

    def error(self, problem: str) -> ValueSyntaxError:
        return ValueSyntaxError(f"cannot read {self.text!r}: {problem}; {_EXPRESSION_HELP}")

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise self.error("it ends too early")
        self.pos += 1
        return token

    def binary(self, operators: str, operand: str) -> float:
        value = getattr(self, operand)()
        while (op := self.peek()) is not None and op in operators:
            self.take()
            right = getattr(self, operand)()
            value = _no_new_nan(_BINARY[op](value, right), f"{value!r} {op} {right!r}", value, right)
        return value

    def expr(self) -> float:
        return self.binary("+-", "term")

    def term(self) -> float:
        return self.binary("*/", "unary")

    def unary(self) -> float:
        # every level of nesting, "(" or a sign, passes through here
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.error(f"it nests parentheses or signs more than {MAX_DEPTH} deep")
        if self.peek() in ("+", "-"):
            value = -self.unary() if self.take() == "-" else self.unary()
        else:
            value = self.power()
        self.depth -= 1
        return value

    def power(self) -> float:
        base = self.atom()
        if self.peek() == "**":
            self.take()
            exponent = self.unary()
            return _no_new_nan(_power(base, exponent), f"{base!r} ** {exponent!r}", base, exponent)
        return base

    def atom(self) -> float:
        token = self.take()
        if token == "(":
            value = self.expr()
            if self.take() != ")":
                raise self.error("missing ')'")
            return value
        if token[0].isdigit() or token[0] == ".":
            return float(token)  # float("1e400") is inf, as any format stores it
        if token.lower() in _CONSTANTS:
            return _CONSTANTS[token.lower()]
        raise self.error(f"unknown name {token!r}")


def parse_value(text: str) -> float:
    """Evaluate a number or a small arithmetic expression (``2**-25``, ``1/3``, ``pi``) without eval()."""
    return _Parser(text).parse()


# ---------------------------------------------------------------------------------------------------
# Arguments


def _value_arg(text: str) -> Value:
    try:
        return Value(text, parse_value(text))
    except ValueSyntaxError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _formats_arg(text: str) -> list[formats.FloatFormat]:
    names = [name for name in text.split(",") if name.strip()]
    if not names:  # -d "" or -d , : the default formats were shown as if nothing had been asked
        raise argparse.ArgumentTypeError(f"{text!r} names no format: pass e.g. -d fp16,bf16, or -d all")
    if any(name.strip().lower() == "all" for name in names):
        return list(formats.FORMATS.values())
    try:
        return [formats.get_format(name) for name in names]
    except formats.UnknownFormatError as err:
        raise argparse.ArgumentTypeError(f"{err}, or 'all'") from None


_DTYPE_FLAGS = ("--dtype", "-d")  # declared once: the hint below moves these with their values


# argparse reads a token that starts with "-" as an option unless it matches its negative-number pattern
# (integers and plain decimals only): -1e-5 and -inf, which a user counts as plain numbers, would be refused
# as unknown options. This command has no option that looks like a number, so those are VALUEs too.
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser._negative_number_matcher = _NEGATIVE_NUMBER  # see _NEGATIVE_NUMBER
    parser.add_argument(
        "values",
        nargs="*",
        type=_value_arg,
        metavar="VALUE",
        help="numbers or small expressions: 3.14159, 1e-4, 65504, 2**-25, 1/3, pi, inf, nan. "
        "Put -- before one that starts with a minus and is not a plain number (-1e-5 and -inf are): "
        "-- -2**-24",
    )
    parser.add_argument(
        *_DTYPE_FLAGS,
        type=_formats_arg,
        action="extend",
        default=None,
        metavar="FORMATS",
        help=f"comma-separated formats, or 'all': {', '.join(formats.FORMATS)}; aliases such as half, "
        f"bfloat16, e4m3 work too (default: {','.join(DEFAULT_FORMATS)} for values, all for the table)",
    )


def unrecognized_hint(extras: list[str], argv: Sequence[str] = ()) -> str | None:
    """argparse reads a VALUE such as -2**-24 as an unknown option; say how to pass it: the command line
    ``argv`` (the command's own arguments) rewritten with its options first and every VALUE after one
    ``--``. Only moving the negative VALUE would repeat what a user who wrote ``-2**-24 -- 3`` already did."""
    negative = [e for e in extras if e.startswith("-") and not e.startswith("--")]
    if not negative:
        return None
    options, values = _options_and_values(list(argv) or negative)
    line = " ".join(["mixprec formats", *options, "--", *values])
    return f"VALUEs go after one --, options before it: {line}"


def _options_and_values(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` split into the -d/--dtype options (with their arguments) and the VALUEs, each in order."""
    options: list[str] = []
    values: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == "--":
            continue  # what follows a -- is VALUEs, as is every other token
        if token in _DTYPE_FLAGS:
            options += [token, next(tokens, "")]
        elif token.startswith(("--dtype=", "-d")):  # no VALUE starts with -d: it is not a number or name
            options.append(token)
        else:
            values.append(token)
    return options, [v for v in values if v]


# ---------------------------------------------------------------------------------------------------
# Output


def run(args: argparse.Namespace) -> int:
    console = make_console()
    chosen: list[formats.FloatFormat] | None = args.dtype
    if not args.values:
        fmts = _unique(chosen or list(formats.FORMATS.values()))
        table = _formats_table(fmts)
        # Too narrow for one row per format: one block per format instead of cut-off columns.
        console.print(table if _fits(console, table) else _stacked_formats(fmts))
        console.print(_FORMATS_CAPTION)
        return 0
    selected = _unique(chosen or [formats.get_format(name) for name in DEFAULT_FORMATS])
    _print_legend(console)
    for value in args.values:
        console.print()
        _print_value(console, value, selected)
    return 0


def _unique(fmts: list[formats.FloatFormat]) -> list[formats.FloatFormat]:
    return list(dict.fromkeys(fmts))


def _fits(console: Console, table: Table) -> bool:
    """Whether ``table`` renders at the console's width without cutting any cell.

    rich crops a no_wrap cell, or a word longer than its column, when the table is too wide, and its
    measured minimum width is not a reliable bound for that; so render it (cheap, a few rows) at this
    width and at an unlimited one, and compare the words (not the rules, which change with width).
    """
    from rich.console import Console

    def words(width: int) -> list[str]:
        probe = Console(width=width, file=io.StringIO(), record=True, color_system=None)
        probe.print(table)
        return sorted(word for word in probe.export_text().split() if any(c.isalnum() for c in word))

    return words(console.width) == words(1 << 12)


# --- the table of formats


def _approx(x: float, sep: str = " ") -> str:
    """``2^-14 ≈ 6.1e-05``: exact power of two and its decimal size."""
    mantissa, exponent = math.frexp(x)
    return f"2^{exponent - 1}{sep}≈ {x:.2g}" if mantissa == 0.5 else f"{x:.4g}"


_OVERFLOW_TEXT = {
    formats.Overflow.INF: "has inf; overflow → ±inf",
    formats.Overflow.NAN: "no inf; overflow → NaN",
    formats.Overflow.SATURATE: "no inf; overflow → ±max",
}


_FORMATS_CAPTION = (
    "epsilon: the gap between 1 and the next number (relative precision). At or below half the min "
    "subnormal a value rounds to 0 (underflow: exactly half is a tie, rounded to even); beyond max it "
    "overflows."
)


def _formats_table(fmts: list[formats.FloatFormat]) -> Table:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(title="Floating-point formats", box=box.SIMPLE_HEAD, leading=1)
    for header in ("format\ntorch dtype", "bits\ns/e/m", "bias", "max", "min\nnormal", "min\nsubnormal",
                   "epsilon", "decimal\ndigits"):
        table.add_column(header, no_wrap=True)
    table.add_column("specials")
    table.add_column("used for")
    for fmt in fmts:
        fi = formats.info(fmt)
        table.add_row(
            Text.assemble((fmt.name, "bold"), "\n", (fmt.torch_name or "—", "dim")),
            f"{fi.bits} =\n1/{fi.exponent_bits}/{fi.mantissa_bits}",
            str(fi.bias),
            f"{fi.max:.5g}",
            _approx(fi.smallest_normal, "\n"),
            _approx(fi.smallest_subnormal, "\n"),
            _approx(fi.eps, "\n"),
            f"{fi.decimal_digits:.1f}",
            _OVERFLOW_TEXT[fmt.overflow],
            fmt.description,
        )
    return table


def _stacked_formats(fmts: list[formats.FloatFormat]) -> Table:
    from rich.table import Table

    table = Table.grid(padding=(0, 1))
    table.add_column(no_wrap=True, style="bold")
    table.add_column()
    for fmt in fmts:
        fi = formats.info(fmt)
        lines = (
            f"torch.{fmt.torch_name}" if fmt.torch_name else "no torch dtype",
            f"{fi.bits} bits = 1 sign, {fi.exponent_bits} exponent, {fi.mantissa_bits} mantissa; "
            f"bias {fi.bias}",
            f"max {fi.max:.5g}; min normal {_approx(fi.smallest_normal)}; "
            f"min subnormal {_approx(fi.smallest_subnormal)}",
            f"epsilon {_approx(fi.eps)}; ≈ {fi.decimal_digits:.1f} decimal digits; "
            f"{_OVERFLOW_TEXT[fmt.overflow]}",
            fmt.description,
        )
        table.add_row(fmt.name, "\n".join(lines) + "\n")
    return table


# --- one value in several formats


def _print_legend(console: Console) -> None:
    from rich.text import Text

    console.print(
        Text.assemble(
            ("sign", SIGN_STYLE), " ", ("exponent", EXPONENT_STYLE), " ", ("mantissa", MANTISSA_STYLE),
            " bits",
            "\n  normal:    (-1)^sign × 1.mantissa × 2^(exponent - bias)",
            "\n  subnormal: (-1)^sign × 0.mantissa × 2^(1 - bias), when the exponent bits are all 0",
        )
    )


class _Row(NamedTuple):
    """One format's view of a value, as the cells of either layout."""

    name: str
    bits: Text
    stored: str  # repr of the stored float
    scaled: str  # = significand × 2^exponent
    abs_error: str
    rel_error: str
    note: Text


def _bits_text(d: formats.Decoded) -> Text:
    from rich.text import Text

    fields = ((d.sign_bits, SIGN_STYLE), " ", (d.exponent_bits, EXPONENT_STYLE), " ")
    return Text.assemble(*fields, (d.mantissa_bits, MANTISSA_STYLE))


def _scaled(d: formats.Decoded) -> str:
    """The stored value as significand × 2^exponent, the way the bits say it."""
    if d.is_nan:
        return "NaN"
    if d.is_inf:
        return "-inf" if d.sign else "inf"
    if d.is_zero:
        return "-0" if d.sign else "0"
    return f"{'-' if d.sign else ''}{d.significand!r} × 2^{d.exponent}"


def _error(x: float) -> str:
    if math.isnan(x):
        return "—"
    return "0" if x == 0 else f"{x:.3g}"


def _note_style(d: formats.Decoded) -> str:
    if d.overflowed or d.underflowed or (math.isinf(d.value) and not d.is_inf):
        return "bold red"
    if d.is_subnormal:
        return "yellow"
    return "green" if d.exact else ""


def _row(value: float, fmt: formats.FloatFormat) -> _Row:
    from rich.text import Text

    d = formats.decode(value, fmt)
    return _Row(fmt.name, _bits_text(d), repr(d.stored), f"= {_scaled(d)}", _error(d.abs_error),
                _error(d.rel_error), Text(d.note, style=_note_style(d)))


def _print_value(console: Console, value: Value, fmts: list[formats.FloatFormat]) -> None:
    from rich.text import Text

    title = value.text if value.text == repr(value.value) else f"{value.text} = {value.value!r}"
    console.print(Text(title, style="bold"))
    note = as_read(value)
    if note is not None:
        console.print(note)
    rows = [_row(value.value, fmt) for fmt in fmts]
    table = _wide_table(rows)
    # A table too wide for the terminal would be cut into unreadable columns: stack each row instead.
    console.print(table if _fits(console, table) else _stacked_table(rows))


def as_read(value: Value) -> str | None:
    """What reading a typed decimal as a float64 did to it, when that is not nothing: every row's errors
    are against the float64 (an fp64 row's "exact" is about the float64, not the decimal)."""
    try:
        typed = decimal.Decimal(value.text.strip())
    except decimal.InvalidOperation:
        return None  # an expression, or a name: computed in float64, as the title shows
    if not typed.is_finite() or typed == 0 or decimal.Decimal(value.value) == typed:
        return None
    if math.isinf(value.value):
        return (f"beyond float64's max (about 1.8e308): read as {value.value!r}, so every row shows inf; the "
                "value overflows each of these formats too.")
    if value.value == 0:
        return ("below float64's range (under half its smallest subnormal, 4.9e-324): read as 0.0, so every "
                "row shows zero; the value underflows each of these formats too.")
    digits = str(decimal.Decimal(value.value))
    shown = digits if len(digits) <= _READ_DIGITS else digits[:_READ_DIGITS] + "..."
    return (f"not a binary float: read as the nearest float64, {shown}; errors are against that float64 "
            "(which fp64 stores exactly).")


_READ_DIGITS = 60  # a float64's exact decimal runs to ~750 digits for subnormals: enough to see it differ


def _wide_table(rows: list[_Row]) -> Table:
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, leading=1)
    table.add_column("format", no_wrap=True)
    table.add_column("sign exponent mantissa", no_wrap=True)
    table.add_column("stored", no_wrap=True)
    table.add_column("abs error", justify="right", no_wrap=True)
    table.add_column("rel error", justify="right", no_wrap=True)
    table.add_column("note")
    for row in rows:
        stored = f"{row.stored}\n{row.scaled}"
        table.add_row(row.name, row.bits, stored, row.abs_error, row.rel_error, row.note)
    return table


def _stacked_table(rows: list[_Row]) -> Table:
    from rich.table import Table
    from rich.text import Text

    table = Table.grid(padding=(0, 1))
    table.add_column(no_wrap=True, style="bold")
    table.add_column()
    for row in rows:
        stored = f"\nstored {row.stored} {row.scaled}"
        error = f"\nerror {row.abs_error} (relative {row.rel_error})\n"
        table.add_row(row.name, Text.assemble(row.bits, stored, error, row.note))
    return table
