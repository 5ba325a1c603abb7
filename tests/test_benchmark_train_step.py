"""benchmarks/train_step.py on a tiny workload: every row it reports is measured from a real run (a
configuration that cannot run fast here is skipped, not failed), and its counts agree with the tensors."""

from __future__ import annotations

import importlib.util
import mmap
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import mixprec
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
    # The tests check what a run reports, not the rates: small reference GEMMs. At the script's 2048^3 a
    # bf16 GEMM took ~35 s on an AVX2-only CPU, where the suite forces bf16 to run natively (conftest).
    module.REFERENCE_SIZE = {dev: dict.fromkeys(sizes, 64) for dev, sizes in module.REFERENCE_SIZE.items()}
    return module


def _tiny(bench: ModuleType) -> object:
    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    return bench.Workload("tiny MLP", make, batch, 8, 1, bench.mlp_flops_per_sample(16, 32, 4), 8)


@pytest.mark.usefixtures("half_saving_any_size")  # its tiny MLP's saved bytes are compared
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


_PHASES = {
    "fp32": ["forward", "backward", "step"],
    "torch.autocast bf16": ["forward", "backward", "step"],  # torch's unscale (fp16) is inside its step
    "mixprec O2 bf16": ["forward", "backward", "unscale", "step"],  # scale_loss's exit is its own
    "mixprec Learner.to_bf16()": ["whole step"],  # fit's loop body, one phase
}


def _mark_checker(name: str, r: object, seen: list[str]) -> Callable[[str], None]:
    """A mark that checks the training state its phase must have left (see the test below)."""
    params = list(r.model.parameters())  # type: ignore[attr-defined]
    before = [p.detach().clone() for p in params]
    opt = r.opt  # type: ignore[attr-defined]

    def check(phase: str) -> None:
        seen.append(phase)
        unmoved = all(torch.equal(a, p) for a, p in zip(before, params, strict=True))
        masters = list(opt.master_params()) if hasattr(opt, "master_params") else []
        if phase == "forward":
            assert unmoved and all(p.grad is None for p in params), name
        elif phase == "backward":
            assert unmoved and all(p.grad is not None for p in params), name
            assert all(m.grad is None for m in masters), name
        elif phase == "unscale":
            assert unmoved and masters and all(m.grad is not None for m in masters), name
        else:
            assert not unmoved, name

    return check


def test_each_phase_mark_falls_where_its_name_says(bench: ModuleType) -> None:
    """Each mark is checked against the training state at that moment, on a runner's first step: after
    "forward" no gradient and the weights as they were; after "backward" every gradient and the weights
    as they were (under O2 the fp32 masters have none yet: scale_loss's exit copies them); after O2's
    "unscale" the masters hold them; after the step the weights moved."""
    workload = _tiny(bench)
    state = workload.make().state_dict()
    for name, phases in _PHASES.items():
        config = next(c for c in bench.CONFIGS if c.name == name)
        r = bench.make_runner(workload, config, False, state, 8)
        seen: list[str] = []
        check = _mark_checker(name, r, seen)
        r.activate()
        r.step(check)
        assert seen == phases


def test_the_marked_steps_train_as_a_hand_written_step(bench: ModuleType) -> None:
    """The step functions against the same step written out here (two steps from the same weights): the
    marks and their refactor changed nothing a step computes."""
    import mixprec

    workload = _tiny(bench)
    state = workload.make().state_dict()

    def loss(r: object) -> torch.Tensor:
        out = r.model(r.x)  # type: ignore[attr-defined]
        return torch.nn.functional.cross_entropy(out.float(), r.y)  # type: ignore[attr-defined]

    def by_hand(name: str, r: object) -> None:
        opt = r.opt  # type: ignore[attr-defined]
        opt.zero_grad(set_to_none=True)
        if name == "fp32":
            loss(r).backward()
        elif name == "torch.autocast bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                value = loss(r)
            value.backward()
        else:
            with mixprec.scale_loss(loss(r), opt) as scaled:
                scaled.backward()
        opt.step()

    for name in ("fp32", "torch.autocast bf16", "mixprec O2 bf16"):
        config = next(c for c in bench.CONFIGS if c.name == name)
        ours, ref = (bench.make_runner(workload, config, False, state, 8) for _ in range(2))
        for _ in range(2):
            ours.activate()
            ours.step()
            ref.activate()
            by_hand(name, ref)
        for a, b in zip(ours.model.parameters(), ref.model.parameters(), strict=True):
            assert torch.equal(a, b), name


