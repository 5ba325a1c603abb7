"""The oldest torch mixprec runs on, checked when mixprec is imported (and by the Makefile before it
installs anything: ``python mixprec/torch_floor.py`` exits 0 when the importable torch is recent enough).

2.11 is the oldest release the whole test suite has passed on (torch 2.11, 2.13 and 2.14 were run; 2.6 to
2.10 were tried on 2026-11-26): ``torch.cpu.get_capabilities``, which the hardware detection and the native
loops' cache key read, is new in 2.11; before 2.9 compiled regions also meet Dynamo limits, and 2.4 cannot
import ``mixprec.emulation`` at all. pyproject.toml's ``torch>=`` says the same (a test keeps them equal).
This module imports nothing from mixprec, so that it runs before the rest can be imported.
"""

from __future__ import annotations

import re
import sys

MIN_TORCH: tuple[int, int] = (2, 11)


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version: ``2.13.0+cpu`` -> (2, 13), ``2.11.0a0+git1234`` -> (2, 11)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(found[1]), int(found[2])


def too_old(version: str) -> str | None:
    """Why ``version`` of torch cannot run mixprec, with the fix, or None when it can."""
    if release(version) >= MIN_TORCH:
        return None
    floor = ".".join(map(str, MIN_TORCH))
    return (f"mixprec needs torch >= {floor}; this environment has torch {version}. Upgrade it: "
            f"pip install 'torch>={floor}' (the CPU build: add --index-url "
            "https://download.pytorch.org/whl/cpu), or make the project's environment with `make test`, "
            "which installs one.")


def check(version: str) -> None:
    """Raise ImportError naming the problem and the fix where ``version`` is too old."""
    why = too_old(version)
    if why is not None:
        raise ImportError(why)


if __name__ == "__main__":  # the Makefile: is there a torch, and a recent enough one?
    try:
        import torch
    except ImportError:
        sys.exit(1)
    sys.exit(0 if too_old(torch.__version__) is None else 1)
else:  # imported first by mixprec/__init__.py, before any module an older torch cannot import
    import torch

    check(torch.__version__)
