"""The native one-pass Adam/AdamW step of split masters (mixprec/split_adam.py, split_adam.c). Reference:
torch's own Adam/AdamW on fp32 parameters fed the same gradients, with one change -- its ``Tensor.sqrt``
made correctly rounded (through fp64), as the C loop's sqrtf is: torch's CPU sqrt (MKL's vector math above
~100 elements) is one ulp off in ~0.6% of elements."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
from mixprec import native, split_adam
from mixprec.cli import main
from mixprec.data import digits
from mixprec.errors import ConfigError
from mixprec.low_precision import LowPrecisionOptimizer, footprint
from mixprec.scaler import GradScaler
from mixprec.split_adam import library_error

pytestmark = pytest.mark.skipif(library_error() is not None, reason=f"no native step: {library_error()}")

BF16 = torch.bfloat16
SHAPES = [(300, 200), (200,), (1000, 37), (5,)]  # large enough for torch's vector-math sqrt, and tails
OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "AdamW, weight decay": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "Adam, L2 weight decay": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),
    # beta1 = 0.3: 1 - beta1 >= 0.5 takes lerp's other formula; maximize flips the gradient
    "Adam, maximize, beta1 0.3": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.3, 0.99), maximize=True),
    "AdamW, two groups": lambda ps: torch.optim.AdamW(
        [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3, "weight_decay": 0.0}], lr=1e-2),
}


def _pair(seed: int = 0) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """bf16 parameters and fp32 ones holding the same values."""
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g).to(BF16) for s in SHAPES]
    return [nn.Parameter(t.clone()) for t in init], [nn.Parameter(t.float()) for t in init]


def _grads(half: list[nn.Parameter], ref: list[nn.Parameter], seed: int, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    for h, r in zip(half, ref, strict=True):
        h.grad = (torch.randn(h.shape, generator=g) * scale).to(BF16)
        r.grad = h.grad.float() / scale  # scale: a power of two, so the division is exact


def _step_both(opt: torch.optim.Optimizer, ref_opt: torch.optim.Optimizer, half: list[nn.Parameter],
               ref: list[nn.Parameter], steps: int) -> None:
    """``steps`` steps of the split wrapper and of the fp32 reference on the same gradients."""
    for i in range(steps):
        _grads(half, ref, i)
        opt.step()
        ref_opt.step()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_native_step_is_torch_adam_on_the_fp32_masters_bit_for_bit(name: str, exact_sqrt: None) -> None:
    half, ref = _pair()
    make = OPTIMIZERS[name]
    opt, ref_opt = LowPrecisionOptimizer(make(half), "split", kernel="native"), make(ref)
    _step_both(opt, ref_opt, half, ref, 6)
    for m, r in zip(opt.master_values(), ref, strict=True):
        assert torch.equal(m.view(torch.int32), r.detach().view(torch.int32))
    for h, r in zip(half, ref, strict=True):
        mine, theirs = opt.state[h], ref_opt.state[r]
        assert torch.equal(mine["exp_avg"], theirs["exp_avg"])
        assert torch.equal(mine["exp_avg_sq"], theirs["exp_avg_sq"])
        assert mine["step"].item() == theirs["step"].item() == 6


def test_native_step_stays_within_a_few_ulps_of_torch_adamw_as_it_is() -> None:
    """Without the sqrt change: torch's own rounding differs in a few elements per step; 20 steps later
    the masters differ by at most a few ulps at the tensor's scale, in a small share of elements."""
    half, ref = _pair()
    opt = LowPrecisionOptimizer(torch.optim.AdamW(half, lr=1e-3), "split", kernel="native")
    ref_opt = torch.optim.AdamW(ref, lr=1e-3)
    _step_both(opt, ref_opt, half, ref, 20)
    for m, r in zip(opt.master_values(), ref, strict=True):
        r = r.detach()
        # ulps of the tensor's largest value, not of each element: an element near zero keeps the absolute
        # difference it picked up while larger (on an AVX2 EPYC 2**-23 at a 3e-5 weight: 64 of its own
        # ulps; at most 8 on an AMX Xeon, whose torch rounds otherwise)
        assert (m - r).abs().max().item() <= 8 * r.abs().max().item() * 2**-23
        assert (m != r).float().mean().item() < 0.1