def test_phase_times_leave_out_the_warm_up_and_add_up_to_the_step(bench: ModuleType) -> None:
    """A stand-in runner whose first forward takes 60 ms (a compile) and later ones ~1: the median over one
    timed step after one warm-up step sees only the fast one."""
    import time as clock

    class Stub:
        device_type = "cpu"
        calls = 0

        def activate(self) -> None:
            pass

        def step(self, mark: object) -> None:
            clock.sleep(0.06 if self.calls == 0 else 0.001)
            self.calls += 1
            mark("forward")  # type: ignore[operator]
            clock.sleep(0.002)
            mark("step")  # type: ignore[operator]

    ms = bench.phase_times(Stub(), steps=1, warmup=1)
    assert list(ms) == ["forward", "step", "total"]
    assert ms["forward"] < 30 and ms["step"] >= 2  # 60 ms only if the warm-up were counted
    assert ms["total"] == pytest.approx(ms["forward"] + ms["step"])


def test_the_phase_table_runs_each_configuration_and_says_why_one_did_not(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    workload = _tiny(bench)
    rows = bench.time_phases(workload, ["fp32", "mixprec O2 bf16", "mixprec Learner.to_bf16()"], (False,), 1)
    assert set(rows[("mixprec O2 bf16", False)]) == {"forward", "backward", "unscale", "step", "total"}
    assert set(rows[("mixprec Learner.to_bf16()", False)]) == {"whole step", "total"}
    monkeypatch.setenv(hardware.ENV_VAR, "fp16=emulated,bf16=emulated")  # torch.autocast bf16 is "slow"
    rows[("torch.autocast bf16", False)] = bench.time_phases(
        workload, ["torch.autocast bf16"], (False,), 1)[("torch.autocast bf16", False)]
    assert rows[("torch.autocast bf16", False)] == "skipped: no fast kernels here"
    console = Console(width=250, record=True)
    console.print(bench.phases_table(workload, rows))
    lines = [line for line in console.export_text().splitlines() if "│" in line]
    cells = {tuple(c.strip() for c in line.split("│")[1:3]): [c.strip() for c in line.split("│")[3:-1]]
             for line in lines}
    assert len(cells[("mixprec Learner.to_bf16()", "eager")]) == 5  # four phases and total: no extra column
    assert cells[("mixprec Learner.to_bf16()", "eager")][:4] == ["", "", "", ""]  # its whole step: total only
    assert cells[("torch.autocast bf16", "eager")][-1].startswith("skipped")


def test_host_syncs_lists_the_waits_of_one_step_and_leaves_the_mode_as_it_was(bench: ModuleType) -> None:
    """torch's sync debug mode needs CUDA; a stand-in mode and a step that warns as torch does where the
    host waits (an .item() on a GPU tensor): each warning is listed, and the mode is reset even when the
    step raises."""
    import warnings

    modes: list[str] = []

    class Stub:
        device_type = "cpu"

        def __init__(self, fail: bool) -> None:
            self.fail = fail

        def activate(self) -> None:
            pass

        def step(self) -> None:
            if modes[-1] == "warn":
                warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
            if self.fail:
                raise RuntimeError("boom")

    found = bench.host_syncs(Stub(False), set_mode=modes.append)
    assert modes == ["warn", "default"] and len(found) == 1 and "synchronizing" in found[0]
    assert found[0].startswith("test_benchmark_train_step.py:")
    with pytest.raises(RuntimeError, match="boom"):
        bench.host_syncs(Stub(True), set_mode=modes.append)
    assert modes[-1] == "default"
    with pytest.raises(SystemExit, match="--sync-check"):
        bench.main(["--sync-check", "--phases", "fp32"])


def test_the_word_language_model_flops_match_what_runs(bench: ModuleType) -> None:
    """MFU of the two torch-layer workloads: the Transformer's formula against torch's FLOP counter (the
    PaLM attention term counts the full T x T scores, torch's causal kernel a little less), the LSTM's (its
    fused kernel is not counted there) against 6 FLOPs per GEMM weight of the model itself."""
    from torch.utils.flop_counter import FlopCounterMode

    w = bench.WORKLOADS["transformer-lm"]
    model, (x, y) = w.make(), w.batch(2)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x).flatten(0, -2), y.flatten()).backward()
    assert counter.get_total_flops() / x.numel() == pytest.approx(w.flops_per_token, rel=0.03)
    lstm = bench.WORKLOADS["lstm-lm"].make()
    gemm_weights = sum(p.numel() for n, p in lstm.named_parameters() if "weight" in n and "embed" not in n)
    assert bench.WORKLOADS["lstm-lm"].flops_per_token == 6.0 * gemm_weights


