"""Run PyTorch's own GradScaler tests against ``mixprec.scaler.GradScaler``.

mixprec's ``GradScaler`` claims to be a drop-in for ``torch.amp.GradScaler``. The strongest check of that
claim is torch's own test suite: this tool points the device-generic grad-scaling tests of PyTorch's
``test/test_torch.py`` (class ``TestTorchDeviceType``: ``test_grad_scaling_*``, ``test_pickle_gradscaler``,
``test_grad_scaler_*``, ``test_grad_scale_will_not_overflow``, ``test_params_invalidated_*``) at our class
and prints how many pass.

Getting the tests (PyTorch's code is not part of this repository, keep it outside):
    * a PyTorch source checkout matching the installed torch: ``git clone --branch v2.13.0 --depth 1
      https://github.com/pytorch/pytorch`` and pass ``pytorch/test/test_torch.py``; or
    * a file holding only those test methods (cut from ``test_torch.py``, with its imports and the
      ``instantiate_device_type_tests(TestTorchDeviceType, globals())`` line), or a folder of such files.
    The helpers the tests use (``_create_scaling_case``, ``optim_db``, ...) come from the installed
    ``torch.testing._internal``. Its ``common_utils`` imports ``expecttest``, which is not a dependency of
    mixprec; when it is missing this tool registers a stand-in (these tests never use expect-files).

Usage:
    .venv/bin/python tools/run_torch_scaler_tests.py PATH                # ours, cpu (+ cuda if present)
    .venv/bin/python tools/run_torch_scaler_tests.py PATH --control      # torch's own class, same tests
    .venv/bin/python tools/run_torch_scaler_tests.py PATH -k pickle -- --tb=long   # extra pytest args

What gets replaced: ``torch.GradScaler``, ``torch.amp.GradScaler`` and ``torch.amp.grad_scaler.GradScaler``
become ``mixprec.scaler.GradScaler`` itself; the deprecated ``torch.cpu.amp.GradScaler`` and
``torch.cuda.amp.GradScaler`` become thin subclasses that bind the device (and, like torch's, warn that they
are deprecated). Before any test runs, and again before each one, the tool checks that every replaced name
is ours, and it counts the scaler instances each test creates, so a test that never touched the class under
test is reported as such rather than counted as evidence. Exit status: 0 when every selected test passed.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
import types
import unittest
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from mixprec.scaler import GradScaler

# Why this -k: the brief's "grad_scaling or gradscaler" misses four upstream tests of the scaler itself
# (test_grad_scale_will_not_overflow, test_grad_scaler_pass_itself, test_grad_scaler_deprecated_warning,
# test_params_invalidated_*); "grad_scal" catches the first three, "params_invalidated" the last.
DEFAULT_SELECTION = "grad_scal or gradscaler or params_invalidated"

# Where torch exposes the class: (module, attribute, device bound by a legacy constructor or None).
PATCH_SITES: tuple[tuple[str, str, str | None], ...] = (
    ("torch", "GradScaler", None),
    ("torch.amp", "GradScaler", None),
    ("torch.amp.grad_scaler", "GradScaler", None),
    ("torch.cpu.amp", "GradScaler", "cpu"),
    ("torch.cpu.amp.grad_scaler", "GradScaler", "cpu"),
    ("torch.cuda.amp", "GradScaler", "cuda"),
    ("torch.cuda.amp.grad_scaler", "GradScaler", "cuda"),
)


def _legacy_message(device: str) -> str:
    return (
        f"`torch.{device}.amp.GradScaler(args...)` is deprecated. "
        f"Please use `torch.amp.GradScaler('{device}', args...)` instead."
    )


def _legacy_scaler(device: str) -> type[GradScaler]:
    """A stand-in for ``torch.<device>.amp.GradScaler``: the device is fixed, the rest is mixprec's."""

    class LegacyGradScaler(GradScaler):
        def __init__(
            self,
            init_scale: float = 2.0**16,
            growth_factor: float = 2.0,
            backoff_factor: float = 0.5,
            growth_interval: int = 2000,
            enabled: bool = True,
        ) -> None:
            warnings.warn(_legacy_message(device), FutureWarning, stacklevel=2)
            super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)

    LegacyGradScaler.__name__ = LegacyGradScaler.__qualname__ = f"_Legacy{device.capitalize()}GradScaler"
    return LegacyGradScaler