def test_auto_picks_the_native_step_and_generic_keeps_torchs_numbers(exact_sqrt: None) -> None:
    """kernel='auto' runs the native step where it applies: equal to the native step, and (with the
    sqrt change) to the generic one, which runs torch's optimizer."""
    results = {}
    for kernel in ("auto", "native", "generic"):
        half, ref = _pair()
        opt = LowPrecisionOptimizer(torch.optim.AdamW(half, lr=1e-2), "split", kernel=kernel)
        for i in range(3):
            _grads(half, ref, i)
            opt.step()
        results[kernel] = opt.master_values()
    for a, b, c in zip(results["auto"], results["native"], results["generic"], strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_grad_scaler_unscales_and_skips_like_the_generic_step(exact_sqrt: None) -> None:
    """scaler.step(wrapper): the native step multiplies by 1/scale (exact for a power of two) and an inf
    gradient skips the whole step: masters, moments and step counts untouched."""
    half, ref = _pair()
    opt = LowPrecisionOptimizer(torch.optim.AdamW(half, lr=1e-2), "split", kernel="native")
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    scaler = GradScaler("cpu", init_scale=1024.0, dynamic=False)
    dummy = torch.ones((), requires_grad=True)
    for i in range(3):
        _grads(half, ref, i, scale=1024.0)
        scaler.scale(dummy).backward()
        scaler.step(opt)
        scaler.update()
        ref_opt.step()
    before = [m.clone() for m in opt.master_values()]
    moments = [opt.state[h]["exp_avg"].clone() for h in half]
    _grads(half, ref, 3, scale=1024.0)
    half[1].grad[0] = float("inf")
    scaler.scale(dummy).backward()
    scaler.step(opt)
    for m, r, b in zip(opt.master_values(), ref, before, strict=True):
        assert torch.equal(m, r.detach()) and torch.equal(m, b)
    assert all(torch.equal(opt.state[h]["exp_avg"], m) for h, m in zip(half, moments, strict=True))
    assert all(opt.state[h]["step"].item() == 3 for h in half)


def test_fused_adamw_is_stepped_natively_with_torchs_fused_numbers() -> None:
    """torch's fused CPU AdamW rounds sqrt correctly too: the native step (no sqrt change here) gives its
    masters bit for bit on its vectorised path, and within an ulp or two in the scalar tails (the last few
    elements of each thread's share, so where they fall depends on the thread count)."""
    half, ref = _pair()
    opt = LowPrecisionOptimizer(torch.optim.AdamW(half, lr=1e-2, weight_decay=0.1, fused=True), "split",
                                kernel="native")
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    _step_both(opt, ref_opt, half, ref, 6)
    ulps = torch.cat([(m.view(torch.int32) - r.detach().view(torch.int32)).abs().flatten()
                      for m, r in zip(opt.master_values(), ref, strict=True)])
    assert ulps.max().item() <= 2
    assert torch.count_nonzero(ulps).item() <= 16 * 4 * torch.get_num_threads()  # tails only


def test_result_does_not_depend_on_the_thread_count() -> None:
    threads, results = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            half, ref = _pair()
            opt = LowPrecisionOptimizer(torch.optim.AdamW(half, lr=1e-2), "split", kernel="native")
            for i in range(3):
                _grads(half, ref, i)
                opt.step()
            results.append(opt.master_values())
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("make, words", [
    (lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2)), "hyperparameter .* is a tensor"),
    (lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True), "amsgrad=True"),
    (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), "not SGD"),
])
def test_native_refuses_what_it_does_not_implement_and_auto_falls_back(make, words: str) -> None:
    """Refused with the reason under kernel='native'; under 'auto' the generic step, with a warning for an
    Adam the native step could have run but for a setting (none for another optimizer: nothing to miss)."""
    half, ref = _pair()
    _grads(half, ref, 0)
    with pytest.raises(ConfigError, match=words):
        LowPrecisionOptimizer(make(half), "split", kernel="native").step()
    auto = LowPrecisionOptimizer(make(half), "split")
    generic_half, _ = _pair()
    generic = LowPrecisionOptimizer(make(generic_half), "split", kernel="generic")
    for h, g in zip(half, generic_half, strict=True):
        g.grad = h.grad.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto.step()
        auto.step()  # once per reason
    warned = [w for w in caught if "steps generically" in str(w.message)]
    assert len(warned) == (0 if words == "not SGD" else 1)
    generic.step()
    generic.step()
    assert all(torch.equal(a, b) for a, b in zip(auto.master_values(), generic.master_values(), strict=True))


