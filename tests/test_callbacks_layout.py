"""The callbacks package: every name importable from ``mixprec.callbacks`` as before the split, each module
importable on its own, and no import cycle between the learner and its callbacks."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import mixprec

PACKAGE = Path(mixprec.__file__).parent
MODULES = [
    "mixprec.callbacks.core",
    "mixprec.callbacks.fp16",
    "mixprec.callbacks.recorder",
    "mixprec.callbacks.progress",
    "mixprec.callbacks.clip",
    "mixprec.callbacks.schedule",
    "mixprec.callbacks.checkpoint",
    "mixprec.callbacks.accumulation",
    "mixprec.callbacks",
    "mixprec.learner",
]

# Every name tests, examples and the package imported from mixprec.callbacks before it became a package.
NAMES_BEFORE_THE_SPLIT = [
    "EVENTS", "Callback", "CancelStepException", "CancelTrainException", "LossScaling", "MixedPrecision",
    "AutocastMixedPrecision", "Recorder", "EpochResult", "ProgressBar", "OneCycleScheduler", "StepTimer",
    "Checkpoint", "DEFAULT_MAX_SCALE", "DEFAULT_MAX_NOSKIP", "mixprec_callback_for", "model_to_half",
    "model_to_float",
]  # fmt: skip


def _module_path(name: str) -> Path:
    relative = Path(*name.split(".")[1:])
    package = PACKAGE / relative / "__init__.py"
    return package if package.is_file() else PACKAGE / relative.with_suffix(".py")


def _imports(name: str) -> set[str]:
    """The mixprec modules ``name`` imports at module level, ``if TYPE_CHECKING:`` blocks included (a cycle
    there is still a cycle to a reader and a type checker); imports inside functions are deferred on
    purpose."""
    tree = ast.parse(_module_path(name).read_text())
    found: set[str] = set()
    nodes = list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.If):
            nodes.extend(node.body + node.orelse)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mixprec"):
            # `from mixprec import hardware` imports the submodule, not every name of the package's __init__
            submodules = [f"{node.module}.{a.name}" for a in node.names]
            found.update([m for m in submodules if _module_path(m).is_file()] or [node.module])
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("mixprec"))
    return {m for m in found if _module_path(m).is_file()}


def _reaches(start: str, target: str) -> bool:
    seen, todo = set(), list(_imports(start))
    while todo:
        name = todo.pop()
        if name == target:
            return True
        if name not in seen:
            seen.add(name)
            todo.extend(_imports(name))
    return False


@pytest.mark.parametrize("name", MODULES)
def test_no_import_cycle_through_the_learner_or_its_callbacks(name: str) -> None:
    assert not _reaches(name, name), f"{name} imports itself through its imports"
    if name.startswith("mixprec.callbacks"):
        assert not _reaches(name, "mixprec.learner"), f"{name} depends on the learner"


def test_every_module_imports_alone_in_a_fresh_interpreter() -> None:
    # One interpreter (torch imported once), mixprec's modules dropped before each import: each module's
    # import runs as in a fresh interpreter, and an import cycle would fail it.
    script = (
        "import importlib, sys\n"
        f"for name in {MODULES!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'mixprec' or m.startswith('mixprec.')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", NAMES_BEFORE_THE_SPLIT)
def test_old_import_paths_keep_working(name: str) -> None:
    import mixprec.callbacks as callbacks

    assert name in callbacks.__all__ and getattr(callbacks, name) is not None