_LegacyCpuGradScaler = _legacy_scaler("cpu")
_LegacyCudaGradScaler = _legacy_scaler("cuda")


LEGACY_CLASSES: dict[str, type[GradScaler]] = {"cpu": _LegacyCpuGradScaler, "cuda": _LegacyCudaGradScaler}


def _replacement(device: str | None) -> type:
    return GradScaler if device is None else LEGACY_CLASSES[device]


# ---------------------------------------------------------------------------------------------- patching
@dataclass
class Patcher:
    """Swaps torch's GradScaler names for ours, and counts instances of the class under test."""

    control: bool
    saved: list[tuple[types.ModuleType, str, Any]] = field(default_factory=list)
    created: int = 0
    counted: type | None = None

    @property
    def target(self) -> type:
        return torch.amp.grad_scaler.GradScaler if self.control else GradScaler

    def apply(self) -> None:
        target = self.target  # read before patching: in control mode it is torch's class
        if not self.control:
            for module_name, attr, device in PATCH_SITES:
                module = importlib.import_module(module_name)
                self.saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, _replacement(device))
        self._count_instances(target)

    def _count_instances(self, cls: type) -> None:
        # Counting in __new__ sees every construction and every unpickling, without touching __init__.
        def counting_new(klass: type, *args: Any, **kwargs: Any) -> Any:
            self.created += 1
            return object.__new__(klass)

        cls.__new__ = staticmethod(counting_new)  # type: ignore[method-assign,assignment]
        self.counted = cls

    def restore(self) -> None:
        for module, attr, original in reversed(self.saved):
            setattr(module, attr, original)
        self.saved.clear()
        if self.counted is not None:
            del self.counted.__new__
            self.counted = None

    def check(self) -> list[str]:
        """The names that do not resolve to the class under test (empty when all is well)."""
        if self.control:
            return [] if torch.GradScaler is self.target else ["torch.GradScaler"]
        wrong = []
        for module_name, attr, device in PATCH_SITES:
            if getattr(importlib.import_module(module_name), attr) is not _replacement(device):
                wrong.append(f"{module_name}.{attr}")
        return wrong


def _smoke_check(patcher: Patcher) -> None:
    """Constructing through each public name must give an instance of the class under test."""
    made = [torch.GradScaler("cpu"), torch.amp.GradScaler("cpu")]
    if not patcher.control:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            made.append(torch.cpu.amp.GradScaler())
    bad = [type(s).__qualname__ for s in made if not isinstance(s, patcher.target)]
    if bad or patcher.check():
        raise SystemExit(f"patching failed: made {bad}, unpatched names {patcher.check()}")
    patcher.created = 0  # count only what the tests make


# ---------------------------------------------------------------------------------------------- pytest plugin
@dataclass
class Outcome:
    nodeid: str
    outcome: str  # passed, failed, error, skipped, xfailed, xpassed
    instances: int
    message: str = ""


