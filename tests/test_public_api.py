"""The public API: what __all__ names exists, and every error the package defines is exported from
mixprec.errors."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

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