def test_a_parameter_with_gaps_falls_back_with_a_warning_and_native_names_it(exact_sqrt: None) -> None:
    w = nn.Parameter(torch.randn(40, 60).to(BF16)[:, ::2])  # every other column: memory with gaps
    w.grad = torch.randn(40, 30).to(BF16)
    with pytest.raises(ConfigError, match="gradient of a parameter of shape .40, 30. is not bf16 laid out"):
        LowPrecisionOptimizer(torch.optim.AdamW([w], lr=1e-2), "split", kernel="native").step()
    w.grad = torch.randn(40, 60).to(BF16)[:, ::2]  # the parameter's own strides
    with pytest.raises(ConfigError, match="not a dense bf16 CPU tensor"):
        LowPrecisionOptimizer(torch.optim.AdamW([w], lr=1e-2), "split", kernel="native").step()
    ref = nn.Parameter(w.detach().float())
    ref.grad = w.grad.float()
    opt = LowPrecisionOptimizer(torch.optim.AdamW([w], lr=1e-2), "split")
    ref_opt = torch.optim.AdamW([ref], lr=1e-2)
    with pytest.warns(UserWarning, match="steps generically.*not a dense bf16 CPU tensor"):
        opt.step()
    ref_opt.step()
    assert torch.equal(opt.master_values()[0], ref.detach())


def test_transposed_parameters_are_stepped_natively(exact_sqrt: None) -> None:
    """A transposed weight (dense, another order of dimensions) with a gradient of its layout: native."""
    w = nn.Parameter(torch.randn(40, 30).to(BF16).t())
    ref = nn.Parameter(w.detach().float())
    opt = LowPrecisionOptimizer(torch.optim.AdamW([w], lr=1e-2), "split", kernel="native")
    ref_opt = torch.optim.AdamW([ref], lr=1e-2)
    for _ in range(3):
        w.grad = torch.randn(40, 30).to(BF16).t()  # as autograd makes it: the parameter's strides
        ref.grad = w.grad.float()
        opt.step()
        ref_opt.step()
    assert torch.equal(opt.master_values()[0], ref.detach())


def test_kernel_choice_is_checked_when_the_wrapper_is_built() -> None:
    half, _ = _pair()
    with pytest.raises(ConfigError, match="kernel='fast' is not one of"):
        LowPrecisionOptimizer(torch.optim.AdamW(half), "split", kernel="fast")
    with pytest.raises(ConfigError, match="mode='split' without state_dtype"):
        LowPrecisionOptimizer(torch.optim.AdamW(half), "kahan", kernel="native")


def test_replaced_state_is_followed_not_written_through_stale_pointers(exact_sqrt: None) -> None:
    """A resume loads new state tensors into the wrapped optimizer: the next native step must update
    those (the plan of raw pointers is rebuilt), giving the uninterrupted run's masters."""
    half, ref = _pair()
    opt = LowPrecisionOptimizer(torch.optim.AdamW(half, lr=1e-2), "split", kernel="native")
    for i in range(2):
        _grads(half, ref, i)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())  # torch's state_dict holds the live state tensors
    _grads(half, ref, 2)
    opt.step()
    expected = opt.master_values()
    half2, ref2 = _pair()
    resumed = LowPrecisionOptimizer(torch.optim.AdamW(half2, lr=1e-2), "split", kernel="native")
    for i in range(2):
        _grads(half2, ref2, i)
        resumed.step()  # makes state and a plan
    resumed.load_state_dict(saved)  # the same values (its weights match), in new state tensors
    _grads(half2, ref2, 2)
    resumed.step()
    assert all(torch.equal(a, b) for a, b in zip(resumed.master_values(), expected, strict=True))
    assert all(resumed.state[h]["step"].item() == 3 for h in half2)


def test_split_keeps_14_bytes_per_parameter_with_the_native_step() -> None:
    half, ref = _pair()
    opt = LowPrecisionOptimizer(torch.optim.AdamW(half, lr=1e-2), "split", kernel="native")
    _grads(half, ref, 0)
    opt.step()
    assert footprint(opt).per_param == 2 + 2 + 2 + 8  # weight, grad, low half, two fp32 moments


def test_without_a_compiler_auto_steps_generically_and_info_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str], exact_sqrt: None
) -> None:
    monkeypatch.setattr(native, "_LIBRARY", {})  # forget this process's build
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))  # and the cached library
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    half, ref = _pair()
    _grads(half, ref, 0)
    with pytest.raises(ConfigError, match="no-such-cc.*cannot be run"):
        LowPrecisionOptimizer(torch.optim.AdamW(half, lr=1e-2), "split", kernel="native").step()
    opt = LowPrecisionOptimizer(torch.optim.AdamW(half, lr=1e-2), "split")
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    opt.step()
    ref_opt.step()
    assert all(torch.equal(m, r.detach()) for m, r in zip(opt.master_values(), ref, strict=True))
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "split masters" in out and "generic step" in out and "no-such-cc" in out