class ScalerPlugin:
    """Patches at configure time, re-checks before every test, and records each test's outcome."""

    def __init__(self, patcher: Patcher) -> None:
        self.patcher = patcher
        self.outcomes: dict[str, Outcome] = {}
        self._before = 0

    def pytest_configure(self, config: pytest.Config) -> None:
        self.patcher.apply()
        _smoke_check(self.patcher)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.patcher.restore()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        wrong = self.patcher.check()
        if wrong:
            raise RuntimeError(f"{wrong} no longer resolve to the class under test")
        self._before = self.patcher.created
        return (yield)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        outcome = _classify(report)
        if outcome is None:
            return
        instances = self.patcher.created - self._before if report.when == "call" else 0
        message = _first_line(report) if report.failed else ""
        if report.skipped and isinstance(report.longrepr, tuple):
            message = str(report.longrepr[2])
        previous = self.outcomes.get(report.nodeid)
        if previous is None or previous.outcome == "passed":
            self.outcomes[report.nodeid] = Outcome(report.nodeid, outcome, instances, message)


def _first_line(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = str(getattr(crash, "message", report.longrepr)).strip()
    return text.splitlines()[0] if text else ""


def _classify(report: pytest.TestReport) -> str | None:
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if xfail:
            return "xfailed" if report.skipped else "xpassed"
        return report.outcome
    if report.failed:
        return "error"
    if report.skipped:
        return "skipped"
    return None


# ---------------------------------------------------------------------------------------------- running
def _install_expecttest_stand_in() -> None:
    try:
        import expecttest  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("expecttest")
        stand_in.TestCase = unittest.TestCase  # type: ignore[attr-defined]
        stand_in.ACCEPT = False  # type: ignore[attr-defined]
        sys.modules["expecttest"] = stand_in


def _devices(requested: str | None) -> str:
    if requested:
        return requested
    return "cpu,cuda" if torch.cuda.is_available() else "cpu"


def _pytest_args(args: argparse.Namespace) -> list[str]:
    path = Path(args.path).resolve()
    root = path if path.is_dir() else path.parent
    return [
        str(path),
        "-k",
        args.k,
        "-q",
        "--tb=short",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(root),
        "-c",
        os.devnull,  # no ini file: mixprec's pytest settings must not apply to torch's tests
        *args.pytest_args,
    ]


def _report(plugin: ScalerPlugin, label: str, devices: str) -> dict[str, int]:
    counts = Counter(o.outcome for o in plugin.outcomes.values())
    print(f"\n=== {label}: GradScaler tests from {devices} ===")
    for o in sorted(plugin.outcomes.values(), key=lambda o: o.nodeid):
        note = f"  [{o.message}]" if o.message else ""
        idle = "  (created no scaler)" if o.outcome == "passed" and o.instances == 0 else ""
        print(f"{o.outcome:8} {o.nodeid.split('::')[-1]}{idle}{note}")
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    print(f"--- {label}: {summary or 'no tests selected'}; {plugin.patcher.created} scaler instances made")
    return dict(counts)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("path", help="PyTorch's test/test_torch.py, an extract of it, or a folder of them")
    parser.add_argument("--control", action="store_true", help="run against torch's own GradScaler")
    parser.add_argument("--devices", help="comma-separated device types (default: cpu, plus cuda if present)")
    parser.add_argument("-k", default=DEFAULT_SELECTION, help=f"pytest -k expression ({DEFAULT_SELECTION!r})")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest as they are")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, run: Callable[..., Any] = pytest.main) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    devices = _devices(args.devices)
    # Read by torch's instantiate_device_type_tests when the test module is imported.
    os.environ["PYTORCH_TESTING_DEVICE_ONLY_FOR"] = devices
    os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")  # its hint names a file we do not ship
    _install_expecttest_stand_in()
    patcher = Patcher(control=args.control)
    label = "torch.amp.GradScaler (control)" if args.control else "mixprec.scaler.GradScaler"
    target = patcher.target
    where = inspect.getfile(target)
    print(f"class under test: {label}: {target.__module__}.{target.__qualname__} from {where}")
    plugin = ScalerPlugin(patcher)
    code = run(_pytest_args(args), plugins=[plugin])
    counts = _report(plugin, label, devices)
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("xpassed", 0)
    return 0 if code == 0 and failed == 0 and plugin.outcomes else 1


if __name__ == "__main__":
    sys.exit(main())
