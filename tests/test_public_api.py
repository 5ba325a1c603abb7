"""The public API: what __all__ names exists, and every error the package defines is exported from
mixprec.errors."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys

import pytest

import mixprec
from mixprec import errors


def test_every_public_name_exists() -> None:
    missing = [name for name in mixprec.__all__ if not hasattr(mixprec, name)]
    assert not missing
    assert len(set(mixprec.__all__)) == len(mixprec.__all__)


def test_apex_global_state_lives_under_amp() -> None:
    for name in ("state_dict", "load_state_dict", "loss_scaler"):
        assert name not in mixprec.__all__ and callable(getattr(mixprec.amp, name))


def test_every_mixprec_error_in_the_package_is_exported_from_errors() -> None:
    defined = set()
    for module_info in pkgutil.walk_packages(mixprec.__path__, "mixprec."):
        if module_info.name.endswith("__main__") or module_info.name.startswith("mixprec.commands"):
            continue  # the command line: running __main__ would run it; its errors become messages
        module = importlib.import_module(module_info.name)
        defined |= {obj for obj in vars(module).values()
                    if inspect.isclass(obj) and issubclass(obj, errors.MixprecError)}  # fmt: skip
    exported = {getattr(errors, name) for name in errors.__all__}
    assert defined - exported == set(), sorted(c.__qualname__ for c in defined - exported)


def test_a_submodule_loads_on_first_use_after_a_plain_import() -> None:
    """The README writes ``mixprec.diagnostics.memory_breakdown`` and ``mixprec.host_memory.
    keep_freed_memory()`` after ``import mixprec``: they raised AttributeError. A fresh interpreter, since
    this one has imported every submodule already."""
    code = (
        "import sys, mixprec\n"
        "assert 'mixprec.host_memory' not in sys.modules\n"  # not imported with the package
        "print(mixprec.diagnostics.memory_breakdown.__name__, mixprec.host_memory.keep_freed_memory.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["memory_breakdown", "keep_freed_memory"]


def test_an_unknown_attribute_still_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'mixprec' has no attribute 'no_such_thing'"):
        mixprec.no_such_thing  # noqa: B018
    assert not hasattr(mixprec, "_private")
    assert not hasattr(mixprec, "scaler.x") and not hasattr(mixprec, "nope.x")  # dotted: no import tried
