"""mixprec's native CPU loops: C compiled once per machine and called through ctypes.

Three loops live here, each in its own C file, linked into one library:

- ``split_adam.c``: the one-pass Adam/AdamW step over split masters (:mod:`mixprec.split_adam`);
- ``non_finite.c``: a read-only inf/NaN check of fp16/bf16/fp32 gradients (:mod:`mixprec.non_finite`),
  the scaler's check where the loss scale is exactly 1 (bf16's static scale), ~3x faster than torch's
  fused check-and-unscale on half gradients on the CPU;
- ``unscale_copy.c``: half gradients copied into fp32 master gradients, unscaled and checked in the same
  pass (:mod:`mixprec.unscale_copy`), O2's unscale.

They include no torch header, so the library builds in well under a second (a torch C++ extension: ~20 s).
It is compiled with ``$CC`` (else ``cc``, ``gcc``, ``clang``; torch.compile needs one too) into
``$MIXPREC_CACHE_DIR`` (default ``$XDG_CACHE_HOME/mixprec`` or ``~/.cache/mixprec``). On Linux it links the
OpenMP runtime torch has loaded (whatever its wheel named it), so the loops run on torch's threads rather
than a second pool; a compiler without OpenMP builds them single-threaded (``mixprec info`` says so).
Without a compiler, each caller keeps its torch path (:func:`library_error` says why).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["cpu_scalar", "library", "library_error", "library_threads", "dense", "pointers", "readable",
           "sizes"]

# The loops, one concept per file, linked into one library (one build, one cache entry per machine).
SOURCES = tuple(Path(__file__).with_name(name) for name in ("split_adam.c", "non_finite.c", "unscale_copy.c"))
# -ffp-contract=off: the compiler may add no fused multiply-add the source does not write (torch's roundings
# are matched one by one); -fno-math-errno lets sqrtf vectorise (it sets no errno; IEEE results unchanged).
# -march=native (in _variants): the library is built on, and cached for, the machine that runs it.
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC"]

# "lib": the loaded library, "threads": which threads it runs on (words); or "error": why there is none
_LIBRARY: dict[str, Any] = {}


def _cache_dir() -> Path:
    root = os.environ.get("MIXPREC_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mixprec"


def _compiler() -> list[str] | None:
    """The compiler command: $CC as the shell would split it ("ccache gcc"), else the first one found."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return [found] if found else None


def _torch_openmp() -> str | None:
    """The OpenMP runtime torch has loaded (Linux: its libgomp, whatever its wheel renamed it to: in
    torch/lib or torch.libs), so that the loop links that one and shares torch's threads instead of
    starting a second pool; None where there is none to find (other libraries' runtimes do not count:
    scikit-learn loads its own)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    home = Path(torch.__file__).resolve().parent
    homes = (home / "lib", home.with_name("torch.libs"))
    paths = {line.split()[-1] for line in maps.splitlines() if "/libgomp" in line}
    torchs = sorted(p for p in paths if Path(p).resolve().parent in homes)
    return torchs[0] if len(torchs) == 1 else None


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(command, capture_output=True, text=True)
    except OSError as e:
        raise OSError(f"the C compiler {shlex.join(command[:1])!r} cannot be run ({e.strerror}): set $CC to "
                      "one that can") from None


@dataclass(frozen=True)
class _Variant:
    """One way to build the loop, tried in order until the compiler accepts one."""

    name: str  # the cached file's suffix
    threads: str  # which threads it runs on, in words (mixprec info)
    compile: tuple[str, ...]  # flags besides FLAGS
    link: tuple[str, ...]


def _variants(openmp: str | None) -> list[_Variant]:
    """Best first: OpenMP (linked against torch's runtime, or the compiler's own where torch's is not
    found) with -march=native; OpenMP without it (a compiler that does not take -march=native, e.g. on
    POWER); one thread with it (Apple's clang has no OpenMP); one thread without it."""
    linked = (openmp, f"-Wl,-rpath,{Path(openmp).parent}") if openmp else ("-fopenmp",)
    threads = "torch's OpenMP threads" if openmp else "the compiler's OpenMP threads"
    serial = "one thread: the C compiler has no OpenMP"
    return [_Variant("omp", threads, ("-fopenmp", "-march=native"), linked),
            _Variant("omp-portable", threads + ", without -march=native", ("-fopenmp",), linked),
            _Variant("serial", serial, ("-march=native",), ()),
            _Variant("portable", serial + " nor -march=native", (), ())]


def _build(compiler: list[str]) -> tuple[Path, str]:
    """Compile SOURCES into one library in the cache, once per sources, compiler (and its version), flags,
    OpenMP runtime and CPU; return its path and which threads it runs on.

    A variant the compiler refused leaves a ``.failed`` marker, so later processes use the next one without
    asking again; a lesser variant is used only while every better one has such a marker. A compile killed
    by a signal (out of memory, ^C) marks nothing and builds nothing: the next process tries again, rather
    than a one-off failure leaving a slower loop cached for good. (Delete the cache to retry a refusal.)"""
    version = _run([*compiler, "--version"]).stdout.splitlines()[:1]
    openmp = _torch_openmp()
    cpu = sorted(k for k, v in torch.cpu.get_capabilities().items() if v is True)
    variants = _variants(openmp)
    recipe = ([s.read_bytes() for s in SOURCES], compiler, version, FLAGS, variants, cpu, platform.machine())
    key = hashlib.sha256(repr(recipe).encode()).hexdigest()[:16]
    cache = _cache_dir()

    def path(v: _Variant, suffix: str) -> Path:
        return cache / f"native-{key}-{v.name}{suffix}"

    for i, v in enumerate(variants):
        if path(v, ".so").exists() and all(path(w, ".failed").exists() for w in variants[:i]):
            return path(v, ".so"), v.threads
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryDirectory(dir=cache).cleanup()
    except OSError as e:
        raise OSError(f"the build cache {cache} is not writable ({e.strerror}): set MIXPREC_CACHE_DIR to a "
                      "writable directory") from None
    error = "(no output)"
    for v in variants:
        if path(v, ".failed").exists():
            error = path(v, ".failed").read_text().strip() or error
            continue
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            objs, out = [Path(tmp) / f"{s.stem}.o" for s in SOURCES], Path(tmp) / path(v, ".so").name
            for source, obj in zip(SOURCES, objs, strict=True):
                run = _run([*compiler, *FLAGS, *v.compile, "-c", str(source), "-o", str(obj)])
                if run.returncode != 0:
                    break
            if run.returncode == 0:
                run = _run([*compiler, "-shared", *map(str, objs), *v.link, "-o", str(out), "-lm"])
            if run.returncode == 0:
                os.replace(out, path(v, ".so"))  # atomic; a concurrent build of this key writes the same
                return path(v, ".so"), v.threads
            if run.returncode < 0:
                raise OSError(f"{shlex.join(compiler)} was stopped by signal {-run.returncode} while "
                              f"building {_names()}; the next process builds it again")
            error = (run.stderr.strip().splitlines() or [error])[-1]
            path(v, ".failed").write_text(error + "\n")
    raise OSError(f"{shlex.join(compiler)} could not build {_names()}: {error}; set $CC to another one "
                  f"(and clear {cache})")


def _names() -> str:
    return " and ".join(s.name for s in SOURCES)


# Each exported function: (return type, argument types), as the C files declare them.
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    # split_adam_step(n_tensors, 8 pointer tables, inv_scale, n_threads)
    "split_adam_step": (None, [ctypes.c_int64] + [ctypes.c_void_p] * 8 + [ctypes.c_float, ctypes.c_int32]),
    # half_/float_non_finite(n_tensors, data table, numel table, exponent mask, n_threads, &inv_scale)
    # -> 0, 1, or -1 (not a scale of 1): one signature for both widths
    **dict.fromkeys(("half_non_finite", "float_non_finite"), (ctypes.c_int32, [
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p])),
    # bf16_/fp16_unscale_copy(n_tensors, source table, destination table, numel table, n_threads,
    # &inv_scale) -> bit 0: inf/NaN found; bit 1: the inverse scale was exactly 1
    **dict.fromkeys(("bf16_unscale_copy", "fp16_unscale_copy"), (ctypes.c_int32, [
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p])),
}