@pytest.mark.parametrize(
    ("name", "is_gemm"),
    [
        # kernel names from the H200's profile (RESULTS.md, "A fourth H200") and cuBLAS/CUTLASS's older ones
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT", True),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", True),
        ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", True),
        ("triton_per_fused__softmax__to_copy_bitwise_not_div_exp_masked_fill_view_17", False),
        ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda", False),
        ("void (anonymous namespace)::softmax_warp_backward<float, float, float, 9, false, false>", False),
    ],
)
def test_kernel_names_are_told_apart_as_gemms_or_not(bench: ModuleType, name: str, is_gemm: bool) -> None:
    assert bool(bench.GEMM_KERNEL.search(name)) is is_gemm


def test_kernel_share_bound_is_the_step_over_its_gemms(bench: ModuleType) -> None:
    """The most a step could gain if all but its GEMMs took no time: 26.2 ms of which 13.8 are GEMMs, 1.9x."""
    share = bench.KernelShare(step_ms=26.2, kernels_ms=24.65, gemm_ms=13.79, top=[])
    assert share.bound == pytest.approx(26.2 / 13.79)
    assert bench.KernelShare(1.0, 0.0, 0.0, []).bound == float("inf")  # a step with no GEMM kernel seen


def test_kernels_asks_for_a_gpu(bench: ModuleType) -> None:
    with pytest.raises(SystemExit, match="--kernels times GPU kernels: use it with --device cuda"):
        bench.main(["--kernels", "mixprec O2 bf16"])


def test_kernel_shares_after_a_failed_configuration_run_the_next_outside_its_region(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A configuration whose step raises inside a region is a printed result, and the next one is measured
    with no region left entered (as the main table and the phase table do)."""
    seen: list[tuple[int, bool, int]] = []

    def share(runner: object, steps: int) -> object:
        seen.append((torch._C._len_torch_function_stack(), torch.is_autocast_enabled("cpu"),
                     len(bench.STATE.regions)))
        if len(seen) == 1:
            mixprec.autocast("cpu", torch.float16).__enter__()  # a step that fails inside its region
            raise RuntimeError("step failed inside the region")
        return bench.KernelShare(2.0, 1.5, 1.0, [("gemm_kernel", 1.0)])

    monkeypatch.setattr(bench, "kernel_share", share)
    console = Console(width=200, record=True)
    bench.print_kernel_shares(_tiny(bench), ["fp32", "mixprec O1 fp16"], (False,), 1, "cpu", console)
    text = console.export_text()
    assert "fp32 (eager): " in text and "RuntimeError: step failed inside the region" in text
    assert "mixprec O1 fp16 (eager): step 2.00 ms" in text
    assert seen[1] == (0, False, 0)  # nothing of the failed step's region left
    assert torch.get_autocast_dtype("cpu") is torch.bfloat16  # torch's top-level dtype, not the region's
    with torch.autocast("cpu", torch.bfloat16):  # the nesting is back to 0: leaving a region clears the cache
        w = nn.Parameter(torch.ones(2, 2))
        nn.functional.linear(torch.ones(1, 2), w)
    with torch.no_grad():
        w.mul_(2)
    with torch.autocast("cpu", torch.bfloat16):
        assert nn.functional.linear(torch.ones(1, 2), w).sum().item() == 8.0  # not the cached cast of 1s