def test_info_reports_the_native_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    assert "native one-pass loop" in capsys.readouterr().out


def test_the_docs_o2_split_recipe_runs_and_matches_o2_with_fp32_masters() -> None:
    """docs/low-precision.md's O2 + split block, run as written (14 B/param); then the same recipe on digits
    trains as O2 with MasterWeights does (the loss after 40 steps within 2%)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "low-precision.md").read_text()
    code = text.split("<!-- o2-split", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, object] = {}
    exec(compile(code, "docs/low-precision.md", "exec"), namespace)
    assert footprint(namespace["opt"]).per_param == 14.0  # type: ignore[arg-type]
    losses = {}
    for masters in ("split", "fp32"):
        torch.manual_seed(0)
        data = digits(batch_size=64)
        model = mixprec.build_model("mlp", data, n_hidden=256)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # initialize called again in one process
            model, opt = mixprec.initialize(model, opt, "O2", dtype=BF16, master_weights=masters == "fp32",
                                            verbosity=0)
        if masters == "split":
            opt = LowPrecisionOptimizer(opt, "split", kernel="native")
        batches = iter(data.train)
        for _ in range(40):
            x, y = next(batches, None) or next(batches := iter(data.train))
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        x, y = next(iter(data.valid))
        with torch.no_grad():
            losses[masters] = nn.functional.cross_entropy(model(x), y).item()
    assert losses["split"] == pytest.approx(losses["fp32"], rel=0.02)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's memory map (Linux)")
@pytest.mark.parametrize("first", ["", "import sklearn.datasets, sklearn.utils._openmp_helpers"])
def test_the_loop_runs_on_torchs_openmp_runtime_not_a_second_one(first: str, tmp_path: Path) -> None:
    """Two OpenMP runtimes in one process mean two thread pools fighting for the cores: building and
    loading the loop maps no libgomp that was not there, even where another library (scikit-learn) loaded
    its own first. A fresh process and an empty cache, so that this process's build is not reused."""
    code = f"""if True:
        {first}
        import torch
        from pathlib import Path
        def gomps():
            lines = Path("/proc/self/maps").read_text().splitlines()
            return {{line.split()[-1] for line in lines if "/libgomp" in line}}
        before = gomps()
        from mixprec import split_adam
        assert split_adam.library_error() is None, split_adam.library_error()
        print("new:", sorted(gomps() - before), split_adam.library_threads())
    """
    env = {**os.environ, "MIXPREC_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(Path(__file__).parents[1])}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "new: [] torch's OpenMP threads" in run.stdout


def test_scale_loss_tells_a_split_wrapper_what_to_do_instead() -> None:
    model = nn.Linear(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model, opt = mixprec.initialize(model, torch.optim.AdamW(model.parameters()), "O2", dtype=BF16,
                                        master_weights=False, verbosity=0)
    wrapped = LowPrecisionOptimizer(opt, "split")
    loss = model(torch.randn(2, 8)).float().sum()
    with pytest.raises(ConfigError, match=r"a LowPrecisionOptimizer(.|\n)*call loss.backward\(\) and opt"):
        with mixprec.scale_loss(loss, wrapped):
            pass


def test_a_compiler_without_march_native_or_openmp_still_builds_a_portable_loop(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, exact_sqrt: None
) -> None:
    """A compiler that refuses -march=native and -fopenmp (an old or foreign one): the loop is built
    without both, runs on one thread, and steps with the same numbers."""
    real = shutil.which("cc") or shutil.which("gcc")
    assert real is not None
    picky = tmp_path / "picky-cc"
    picky.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in -march=native|-fopenmp) exit 1;; esac; done\n'
                     f'exec {real} "$@"\n')
    picky.chmod(0o755)
    monkeypatch.setattr(native, "_LIBRARY", {})
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(picky))
    assert split_adam.library_error() is None
    assert split_adam.library_threads() == "one thread: the C compiler has no OpenMP nor -march=native"
    half, ref = _pair()
    opt = LowPrecisionOptimizer(torch.optim.AdamW(half, lr=1e-2), "split", kernel="native")
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    _step_both(opt, ref_opt, half, ref, 3)
    assert all(torch.equal(m, r.detach()) for m, r in zip(opt.master_values(), ref, strict=True))
