"""benchmarks/train_step.py on a tiny workload: every row it reports is measured from a real run (a
configuration that cannot run fast here is skipped, not failed), and its counts agree with the tensors."""

from __future__ import annotations

import importlib.util
import mmap
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from rich.console import Console
from torch import nn

from mixprec import hardware

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "train_step.py"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_step_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _tiny(bench: ModuleType) -> object:
    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    return bench.Workload("tiny MLP", make, batch, 8, 1, bench.mlp_flops_per_sample(16, 32, 4), 8)


def test_a_run_reports_measured_rows_and_skips_what_has_no_fast_kernels(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(hardware.ENV_VAR, "fp16=emulated,bf16=emulated")  # torch.autocast bf16 is "slow"
    names = ("fp32", "torch.autocast bf16", "mixprec O2 bf16")
    configs = [c for c in bench.CONFIGS if c.name in names]
    rates: dict[torch.dtype, list[float]] = {}
    results = bench.time_workload(_tiny(bench), configs, (False, True), 1, 1, Console(quiet=True), rates)
    # emulated bf16 computes with fp32 kernels: fp32's rate is the only reference, timed every round
    assert list(rates) == [torch.float32] and len(rates[torch.float32]) == 3
    assert all(r > 0 for r in rates[torch.float32])
    for name in ("fp32", "mixprec O2 bf16"):  # compiled rows run too
        assert results[(name, True)].ms is not None, results[(name, True)].error
    skipped = results[("torch.autocast bf16", True)]
    assert skipped.ms is None and skipped.error.startswith("skipped")
    for name in names:
        eager = results[(name, False)]
        assert eager.ms is not None and eager.ms > 0, eager.error
        assert eager.saved_mib is not None and eager.saved_mib > 0
        assert eager.faults is not None and eager.faults >= 0  # counted per timed step (Linux CI)
    assert results[("fp32", False)].bytes_per_param == pytest.approx(16, abs=0.1)
    assert results[("mixprec O2 bf16", False)].bytes_per_param == pytest.approx(20, abs=0.1)
    # Half activations take half the bytes of fp32's (here: the input and the ReLU output are saved)
    assert results[("mixprec O2 bf16", False)].saved_mib < results[("fp32", False)].saved_mib
    table = bench.report(_tiny(bench), results, {torch.float32: max(rates[torch.float32])})
    console = Console(width=250, record=True)
    console.print(table)
    text = console.export_text()
    assert "skipped" in text and "failed" not in text


def test_the_learner_runs_one_batch_at_a_time_and_counts_its_gradients(bench: ModuleType) -> None:
    configs = [c for c in bench.CONFIGS if c.name in ("fp32", "mixprec Learner.to_bf16()")]
    results = bench.time_workload(_tiny(bench), configs, (False,), 2, 1, Console(quiet=True), {})
    learner = results[("mixprec Learner.to_bf16()", False)]
    assert learner.ms is not None and learner.steps == 2, learner.error
    # bf16 weights 2 + bf16 grads 2 + fp32 masters 4 + their grads 4 + Adam 8, counted before the
    # Learner's zero_grad frees the gradients (after it: 14)
    assert learner.bytes_per_param == pytest.approx(20, abs=0.1)
    assert learner.saved_mib < results[("fp32", False)].saved_mib  # the model really ran in bf16


def test_mfu_is_measured_against_the_rate_of_the_arithmetic_a_step_computes_in(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    by_name = {c.name: c for c in bench.CONFIGS}
    monkeypatch.setenv(hardware.ENV_VAR, "fp16=emulated,bf16=native")
    assert bench.mfu_dtype(by_name["fp32"]) is torch.float32
    assert bench.mfu_dtype(by_name["mixprec O2 bf16"]) is torch.bfloat16  # native: bf16's own rate
    assert bench.mfu_dtype(by_name["torch.autocast bf16"]) is torch.bfloat16
    assert bench.mfu_dtype(by_name["mixprec O1 fp16"]) is torch.float32  # emulated: fp32 kernels
    assert bench.mfu_dtype(by_name["torch.autocast fp16 + GradScaler"]) is torch.float32
    # The table divides by the reference of each row's dtype: the same 10 ms step against fp32's rate and
    # against a rate 4x higher (bf16's) gives MFUs 4x apart.
    flops = bench.mlp_flops_per_sample(16, 32, 4) * 8 / 1e-2 / 1e9  # GFLOP/s of a 10 ms step at batch 8
    rates = {torch.float32: flops / 0.8, torch.bfloat16: 4 * flops / 0.8}  # -> 80% and 20%
    results = {(name, False): bench.Result(10.0, 1, 8, 16.0) for name in ("fp32", "mixprec O2 bf16")}
    console = Console(width=250, record=True)
    console.print(bench.report(_tiny(bench), results, rates))
    lines = [line for line in console.export_text().splitlines() if "│" in line]
    cells = {row[0]: row for row in ([c.strip() for c in line.split("│")[1:-1]] for line in lines)}
    assert cells["fp32"][6:8] == ["80%", "fp32"]
    assert cells["mixprec O2 bf16"][6:8] == ["20%", "bf16"]


def test_page_faults_counts_the_fresh_pages_a_step_touches(bench: ModuleType) -> None:
    if not bench.HAS_RUSAGE:
        pytest.skip("getrusage is Unix-only")
    pages = 2048  # 8 MiB of anonymous memory: every page is new to the process when first written
    before = bench.page_faults()
    with mmap.mmap(-1, pages * mmap.PAGESIZE) as fresh:
        for i in range(pages):
            fresh[i * mmap.PAGESIZE] = 1
    assert bench.page_faults() - before >= pages * 0.9  # the kernel may map a few pages ahead


def test_the_mlp_flop_count_is_what_a_step_computes(bench: ModuleType) -> None:
    # Count the multiply-adds of the GEMMs a training step runs: forward and weight gradient for every
    # layer, input gradient for all but the first (the data needs none).
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    flops = 0

    def count(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        nonlocal flops
        gemms = 3 if args[0].requires_grad else 2
        flops += 2 * gemms * module.in_features * module.out_features * args[0].shape[0]

    for layer in (model[0], model[2]):
        layer.register_forward_hook(count)
    model(x)
    assert flops / 8 == bench.mlp_flops_per_sample(16, 32, 4)


def test_a_configuration_that_fails_is_a_row_not_a_crash(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(runner: object, forward: object) -> object:
        def step() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16):  # fails inside a region: it must be left
                raise RuntimeError("this configuration cannot run")

        return step

    monkeypatch.setitem(bench._STEPS, "O1", broken)
    configs = [c for c in bench.CONFIGS if c.name in ("fp32", "mixprec O1 bf16")]
    results = bench.time_workload(_tiny(bench), configs, (False,), 1, 1, Console(quiet=True), {})
    assert results[("mixprec O1 bf16", False)].ms is None
    assert results[("mixprec O1 bf16", False)].error.startswith("RuntimeError: this configuration")
    assert results[("fp32", False)].ms is not None
    assert not torch.is_autocast_enabled("cpu")


def test_batch_sets_the_batch_that_runs_and_the_name_that_reports_it(bench: ModuleType) -> None:
    mlp = bench.with_batch(bench.WORKLOADS["mlp"], 64)
    assert (mlp.name, mlp.batch_size, mlp.slow_batch_size) == ("MLP 784-8192-10, b64", 64, 64)
    gpt = bench.with_batch(bench.WORKLOADS["gpt"], 32)
    assert gpt.name.endswith(", b32") and gpt.batch_size == 32
    assert gpt.slow_batch_size == bench.WORKLOADS["gpt"].slow_batch_size  # 1: already below 32
    runner = bench.make_runner(mlp, bench.CONFIGS[0], False, mlp.make().state_dict(), mlp.batch_size)
    assert runner.x.shape[0] == 64
    with pytest.raises(SystemExit, match="--batch must be at least 1"):
        bench.with_batch(bench.WORKLOADS["mlp"], 0)


def test_phases_split_the_step_and_marking_them_changes_no_weight(bench: ModuleType) -> None:
    """--phases times each phase between synchronisations: every configuration kind marks its own phases,
    in order, they add up to the step, and the marks do not change what the step computes (the same
    weights as an unmarked step of a twin runner)."""
    workload = _tiny(bench)
    state = workload.make().state_dict()
    expected = {
        "fp32": ["forward", "backward", "step"],
        "torch.autocast bf16": ["forward", "backward", "step"],
        "mixprec O2 bf16": ["forward", "backward", "unscale", "step"],  # scale_loss's exit is its own
        "mixprec Learner.to_bf16()": ["step"],  # fit's loop body, one phase
    }
    for name, phases in expected.items():
        config = next(c for c in bench.CONFIGS if c.name == name)
        marked, plain = (bench.make_runner(workload, config, False, state, 8) for _ in range(2))
        seen: list[str] = []
        marked.activate()
        marked.step(seen.append)
        plain.timed_step()
        assert seen == phases
        for a, b in zip(marked.model.parameters(), plain.model.parameters(), strict=True):
            assert torch.equal(a, b), name
        ms = bench.phase_times(marked, steps=2, warmup=0)
        assert list(ms) == [*phases, "total"] and all(v > 0 for v in ms.values())
        assert sum(ms[p] for p in phases) == pytest.approx(ms["total"], rel=0.2)  # medians of 2 steps
    rows = bench.time_phases(workload, ["fp32", "mixprec O2 bf16"], (False,), 1)
    console = Console(width=250, record=True)
    console.print(bench.phases_table(workload, rows))
    assert "unscale" in console.export_text() and len(rows) == 2
