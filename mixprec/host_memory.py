"""Keep freed host memory in the process, so a CPU training step does not page-fault its tensors in again.

Why: torch's CPU allocator takes every tensor from ``malloc`` and gives it back with ``free``. glibc serves a
block above its mmap threshold (128 KiB at start, adapting up to 32 MiB) with a fresh ``mmap`` and unmaps it
on ``free``, so every large activation, gradient or upcast of a step arrives as new zeroed pages: the kernel
faults them in one 4 KiB page at a time. Measured on a 2-core AVX2 EPYC, one 2048x8192 tensor
(64 MiB fp32):

=====================  ======================  ==========================
operation              default glibc malloc    after :func:`keep_freed_memory`
=====================  ======================  ==========================
bf16 -> fp32 upcast    29.7 ms                 5.5 ms
fp32 clone             32.3 ms                 6.1 ms
=====================  ======================  ==========================

Mixed precision makes more such tensors than fp32 (the half copy and the fp32 upcast of each activation), so
it pays this toll more often. :func:`keep_freed_memory` raises glibc's mmap and trim thresholds with
``mallopt``: large blocks then come from the main heap and stay there after ``free``, and the next step
reuses them. (Threads other than the main one allocate from glibc's per-thread heaps, capped at 64 MiB:
their larger tensors are still mapped afresh. torch's intra-op threads compute; the tensors of a training
step are allocated by the thread that runs it.) This is what a caching allocator does on CUDA, and what
PyTorch's CPU tuning guide gets by preloading jemalloc or tcmalloc; ``mallopt`` needs no extra library.
The price: the process keeps its peak host memory (its RSS no longer shrinks after a large step).

Process-wide and opt-in: mixprec never calls it on import. ``benchmarks/train_step.py`` calls it for every
configuration alike (``--default-malloc`` times without it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from dataclasses import dataclass

__all__ = ["MallocTuning", "keep_freed_memory"]

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# 1 GiB: above any single activation of the models mixprec's benchmarks and demo train. Recent glibc accepts
# it (2.36 here); mallopt(3) documents 32 MiB as the 64-bit maximum and older glibc refuses more, so a
# refusal falls back to that. The trim threshold at the largest int keeps freed heap memory for good.
DEFAULT_MMAP_THRESHOLD = 1 << 30
_DOCUMENTED_MAX = 32 << 20
_KEEP_ALL = 2**31 - 1


@dataclass(frozen=True)
class MallocTuning:
    """What :func:`keep_freed_memory` did: ``applied`` and, either way, why (printed by the benchmarks)."""

    applied: bool
    reason: str


def keep_freed_memory(mmap_threshold: int = DEFAULT_MMAP_THRESHOLD) -> MallocTuning:
    """Make glibc malloc serve blocks up to ``mmap_threshold`` bytes from its heap and keep freed memory (see
    the module docstring). Returns what was done; on a C library other than glibc (macOS, musl) nothing is
    changed and the reason says so."""
    valid = isinstance(mmap_threshold, int) and not isinstance(mmap_threshold, bool)
    if not (valid and 0 < mmap_threshold <= _KEEP_ALL):
        raise ValueError(f"mmap_threshold must be an int in (0, 2**31 - 1] bytes, got {mmap_threshold!r}; "
                         "e.g. 1 << 30.")
    libc = _glibc()
    if libc is None:
        return MallocTuning(False, f"not glibc ({sys.platform}): host allocator left as it is")
    accepted = next((t for t in (mmap_threshold, min(mmap_threshold, _DOCUMENTED_MAX))
                     if libc.mallopt(_M_MMAP_THRESHOLD, t) == 1), None)
    if accepted is None:
        return MallocTuning(False, "glibc refused mallopt(M_MMAP_THRESHOLD): host allocator left as it is")
    threshold = f"mmap threshold {accepted / 2**20:g} MiB"
    if libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_ALL) != 1:
        return MallocTuning(False, f"glibc took the {threshold} but refused M_TRIM_THRESHOLD: freed memory "
                            "at the heap's top is still returned")
    return MallocTuning(True, f"glibc malloc keeps freed memory ({threshold})")


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 -- present in glibc only: tells it from musl
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc
