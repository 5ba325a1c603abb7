"""Shared test fixtures."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import unittest
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch import nn

from mixprec import amp, half_saving_gemms, hardware
from mixprec import policy as P

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(autouse=True, scope="session")  # session: module-scoped fixtures train models too
def reference_arithmetic() -> Iterator[None]:
    """The arithmetic the suite was written for (fp16 GEMMs emulated, bf16 native), on any CPU: left to
    mixprec.hardware, it would depend on the machine (AVX2-only CPUs emulate bf16 too). A GPU's is left
    to detection, so the CUDA tests run the arithmetic a user's GPU gets (native on sm_80 and later). Tests
    of the choice itself (test_hardware, test_emulation) set or clear the variable."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(hardware.ENV_VAR, "cpu:fp16=emulated,cpu:bf16=native")
        yield


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """Global register_*_function registrations are process-wide: start and end each test without any."""
    P.clear_registrations()
    yield
    P.clear_registrations()


def load_torch_autocast_lists() -> types.ModuleType:
    """torch's own autocast op lists (shipped with torch), without torch's test-suite dependencies."""
    path = Path(torch.testing.__file__).parent / "_internal" / "autocast_test_lists.py"
    if not path.exists():
        pytest.skip("this torch build does not ship autocast_test_lists.py")
    stub = types.ModuleType("torch.testing._internal.common_utils")
    stub.TEST_WITH_ROCM = False  # type: ignore[attr-defined]
    stub.TestCase = unittest.TestCase  # type: ignore[attr-defined]
    saved = sys.modules.get(stub.__name__)
    sys.modules[stub.__name__] = stub
    try:
        spec = importlib.util.spec_from_file_location("_torch_autocast_lists", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del sys.modules[stub.__name__]
        else:
            sys.modules[stub.__name__] = saved
    return module


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models: one thread is as fast, and immune to OpenMP spin-waits when other processes share the
    two cores (measured: two threads on a loaded machine made such steps ~100x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def half_saving_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Emulated GEMMs save half activations however small (tests count their bytes on tiny models, where
    mixprec.half_saving_gemms.FEW_ACTIVATIONS sends them down the generic path)."""
    monkeypatch.setattr(half_saving_gemms, "FEW_ACTIVATIONS", 0)


@pytest.fixture
def fresh_dynamo(one_thread: None) -> Iterator[None]:
    """Compiled tests: no graph or recompile count carried over from another test, one thread (tiny)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def fresh_amp_state() -> Iterator[None]:
    """initialize() keeps process-wide state (as apex did): leave none behind."""
    yield
    amp.reset()


def example(name: str) -> types.ModuleType:
    """Import examples/<name>.py as a module (examples/ is a folder of scripts, not a package)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


LiveBytes = Callable[[nn.Module, torch.optim.Optimizer], int]


@pytest.fixture
def live_bytes() -> LiveBytes:
    """Bytes of the distinct storages behind a model's parameters and gradients and a MasterWeights
    optimizer's masters, master gradients and state: what O2 training holds outside activations."""

    def count(model: nn.Module, opt: torch.optim.Optimizer) -> int:
        masters = list(opt.master_params())  # type: ignore[attr-defined]
        tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
        tensors += [*masters, *(m.grad for m in masters if m.grad is not None)]
        tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

    return count


@pytest.fixture
def arithmetic(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Force an arithmetic for both half dtypes (``MIXPREC_HALF_ARITHMETIC``), whatever this CPU would
    choose; undone after the test."""

    def force(value: str) -> None:
        monkeypatch.setenv(hardware.ENV_VAR, value)

    return force


@pytest.fixture
def exact_sqrt(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's Tensor.sqrt correctly rounded for fp32 (sqrt in fp64, rounded once: exact for fp32), as the
    native split step's sqrtf is; torch's CPU sqrt (MKL) is one ulp off in ~0.6% of elements. The reference
    of tests/test_split_adam*.py: torch's own Adam, made to round its sqrt once."""
    sqrt = torch.Tensor.sqrt

    def rounded_once(self: torch.Tensor) -> torch.Tensor:
        return sqrt(self.double()).float() if self.dtype is torch.float32 else sqrt(self)

    monkeypatch.setattr(torch.Tensor, "sqrt", rounded_once)