def library() -> Any | None:
    """The loaded library (built on first use), or None where it cannot be built (:func:`library_error`)."""
    if not _LIBRARY:
        compiler = _compiler()
        try:
            if compiler is None:
                raise OSError("no C compiler found (set $CC, or install gcc or clang)")
            path, threads = _build(compiler)
            lib = ctypes.CDLL(str(path))
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, restype
            _LIBRARY.update(lib=lib, threads=threads)
        except OSError as e:
            _LIBRARY["error"] = str(e)
    return _LIBRARY.get("lib")


def library_error() -> str | None:
    """Why the native loops cannot be built on this machine, or None when they can."""
    library()
    return _LIBRARY.get("error")


def library_threads() -> str:
    """Which threads the built loops run on, in words (torch's OpenMP threads where it could link them)."""
    library()
    return _LIBRARY.get("threads", "none: not built")


def readable(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a loop may read (or write) ``t`` as ``t.numel()`` elements of ``dtype`` from its data pointer:
    a plain tensor (not a DTensor's or another subclass's wrapper), on the CPU, of that dtype, dense."""
    return type(t) is torch.Tensor and t.is_cpu and t.dtype is dtype and dense(t)


# dtype of a one-element CPU tensor -> the C type cpu_scalar reads it as
_C_SCALARS: dict[torch.dtype, type[ctypes.c_float] | type[ctypes.c_int32] | type[ctypes.c_int64]] = {
    torch.float32: ctypes.c_float, torch.int32: ctypes.c_int32, torch.int64: ctypes.c_int64,
}


def cpu_scalar(t: torch.Tensor) -> float | int:
    """The value of a one-element CPU tensor (fp32, int32 or int64), read from its memory in place: no torch
    call, so nothing a sync watch counts (CPU tensors have no queue to wait for; ``.item()`` would be a
    dispatcher call and, on a GPU, a sync)."""
    return _C_SCALARS[t.dtype].from_address(t.data_ptr()).value


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory without gaps or overlaps, in some order of dimensions
    (contiguous, channels_last, a transposed contiguous tensor, ...): what a loop over ``t.numel()``
    elements from ``t.data_ptr()`` may read. torch's own test (its TensorImpl keeps the answer), asked
    only of a tensor that is not contiguous: through the dispatcher it costs ~1 us a tensor, the contiguity
    flag ~0.1 (every gradient is read each step)."""
    return t.is_contiguous() or bool(torch.ops.aten.is_non_overlapping_and_dense(t))


def pointers(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """A loop's table of data pointers (the caller keeps ``tensors`` alive while the loop runs)."""
    return np.fromiter((t.data_ptr() for t in tensors), dtype=np.uint64, count=len(tensors))


def sizes(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """A loop's table of element counts, beside :func:`pointers`."""
    return np.fromiter((t.numel() for t in tensors), dtype=np.int64, count=len(tensors))
