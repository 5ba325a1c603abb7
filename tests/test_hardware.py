"""mixprec.hardware: detection of native vs emulated half arithmetic, its cache, and its overrides.

No test here depends on which CPU runs it: detection rules are exercised on faked torch answers, and the
real detection is only checked for being cached and well-formed."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

import mixprec
from mixprec import hardware
from mixprec.cli import main
from mixprec.errors import ConfigError
from mixprec.hardware import Arithmetic, Decider, HalfArithmetic

HALF = [torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def fresh_detection(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(hardware.ENV_VAR, raising=False)
    hardware.clear_cache()
    yield
    hardware.clear_cache()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("forced", ["native", "emulated", Arithmetic.EMULATED])
def test_argument_forces_either_arithmetic(dtype: torch.dtype, forced: str | Arithmetic) -> None:
    decision = hardware.half_arithmetic("cpu", dtype, override=forced)
    assert decision.arithmetic is Arithmetic(forced)
    assert decision.decided_by is Decider.ARGUMENT
    assert decision.emulated == (Arithmetic(forced) is Arithmetic.EMULATED)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("forced", ["native", "emulated", " Emulated "])
def test_env_var_forces_either_arithmetic(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, forced: str
) -> None:
    monkeypatch.setenv(hardware.ENV_VAR, forced)
    decision = hardware.half_arithmetic("cpu", dtype)
    assert decision.arithmetic.value == forced.strip().lower()
    assert decision.decided_by is Decider.ENVIRONMENT
    assert hardware.ENV_VAR in decision.reason
    assert (dtype in hardware.emulated_dtypes("cpu")) == decision.emulated


def test_argument_wins_over_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hardware.ENV_VAR, "native")
    assert hardware.half_arithmetic("cpu", torch.bfloat16, "emulated").emulated


@pytest.mark.parametrize("where", ["argument", "env"])
def test_unknown_arithmetic_names_the_choices(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    if where == "env":
        monkeypatch.setenv(hardware.ENV_VAR, "fast")
    with pytest.raises(ConfigError, match="native, emulated"):
        hardware.half_arithmetic("cpu", torch.float16, "fast" if where == "argument" else None)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        # a bad bf16 value was ignored while only fp16 was asked about (an fp16-only run never asks for bf16)
        ("fp16=emulated,bf16=bogus",
         "MIXPREC_HALF_ARITHMETIC='fp16=emulated,bf16=bogus': bf16 is 'bogus', which is not an arithmetic"),
        ("fp16=emulated,fp16=native",
         "MIXPREC_HALF_ARITHMETIC='fp16=emulated,fp16=native': names fp16 twice"),
        ("fp16=emulated, FP16 = native", "names fp16 twice"),  # the last one silently won
        ("fp16=bogus", "MIXPREC_HALF_ARITHMETIC='fp16=bogus': fp16 is 'bogus'"),  # it quoted 'bogus' alone
        ("fp16=native,fp8=native", "cannot read 'fp8=native'"),
        ("gpu:fp16=native", "'gpu' in 'gpu:fp16=native' is not a torch device type"),
        ("cuda:0:fp16=native", "'cuda:0' in 'cuda:0:fp16=native' is not a torch device type"),  # has an index
        ("cpu:fp16=emulated,CPU:fp16=native", "names fp16 on cpu twice"),
        ("cpu:bogus", "MIXPREC_HALF_ARITHMETIC='cpu:bogus': cpu is 'bogus'"),
        ("fp16=emulated,", "cannot read ''"),
    ],
)
def test_env_var_is_checked_whole_whichever_dtype_is_asked(
    monkeypatch: pytest.MonkeyPatch, value: str, message: str
) -> None:
    monkeypatch.setenv(hardware.ENV_VAR, value)
    with pytest.raises(ConfigError) as info:
        hardware.half_arithmetic("cpu", torch.float16)
    assert message in str(info.value) and "fix:" in str(info.value)


def test_env_var_per_device_type_leaves_other_devices_to_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's own setting (conftest) is CPU-only, so that on a GPU the CUDA tests run the arithmetic a
    user's GPU gets: a part for one device type wins there, and says nothing for another."""
    monkeypatch.setenv(hardware.ENV_VAR, "cpu:fp16=emulated, bf16=native, cuda:native")
    decide = hardware.half_arithmetic
    assert decide("cpu", torch.float16).emulated
    assert decide("cpu", torch.float16).decided_by is Decider.ENVIRONMENT
    assert not decide("cuda", torch.float16).emulated  # its own part, though the CPU's says emulated
    assert decide("cuda", torch.float16).decided_by is Decider.ENVIRONMENT
    assert not decide("cpu", torch.bfloat16).emulated  # the part for every device
    monkeypatch.setenv(hardware.ENV_VAR, "cpu:emulated")
    assert decide("cpu", torch.bfloat16).emulated and decide("cpu", torch.float16).emulated
    assert decide("cuda", torch.float16).decided_by is not Decider.ENVIRONMENT  # left to detection
    monkeypatch.setenv(hardware.ENV_VAR, "emulated, cuda:bf16=native")
    assert decide("cuda", torch.float16).emulated and not decide("cuda", torch.bfloat16).emulated


