"""mixprec.host_memory: after keep_freed_memory, a large freed tensor's memory stays in glibc's heap (reused
by the next step) instead of being unmapped. Read from glibc's own accounting (mallinfo2), in a subprocess
so the test process keeps its allocator as it is."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mixprec.host_memory import keep_freed_memory

_PROBE = """
import ctypes, sys, torch
from mixprec.host_memory import keep_freed_memory

class MallInfo2(ctypes.Structure):  # glibc >= 2.33
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]

try:
    libc = ctypes.CDLL("libc.so.6")
except OSError:
    print("skip: no glibc"); sys.exit()
if not hasattr(libc, "mallinfo2"):
    print("skip: glibc without mallinfo2 (< 2.33)"); sys.exit()
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    done = keep_freed_memory()
    if not done.applied:
        print("skip", done.reason); sys.exit()
x = torch.empty(16 << 20)  # 64 MiB
x.fill_(1.0)
del x
print(libc.mallinfo2().fordblks)  # free bytes glibc holds in its heap
"""


def _free_bytes_held(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    if out.stdout.startswith("skip"):
        pytest.skip(out.stdout.strip())
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc is Linux's")
def test_a_freed_large_tensor_stays_in_the_heap_only_after_keep_freed_memory() -> None:
    assert _free_bytes_held("default") < 16 << 20  # glibc unmapped the 64 MiB block
    assert _free_bytes_held("keep") >= 64 << 20  # kept for the next allocation


@pytest.mark.parametrize("bad", [0, -1, 2**31, 1.5, True])
def test_a_threshold_out_of_range_is_refused_with_the_fix(bad: object) -> None:
    with pytest.raises(ValueError, match="mmap_threshold must be an int"):
        keep_freed_memory(bad)  # type: ignore[arg-type]
