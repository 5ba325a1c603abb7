"""Where mixprec's warnings point: the user's line, past every frame of mixprec, torch and contextlib.

A fixed ``stacklevel`` names the user's line from one call path only. The scaler's stuck warning is raised
from ``update()``, which the user calls, or from ``amp.scale_loss``'s exit (through contextlib), and a
region's warning from ``mixprec.autocast(...)`` or from inside a prepared model's forward (through torch's
module call): a fixed level pointed into mixprec's or torch's files on the other path. Python 3.12's
``warnings.warn(skip_file_prefixes=...)`` does this walk; mixprec supports 3.10.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys

import torch

__all__ = ["user_stacklevel"]

# with the separator: torchvision's files start with torch's folder name, a user's mixprec_x/ with ours
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules[__package__]))
# `with scale_loss(...)`: contextlib's __exit__ calls ours; `copy.deepcopy(model)`: copy's functions do
_SKIPPED_FILES = (contextlib.__file__, copy.__file__)


def user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, called from the function that warns, that names the first frame
    outside mixprec, torch and contextlib (the outermost frame if every frame is inside)."""
    frame, level = sys._getframe(1), 1  # 1: the function that calls warnings.warn
    while frame.f_back is not None and _inside(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def _inside(filename: str) -> bool:
    return filename.startswith(_LIBRARY_DIRS) or filename in _SKIPPED_FILES
