"""A user's own model on the command line: ``--model package.module:function`` or ``file.py:function``.

The function takes no arguments and returns the model, or ``(model, batch)`` with an example batch ``x``
or ``(x, y)`` (a language model's token ids, a detector's targets: what the reference models' random images
cannot stand in for; ``x`` may be a tuple of a model's several inputs, ``((x, mask), y)``), or ``(model,
batch, loss_fn)`` with ``loss_fn(output, y)`` (default: cross-entropy, or ``output.sum()`` without ``y``).
Without a batch, one is made from ``--input`` and ``--batch-size``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixprec.commands.train import UsageError

FORMS = "the model, (model, batch) or (model, batch, loss_fn)"


@dataclass(frozen=True)
class UserModel:
    model: Any
    batch: Any = None  # None: the command makes one from --input and --batch-size
    loss_fn: Any = None


def is_spec(text: str) -> bool:
    """Whether ``--model`` names a user's function rather than a reference model."""
    return ":" in text


def _module(where: str) -> Any:
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise UsageError(f"--model {where}: no such file.", "give the path of a .py file, e.g. "
                             "--model my_models.py:make_model")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None  # a .py file always has both
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.parent.resolve()))  # its own imports of neighbouring files work
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.pop(0)
        return module
    try:
        return importlib.import_module(where)
    except ImportError as err:
        raise UsageError(f"--model {where}: cannot import it ({err}).",
                         "name an importable module (run from its folder, or set PYTHONPATH), or a .py file: "
                         "--model path/to/file.py:make_model") from None


def load(spec: str) -> UserModel:
    """Import ``spec`` (``module:function``), call the function and check what it returned."""
    import torch

    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise UsageError(f"--model {spec!r} is not module:function.",
                         "e.g. --model my_models:make_model or --model path/to/file.py:make_model")
    factory = getattr(_module(where), name, None)
    if not callable(factory):
        raise UsageError(f"--model {spec}: {where} has no function {name!r}.",
                         f"define {name}() returning {FORMS}.")
    made = factory()
    parts = made if isinstance(made, tuple) else (made,)
    if not 1 <= len(parts) <= 3 or not isinstance(parts[0], torch.nn.Module):
        raise UsageError(f"--model {spec}: {name}() returned {type(made).__name__}.",
                         f"return {FORMS}, the model an nn.Module.")
    return UserModel(*parts)