def test_env_var_per_dtype_leaves_the_other_to_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference the refusals are measured against: each dtype once, any case and spacing."""
    monkeypatch.setenv(hardware.ENV_VAR, " FP16 = Emulated ")
    assert hardware.half_arithmetic("cpu", torch.float16).decided_by is Decider.ENVIRONMENT
    assert hardware.half_arithmetic("cpu", torch.float16).emulated
    assert hardware.half_arithmetic("cpu", torch.bfloat16).decided_by is not Decider.ENVIRONMENT


def test_decision_is_frozen_and_only_for_half_dtypes() -> None:
    decision = hardware.half_arithmetic("cpu", torch.float16, "native")
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.arithmetic = Arithmetic.EMULATED  # type: ignore[misc]
    with pytest.raises(ConfigError, match="float16 or torch.bfloat16"):
        HalfArithmetic("cpu", torch.float32, Arithmetic.NATIVE, Decider.QUERY, "")


def test_real_detection_runs_once_and_is_well_formed() -> None:
    first = hardware.half_arithmetic("cpu", torch.bfloat16)
    assert first.decided_by in (Decider.QUERY, Decider.PROBE) and first.reason
    assert hardware.half_arithmetic("cpu", torch.bfloat16) is first  # cached, not detected again


def test_detection_is_cached_per_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, torch.dtype]] = []

    def detector(device_type: str, dtype: torch.dtype) -> tuple[Arithmetic, Decider, str]:
        calls.append((device_type, dtype))
        return Arithmetic.NATIVE, Decider.QUERY, "fake"

    monkeypatch.setitem(hardware._DETECTORS, "cpu", detector)
    for _ in range(3):
        for dtype in HALF:
            hardware.half_arithmetic("cpu", dtype)
    assert calls == [("cpu", torch.float16), ("cpu", torch.bfloat16)]


def _fake_cpu(
    monkeypatch: pytest.MonkeyPatch, onednn: bool, flags: dict[str, bool], rates: dict[torch.dtype, float],
    conv_rates: dict[torch.dtype, float] | None = None,
) -> None:
    """A CPU with these flags and GEMM (and convolution: by default the GEMMs') rates, so that no decision
    depends on the CPU running the test."""
    for dtype in HALF:
        monkeypatch.setitem(hardware._ONEDNN_SUPPORT, dtype, lambda: onednn)
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    monkeypatch.setattr(hardware, "gemm_gflops", lambda device, dtype, n, repeats=3: rates[dtype])
    convs = rates if conv_rates is None else conv_rates
    monkeypatch.setattr(hardware, "conv_grad_gflops",
                        lambda device, dtypes, rounds=3: [convs[d] for d in dtypes])


SLOW_HALF = {torch.float32: 70.0, torch.bfloat16: 0.5, torch.float16: 0.5}
FAST_HALF = {torch.float32: 140.0, torch.bfloat16: 600.0, torch.float16: 300.0}


@pytest.mark.parametrize("dtype", HALF)
def test_cpu_without_onednn_kernels_is_emulated_without_a_probe(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    _fake_cpu(monkeypatch, onednn=False, flags={"avx2": True}, rates={})  # a probe would KeyError
    decision = hardware.half_arithmetic("cpu", dtype)
    assert (decision.arithmetic, decision.decided_by) == (Arithmetic.EMULATED, Decider.QUERY)


@pytest.mark.parametrize(("dtype", "unit"), [(torch.bfloat16, "avx512_bf16"), (torch.bfloat16, "amx_bf16"),
                                             (torch.float16, "amx_fp16")])
def test_cpu_with_half_units_is_native(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, unit: str
) -> None:
    _fake_cpu(monkeypatch, onednn=True, flags={unit: True}, rates={})
    decision = hardware.half_arithmetic("cpu", dtype)
    assert (decision.arithmetic, decision.decided_by) == (Arithmetic.NATIVE, Decider.QUERY)
    assert unit in decision.reason


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(
    ("rates", "expected"), [(SLOW_HALF, Arithmetic.EMULATED), (FAST_HALF, Arithmetic.NATIVE)]
)
def test_uncertain_cpu_is_probed(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, rates: dict[torch.dtype, float], expected: Arithmetic
) -> None:
    # oneDNN has kernels but the CPU has no half units (plain AVX-512): only a measurement can tell.
    _fake_cpu(monkeypatch, onednn=True, flags={"avx512_f": True}, rates=rates)
    decision = hardware.half_arithmetic("cpu", dtype)
    assert (decision.arithmetic, decision.decided_by) == (expected, Decider.PROBE)
    assert f"{rates[dtype]:.1f} GFLOP/s" in decision.reason


@pytest.mark.parametrize("dtype", HALF)
def test_half_gemms_that_keep_up_with_slow_convolutions_are_emulated(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """The AMX Xeon's fp16 (avx512_fp16 without amx_fp16): GEMMs near fp32's rate, the convolution weight
    gradient ~150x slower. A probe of the GEMM alone called it native and a CNN trained 12-20x slower."""
    slow_conv = {torch.float32: 60.0, torch.bfloat16: 0.4, torch.float16: 0.4}
    _fake_cpu(monkeypatch, onednn=True, flags={"avx512_f": True, "avx512_fp16": True}, rates=FAST_HALF,
              conv_rates=slow_conv)
    decision = hardware.half_arithmetic("cpu", dtype)
    assert (decision.arithmetic, decision.decided_by) == (Arithmetic.EMULATED, Decider.PROBE)
    assert "convolution weight gradient runs at 0.40 GFLOP/s against fp32's 60.0" in decision.reason
    hardware.clear_cache()  # twice as slow is still native: the GEMMs share the decision
    _fake_cpu(monkeypatch, onednn=True, flags={"avx512_f": True}, rates=FAST_HALF,
              conv_rates={**slow_conv, dtype: 31.0})
    assert hardware.half_arithmetic("cpu", dtype).arithmetic is Arithmetic.NATIVE


def test_avx512_fp16_alone_is_probed_not_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cpu(monkeypatch, onednn=True, flags={"avx512_fp16": True, "amx_bf16": True}, rates=SLOW_HALF)
    decision = hardware.half_arithmetic("cpu", torch.float16)
    assert (decision.arithmetic, decision.decided_by) == (Arithmetic.EMULATED, Decider.PROBE)
    assert hardware.half_arithmetic("cpu", torch.bfloat16).decided_by is Decider.QUERY  # amx_bf16: trusted


def test_a_missing_half_convolution_is_emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cpu(monkeypatch, onednn=True, flags={"avx512_f": True}, rates=FAST_HALF)

    def no_kernel(device: str, dtypes: tuple[torch.dtype, ...], rounds: int = 3) -> list[float]:
        raise RuntimeError('"slow_conv2d_cpu" not implemented for \'Half\'')

    monkeypatch.setattr(hardware, "conv_grad_gflops", no_kernel)
    decision = hardware.half_arithmetic("cpu", torch.float16)
    assert decision.emulated
    assert "no fp16 convolution here" in decision.reason and "not implemented" in decision.reason


def test_conv_rates_are_positive_and_finite() -> None:
    rates = hardware.conv_grad_gflops("cpu", (torch.float32, torch.bfloat16), rounds=1)
    assert len(rates) == 2 and all(0 < r < float("inf") for r in rates)


def test_gemm_rate_is_positive_and_finite() -> None:
    rate = hardware.gemm_gflops("cpu", torch.float32, 32, repeats=1)
    assert 0 < rate < float("inf")


def test_hardware_line_names_threads_and_torch() -> None:
    line = hardware.hardware_line()
    assert f"{torch.get_num_threads()} threads" in line and torch.__version__ in line


@pytest.mark.parametrize(("load", "warned"), [(0.4, False), (1.5, True)])
def test_load_line_warns_when_other_work_competes(monkeypatch: pytest.MonkeyPatch, load: float,
                                                  warned: bool) -> None:
    monkeypatch.setattr(hardware.os, "getloadavg", lambda: (load, 0.0, 0.0))
    monkeypatch.setattr(hardware.os, "cpu_count", lambda: 2)
    line = hardware.load_line()
    assert f"load average {load:.2f} over 2 CPUs" in line
    assert ("other work is running" in line) is warned


@pytest.mark.parametrize("forced", ["native", "emulated"])
def test_info_command_reports_each_dtype(capsys: pytest.CaptureFixture[str], forced: str) -> None:
    assert main(["info", "--arithmetic", forced]) == 0
    out = capsys.readouterr().out
    assert hardware.hardware_line() in out
    rows = [line for line in out.splitlines() if line.strip().startswith(("fp16", "bf16"))]
    assert len(rows) == 2 and all(forced in row and "argument" in row for row in rows)
    assert ("fp32 accumulation" in out) == (forced == "emulated")


def test_info_command_reports_the_env_override(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(hardware.ENV_VAR, "emulated")
    assert main(["info"]) == 0
    assert capsys.readouterr().out.count("environment") == 2


def test_info_command_refuses_a_cuda_device_that_is_not_there(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It printed "native ... CUDA is not available; nothing runs there" and exited 0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["info", "--device", "cuda"]) == 2
    captured = capsys.readouterr()
    assert "native" not in captured.out and "Traceback" not in captured.err
    assert captured.err.startswith("mixprec: error: --device cuda: this machine has no CUDA device")
    assert "fix:" in captured.err and "--device cpu" in captured.err


def test_detection_measures_the_same_wherever_it_is_first_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked for under inference_mode, autocast and no_grad (a model's first forward at evaluation), the
    probe still gets gradients, no autocast (its fp32 kernels would run in the half dtype) and no torch-
    function mode (mixprec's region), on one CPU thread; the caller's thread count comes back."""
    seen: list[tuple[bool, bool, bool, bool, int]] = []

    def spy(device_type: str, dtype: torch.dtype) -> tuple[Arithmetic, Decider, str]:
        seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                     torch.is_autocast_enabled("cpu"), torch._C._is_torch_function_enabled(),
                     torch.get_num_threads()))
        return Arithmetic.NATIVE, Decider.PROBE, "spy"

    monkeypatch.setitem(hardware._DETECTORS, "cpu", spy)
    monkeypatch.setenv(hardware.ENV_VAR, "bf16=emulated")  # the region below pushes its torch-function mode
    threads = torch.get_num_threads()
    with torch.inference_mode(), mixprec.autocast("cpu", dtype=torch.bfloat16):
        assert torch._C._len_torch_function_stack() > 0 and torch.is_autocast_enabled("cpu")
        hardware.clear_cache()
        hardware.half_arithmetic("cpu", torch.float16)
    assert seen == [(True, False, False, False, 1)]
    assert torch.get_num_threads() == threads


def test_the_probes_leave_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    hardware.gemm_gflops("cpu", torch.float32, 32, repeats=1)
    hardware.conv_grad_gflops("cpu", (torch.float32,), rounds=1)
    assert torch.equal(torch.rand(4), expected)  # a seeded run draws the same data, detected or not
