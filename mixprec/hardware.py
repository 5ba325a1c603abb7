"""Which half-precision arithmetic this machine runs at speed: torch's own kernels, or mixprec's emulation.

A half-precision GEMM can run two ways:

- **native**: torch's fp16/bf16 kernels (tensor cores, AVX-512 BF16, AMX). Fast where the hardware has the
  units; on a CPU without them torch falls back to scalar reference loops (measured on an AVX2-only EPYC:
  bf16 GEMM 0.5 GFLOP/s against 45-88 for fp32, i.e. ~90x slower).
- **emulated**: what a tensor core computes, done with fp32 kernels -- inputs rounded to the half format,
  exact fp32 upcast (every fp16/bf16 value is an fp32 value, and the product of two has at most 22 / 16
  significant bits, exact in fp32's 24), fp32 accumulation, one rounding of the result
  (``mixprec/emulation.py``). Same numerics as the hardware, at about fp32's speed.

:func:`half_arithmetic` decides, per (device type, dtype), once per process and cheaply:

1. an explicit ``override`` argument, else
2. the ``MIXPREC_HALF_ARITHMETIC`` environment variable (``native`` or ``emulated``, or per dtype:
   ``fp16=emulated,bf16=native``, each part optionally for one device type: ``cpu:fp16=emulated``; read
   at every call so a test or a launcher can set it), else
3. a query of what torch itself reports (oneDNN's bf16/fp16 support, the CPU's bf16/fp16 units, the CUDA
   compute capability) where that answer is reliable, else
4. a tiny timed probe: one half GEMM against one fp32 GEMM of the same size, then, if the half GEMM
   keeps up, one small convolution's forward and weight gradient against fp32's (a CPU whose fp16 GEMMs
   kept up ran its fp16 convolution weight gradient 100-250x slower).

The answer is a frozen :class:`HalfArithmetic` that says what was decided, by which of those, and why.
``mixprec info`` prints it.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import platform
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.errors import ConfigError, UnknownArithmeticError  # re-exported: it was defined here
from mixprec.formats import dtype_label

__all__ = [
    "ENV_VAR",
    "Arithmetic",
    "Decider",
    "HalfArithmetic",
    "clear_cache",
    "conv_grad_gflops",
    "cpu_flags",
    "emulated_dtypes",
    "gemm_gflops",
    "half_arithmetic",
    "hardware_line",
]

ENV_VAR = "MIXPREC_HALF_ARITHMETIC"

HALF_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)


class Arithmetic(str, enum.Enum):
    """How half-precision GEMMs and convolutions are computed."""

    NATIVE = "native"  # torch's fp16/bf16 kernels
    EMULATED = "emulated"  # fp32 kernels on half-rounded inputs, result rounded once (emulation.py)


class Decider(str, enum.Enum):
    """What made the decision, strongest first."""

    ARGUMENT = "argument"
    ENVIRONMENT = "environment"
    QUERY = "query"
    PROBE = "probe"


@dataclass(frozen=True)
class HalfArithmetic:
    """The arithmetic mixprec uses for ``dtype`` GEMMs/convolutions on ``device_type``, and why."""

    device_type: str
    dtype: torch.dtype
    arithmetic: Arithmetic
    decided_by: Decider
    reason: str

    def __post_init__(self) -> None:
        if self.dtype not in HALF_DTYPES:
            raise ConfigError(
                f"half arithmetic is decided for fp16 and bf16, not {self.dtype}",
                "use torch.float16 or torch.bfloat16",
            )

    @property
    def emulated(self) -> bool:
        return self.arithmetic is Arithmetic.EMULATED


def _parse(value: str | Arithmetic, where: str) -> Arithmetic:
    try:
        return Arithmetic(value.strip().lower() if isinstance(value, str) else value)
    except ValueError:
        raise UnknownArithmeticError(
            f"{where} is {value!r}, which is not an arithmetic",
            f"use one of {', '.join(a.value for a in Arithmetic)} (or leave it unset to detect)",
        ) from None


def half_arithmetic(
    device_type: str, dtype: torch.dtype, override: str | Arithmetic | None = None
) -> HalfArithmetic:
    """Decide how ``dtype`` GEMMs/convs run on ``device_type``: argument, env var, query, then probe.

    Detection runs once per (device type, dtype) and is cached; an override costs nothing. A probe, where
    one is needed, times two small GEMMs (milliseconds) and, where the half one keeps up, two small
    convolutions' forward and weight gradient (up to ~1 s on a CPU: a process's first convolution backward
    initialises torch's kernels), and forces a device sync.
    """
    if override is not None:
        arithmetic = _parse(override, "override")
        return HalfArithmetic(device_type, dtype, arithmetic, Decider.ARGUMENT, "set by the caller")
    env = _env_choice(device_type, dtype)
    if env is not None:
        reason = f"{ENV_VAR}={os.environ[ENV_VAR].strip()}"
        return HalfArithmetic(device_type, dtype, env, Decider.ENVIRONMENT, reason)
    return _detect(device_type, dtype)


def _env_choice(device_type: str, dtype: torch.dtype) -> Arithmetic | None:
    choices, label = _env_choices(), dtype_label(dtype)
    return choices.get((device_type, label), choices.get((None, label)))


def _env_choices() -> dict[tuple[str | None, str], Arithmetic]:
    """``MIXPREC_HALF_ARITHMETIC``: ``native``/``emulated`` for both dtypes, or per dtype
    (``fp16=emulated,bf16=native``; a dtype not named is detected), each part optionally for one device type
    (``cpu:fp16=emulated``, ``cuda:native``; a device's own part wins over one for every device). Read
    whole, whichever dtype is asked about: a bad part, or a dtype named twice for a device, is an error now,
    not ignored."""
    return _read_env(os.environ.get(ENV_VAR, "").strip())


_ENV_FIX = ("write native or emulated, or each dtype once, optionally for one device type: "
            "fp16=emulated,bf16=native or cpu:fp16=emulated")


@functools.lru_cache(maxsize=8)  # asked on every forward of a region: parsed once per text (errors re-raise)
def _read_env(text: str) -> dict[tuple[str | None, str], Arithmetic]:
    choices: dict[tuple[str | None, str], Arithmetic] = {}
    if not text:
        return choices
    for item in (part.strip() for part in text.split(",")):
        device, colon, rest = (part.strip() for part in item.rpartition(":"))
        name, sep, value = (part.strip() for part in rest.partition("="))
        names = [name.lower()] if sep else list(_ENV_DTYPES)  # no "=": the value, for both dtypes
        if colon and not _is_device_type(device):
            raise UnknownArithmeticError(
                f"{ENV_VAR}={text!r}: {device!r} in {item!r} is not a torch device type",
                "name a device type as torch.device does, without an index: cpu, cuda, xpu or mps",
            )
        if not item or not set(names) <= set(_ENV_DTYPES):
            raise UnknownArithmeticError(f"{ENV_VAR}={text!r}: cannot read {item!r}", _ENV_FIX)
        what = ":".join(filter(None, (device if colon else "", name.lower() if sep else "")))
        arithmetic = _parse(value if sep else name, f"{ENV_VAR}={text!r}: {what}" if what else ENV_VAR)
        for dtype in names:
            key = (device.lower() if colon else None, dtype)
            if key in choices:
                twice = f"names {dtype}{f' on {key[0]}' if key[0] else ''} twice"
                raise UnknownArithmeticError(f"{ENV_VAR}={text!r}: {twice}", _ENV_FIX)
            choices[key] = arithmetic
    return choices


def _is_device_type(name: str) -> bool:
    try:
        return torch.device(name.lower()).index is None  # "cuda", not "cuda:0": the choice is per type
    except RuntimeError:
        return False


_ENV_DTYPES = ("fp16", "bf16")


def emulated_dtypes(device_type: str) -> frozenset[torch.dtype]:
    """The half dtypes whose GEMMs mixprec emulates on ``device_type`` (env override honoured)."""
    return frozenset(d for d in HALF_DTYPES if half_arithmetic(device_type, d).emulated)


def clear_cache() -> None:
    """Forget detected answers (tests; a process that changed its thread count or device)."""
    _DETECTED.clear()


# --------------------------------------------------------------------------------------------------------
# Detection: one function per device type (a table, so a new backend is one entry)
# --------------------------------------------------------------------------------------------------------

_Verdict = tuple[Arithmetic, Decider, str]


# A plain dict, not functools.cache: torch.compile traces through a cache wrapper (it warns and re-runs the
# detection while tracing), while a dict hit is an ordinary lookup it can guard on.
_DETECTED: dict[tuple[str, torch.dtype], HalfArithmetic] = {}


def _detect(device_type: str, dtype: torch.dtype) -> HalfArithmetic:
    key = (device_type, dtype)
    if key not in _DETECTED:
        detector = _DETECTORS.get(device_type, _detect_by_probe)
        with _as_measured(device_type):
            _DETECTED[key] = HalfArithmetic(device_type, dtype, *detector(device_type, dtype))
    return _DETECTED[key]


@contextlib.contextmanager
def _as_measured(device_type: str) -> Iterator[None]:
    """What a probe measures must not depend on where detection was first asked for (a model's first
    forward, inside an autocast region, under no_grad or inference_mode): gradients on, autocast and
    torch-function modes (mixprec's own regions) off, and on the CPU one thread. With two threads on a
    loaded 2-core machine, torch's OpenMP waits made fp32's GEMM read 6-290 GFLOP/s from one call to the
    next and the probe's verdict a coin toss; one thread compares the kernels, not the scheduler."""
    threads = torch.get_num_threads()
    try:
        no_autocast: contextlib.AbstractContextManager[Any] = torch.autocast(device_type, enabled=False)
    except RuntimeError:  # a device type autocast does not know: nothing of it to turn off
        no_autocast = contextlib.nullcontext()
    try:
        if device_type == "cpu":
            torch.set_num_threads(1)
        with torch.inference_mode(False), torch.enable_grad(), no_autocast, torch._C.DisableTorchFunction():
            yield
    finally:
        torch.set_num_threads(threads)


def cpu_flags() -> Mapping[str, bool]:
    """The CPU features that decide half-precision speed (torch's own cpuinfo reading)."""
    caps = torch.cpu.get_capabilities()
    names = ("avx2", "avx512_f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "bf16", "sve_bf16")
    return {name: bool(caps[name]) for name in names if name in caps}


def _cpu_has(*names: str) -> str | None:
    flags = cpu_flags()
    return next((name for name in names if flags.get(name)), None)


# A CPU's half units, per dtype: any one of these makes oneDNN's kernels for that dtype run at speed.
# avx512_fp16 alone is not one: on an AMX Xeon (amx_bf16, avx512_fp16, no amx_fp16; 2026-11-26) torch's
# fp16 GEMMs ran at 0.87x of fp32's rate and its fp16 convolution weight gradient 100-250x slower than
# fp32's, so such a CPU is probed (and emulates fp16).
_CPU_UNITS: dict[torch.dtype, tuple[str, ...]] = {
    torch.bfloat16: ("amx_bf16", "avx512_bf16", "bf16", "sve_bf16"),
    torch.float16: ("amx_fp16",),
}

# Whether oneDNN (torch's CPU GEMM library) has kernels for the dtype at all. Where it has none, torch
# runs its scalar fallback (the ~90x case), so a False answer is reliable and needs no probe.
_ONEDNN_SUPPORT: dict[torch.dtype, Callable[[], bool]] = {
    torch.bfloat16: lambda: bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    torch.float16: lambda: bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()),
}


def _detect_cpu(device_type: str, dtype: torch.dtype) -> _Verdict:
    name = dtype_label(dtype)
    if not _ONEDNN_SUPPORT[dtype]():
        reason = f"torch has no oneDNN {name} kernels on this CPU: its {name} GEMMs run a scalar fallback"
        return Arithmetic.EMULATED, Decider.QUERY, reason
    unit = _cpu_has(*_CPU_UNITS[dtype])
    if unit is not None:
        return Arithmetic.NATIVE, Decider.QUERY, f"the CPU has {name} units ({unit}) and oneDNN uses them"
    # oneDNN supports the dtype without units it is known to use throughout (plain AVX-512 converts to fp32
    # inside the kernel; avx512_fp16 alone, above): whether that beats the emulation depends on the
    # kernels, so measure them.
    return _detect_by_probe(device_type, dtype)


def _detect_cuda(device_type: str, dtype: torch.dtype) -> _Verdict:
    if not torch.cuda.is_available():
        return Arithmetic.NATIVE, Decider.QUERY, "CUDA is not available; nothing runs there"
    major, minor = torch.cuda.get_device_capability()
    # Tensor cores: fp16 since Volta (sm_70), bf16 since Ampere (sm_80).
    needed = {torch.float16: (7, 0), torch.bfloat16: (8, 0)}[dtype]
    name = dtype_label(dtype)
    if (major, minor) >= needed:
        return Arithmetic.NATIVE, Decider.QUERY, f"sm_{major}{minor} has {name} tensor cores"
    return _detect_by_probe(device_type, dtype)


_DETECTORS: dict[str, Callable[[str, torch.dtype], _Verdict]] = {"cpu": _detect_cpu, "cuda": _detect_cuda}

# The probe's GEMM: 256^3 is 34 MFLOP, under a millisecond at fp32 speed and ~70 ms at the slowest half
# rate seen (0.5 GFLOP/s), yet large enough for a blocked kernel to reach its steady rate.
PROBE_SIZE = 256
# Emulation costs about one fp32 GEMM plus the casts around it (1.06-1.23x of fp32 measured), so a native
# kernel is worth using only if it is at least as fast as the fp32 one.
NATIVE_MAX_TIME_RATIO = 1.0


# A native convolution may be this much slower than fp32's before the emulation (about fp32's speed) is
# chosen for it: the bar is looser than the GEMMs' because the probe is small and the two share one
# decision (a 4x faster half GEMM is worth a somewhat slower convolution); the case it exists for is the
# 100x one.
CONV_MAX_TIME_RATIO = 2.0


def _detect_by_probe(device_type: str, dtype: torch.dtype) -> _Verdict:
    name = dtype_label(dtype)
    try:
        half = gemm_gflops(device_type, dtype, PROBE_SIZE)
        full = gemm_gflops(device_type, torch.float32, PROBE_SIZE)
    except (RuntimeError, TypeError) as err:  # no kernel for this dtype/device at all
        return Arithmetic.EMULATED, Decider.PROBE, f"torch has no {name} GEMM here ({err})"
    rates = f"{name} GEMM {half:.1f} GFLOP/s vs fp32 {full:.1f}"
    if full > half * NATIVE_MAX_TIME_RATIO:
        return Arithmetic.EMULATED, Decider.PROBE, f"{rates}: fp32 kernels are faster"
    slow = _slow_convolution(device_type, dtype)
    if slow is not None:
        return Arithmetic.EMULATED, Decider.PROBE, f"{rates}, but {slow}"
    return Arithmetic.NATIVE, Decider.PROBE, f"{rates}: the native kernel is at least as fast"


def _slow_convolution(device_type: str, dtype: torch.dtype) -> str | None:
    """Why ``dtype`` convolutions are too slow to run natively (their weight gradient, the kernel oneDNN
    lacks first, timed against fp32's), or None where they are fast enough or the device has none."""
    name = dtype_label(dtype)
    try:
        half, full = conv_grad_gflops(device_type, (dtype, torch.float32))
    except (RuntimeError, TypeError) as err:  # no convolution kernel for this dtype at all
        return f"torch has no {name} convolution here ({err})"
    if full > half * CONV_MAX_TIME_RATIO:
        return (f"its {name} convolution weight gradient runs at {half:.2f} GFLOP/s against fp32's "
                f"{full:.1f}: fp32 kernels are faster")
    return None


def _probe_values(shape: tuple[int, ...], device_type: str, dtype: torch.dtype) -> torch.Tensor:
    """Normal values for a timing, from a generator of their own: a probe must not move the global RNG (a
    seeded run would draw other data depending on whether detection was cached)."""
    values = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    return values.to(device_type).to(dtype)


def _timer(run: Callable[[], object], device_type: str, warmups: int) -> Callable[[], float]:
    """A timer of one call of ``run`` (seconds; syncs), after ``warmups`` untimed calls (kernel selection,
    lazy initialisation)."""

    def timed() -> float:
        start = time.perf_counter()
        run()
        synchronize(device_type)
        return time.perf_counter() - start

    for _ in range(warmups):
        timed()
    return timed


def gemm_gflops(device_type: str, dtype: torch.dtype, n: int, repeats: int = 3) -> float:
    """The best rate of ``repeats`` n x n x n GEMMs in ``dtype`` on ``device_type`` (GFLOP/s; syncs)."""
    a = _probe_values((n, n), device_type, dtype)
    b = _probe_values((n, n), device_type, dtype)
    timed = _timer(lambda: torch.mm(a, b), device_type, warmups=1)
    return 2.0 * n**3 / min(timed() for _ in range(repeats)) / 1e9


# The probe's convolution: a 3x3 over 16 channels of 16x16 images, batch 8 (9.4 MFLOP forward): well under a
# millisecond at fp32's rate, ~0.1 s at the slow rate it exists to catch.
CONV_PROBE_SHAPE = (8, 16, 16, 16)  # N, C, H, W; as many output channels as input ones


def _conv_pass(device_type: str, dtype: torch.dtype) -> Callable[[], float]:
    """A timer of one forward + weight-gradient pass of the probe's convolution in ``dtype``. Run twice
    untimed first: the first convolution backward of a process took 0.8-1.4 s on the CPU, the second up
    to 0.1 s."""
    n, c, h, w = CONV_PROBE_SHAPE
    x = _probe_values((n, c, h, w), device_type, dtype)
    weight = _probe_values((c, c, 3, 3), device_type, dtype).requires_grad_()
    grad_out = _probe_values((n, c, h, w), device_type, dtype)
    conv = torch.nn.functional.conv2d
    return _timer(lambda: torch.autograd.grad(conv(x, weight, padding=1), weight, grad_out), device_type, 2)


def conv_grad_gflops(device_type: str, dtypes: Sequence[torch.dtype], rounds: int = 3) -> list[float]:
    """The best rate of each of ``dtypes``' probe convolution (forward + weight gradient, GFLOP/s) over
    ``rounds`` rounds that run each once, in turn: a neighbour's load slows all alike, not one."""
    passes = [_conv_pass(device_type, d) for d in dtypes]
    times = [[p() for p in passes] for _ in range(rounds)]
    n, c, h, w = CONV_PROBE_SHAPE
    flop = 2 * (2.0 * n * c * h * w * c * 3 * 3)  # forward and weight gradient: a multiply-add per tap each
    return [flop / min(per_round) / 1e9 for per_round in zip(*times, strict=True)]


def _no_sync() -> None:
    pass


_SYNCS: dict[str, Callable[[], None]] = {"cuda": lambda: torch.cuda.synchronize()}


def synchronize(device_type: str) -> None:
    """Wait until ``device_type`` has run every kernel queued so far (a no-op where calls are synchronous,
    as on the CPU): a timer around queued GPU work otherwise measures the queueing only."""
    _SYNCS.get(device_type, _no_sync)()


# --------------------------------------------------------------------------------------------------------
# The hardware line of benchmark tables and `mixprec info`
# --------------------------------------------------------------------------------------------------------


def hardware_line() -> str:
    """One line naming the CPU, the features that decide half speed, threads and torch (+ GPU if any)."""
    caps = torch.cpu.get_capabilities()
    model = str(caps.get("cpu_name") or platform.processor() or platform.machine())
    # +flag present, -flag absent: the absent ones explain a slow half GEMM as much as the present ones
    shown = " ".join(f"{'+' if on else '-'}{name}" for name, on in cpu_flags().items())
    arch = caps.get("architecture", platform.machine())
    line = f"{model} ({arch}; {shown}), {torch.get_num_threads()} threads, torch {torch.__version__}"
    if torch.cuda.is_available():
        line += f", GPU {torch.cuda.get_device_name()}"
    return line


def load_line() -> str:
    """The machine's load before a benchmark starts, and a warning when other work competes with it: a
    neighbour holding a core slows some kernels (torch's multi-threaded ones) far more than others, and
    round-robin timing does not cancel that out (a review saw torch's fused AdamW run 3.4x slower under
    load while a one-pass loop did not)."""
    try:
        one_minute = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on Windows
        return "load: unknown on this platform"
    cpus = os.cpu_count() or 1
    line = f"load average {one_minute:.2f} over {cpus} CPUs"
    if one_minute > 0.5 * cpus:
        line += " -- other work is running: ratios between configurations may be skewed, rerun when idle"
    return line
