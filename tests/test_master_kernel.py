"""The compiled one-pass O2 Adam/AdamW step (``MasterWeights(..., master_grads=False, compile_step=True)``).

Reference: torch.optim.Adam/AdamW (single-tensor, fp32) stepping an fp32 copy of the masters on the same
gradients, upcast exactly from bf16. The compiled loop computes the same formula in a different order of
fp32 operations (Inductor fuses it), so results agree to a few fp32 roundings, not bit for bit: tolerance
1e-6 absolute on values of order 1 after five steps (one Adam step moves a weight by about lr = 1e-2; a
wrong bias correction, decay or unscale is off by > 1e-4). Few tests: each compiles once (seconds).
"""

from __future__ import annotations

import copy
import gc
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch._dynamo

import mixprec
from mixprec import master_fused
from mixprec.errors import ConfigError
from mixprec.master import MasterWeights
from mixprec.master_fused import FusedMasterStep
from mixprec.master_kernel import (
    COEFFICIENTS,
    KernelUnit,
    adam_pass,
    coefficients,
    coefficients_on_device,
    record_non_finite_,
)
from mixprec.scaler import GradScaler

SHAPES = [(64, 48), (48,), (5, 64)]
TOL = 1e-6


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _grads(step: int, dtype: torch.dtype, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    # magnitudes from 1e-6 to 1: Adam's eps and the second moment both matter somewhere
    return [(torch.randn(s, generator=g) * torch.logspace(-6, 0, s[-1])).to(device, dtype) for s in SHAPES]


def _pair(
    kind: str, device: str = "cpu", **settings: object
) -> tuple[torch.optim.Optimizer, MasterWeights, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    fp32 = [torch.randn(s, generator=g).to(device) for s in SHAPES]
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    reference = cls([torch.nn.Parameter(p.clone()) for p in fp32], lr=1e-2, foreach=False, **settings)
    half = [torch.nn.Parameter(p.to(torch.bfloat16)) for p in fp32]
    ours = MasterWeights(cls(half, lr=1e-2, **settings), master_grads=False, compile_step=True,
                         initial=dict(zip(half, fp32, strict=True)))
    return reference, ours, half


@pytest.mark.parametrize(
    ("kind", "settings", "device"),
    # one per decay kind: decoupled, L2 (its own write order), none; and the GPU's generated kernel (Triton)
    [("adamw", {"weight_decay": 0.1}, "cpu"), ("adam", {"weight_decay": 0.05, "maximize": True}, "cpu"),
     ("adam", {}, "cpu"), pytest.param("adamw", {"weight_decay": 0.1}, "cuda", marks=CUDA)],
)
def test_the_compiled_step_is_torch_adam_on_fp32_masters(
    kind: str, settings: dict, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a GPU steps with torch's fused kernel (master_fused.COMPILED_ON); its generated kernel is tested here
    monkeypatch.setattr(master_fused, "COMPILED_ON", frozenset({"cpu", "cuda"}))
    reference, ours, half = _pair(kind, device, **settings)
    for step in range(5):
        grads = _grads(step, torch.bfloat16, device)
        for p, g in zip(reference.param_groups[0]["params"], grads, strict=True):
            p.grad = g.float()  # exact: the reference sees the very values the kernel upcasts
        for p, g in zip(half, grads, strict=True):
            p.grad = g
        reference.step()
        ours.step()
    for want, got, model in zip(reference.param_groups[0]["params"], ours.master_views(), half, strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=TOL)
        assert torch.equal(model.detach(), got.to(torch.bfloat16))  # the model is its master rounded
    for want, got in zip(reference.state.values(), ours.state.values(), strict=True):
        assert float(got["step"]) == float(want["step"]) == 5
        torch.testing.assert_close(got["exp_avg_sq"], want["exp_avg_sq"], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("where", ["cpu", "cpu, skip in kernel", pytest.param("cuda", marks=CUDA)])
def test_with_a_scaler_it_unscales_skips_overflows_and_does_not_recompile_for_a_new_lr(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Skip in kernel: the GPU's way (reading found_inf there would sync every step), forced on the CPU
    too: the pass takes the flag and writes the old values back; the result must be the same."""
    device = where.split(",")[0]
    skip_in_kernel = where != "cpu"
    monkeypatch.setattr(master_fused, "COMPILED_ON", frozenset({"cpu", "cuda"}))  # as above
    passed_flags: list[bool] = []
    if skip_in_kernel:
        if device == "cpu":
            monkeypatch.setattr(master_fused, "SKIP_ON_HOST", frozenset())

        def spy(units: object, groups: object, grad_scale: object, found_inf: object = None) -> None:
            passed_flags.append(found_inf is not None)
            adam_pass(units, groups, grad_scale, found_inf)  # type: ignore[arg-type]

        monkeypatch.setattr(master_fused, "adam_pass", spy)
    reference, ours, half = _pair("adamw", device, weight_decay=0.1)
    scaler = GradScaler(device, init_scale=2.0**10, growth_interval=1000)
    dummy = torch.ones((), requires_grad=True, device=device)  # scale() needs a tensor on the graph
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(4):
            grads = _grads(step, torch.float32, device)
            for p, g in zip(half, grads, strict=True):
                p.grad = (g * scaler.get_scale()).to(torch.bfloat16)  # what a scaled backward leaves
            if step == 1:
                half[2].grad[0, 0] = float("inf")  # skipped: masters, moments, step count untouched
            else:
                for p, g in zip(reference.param_groups[0]["params"], half, strict=True):
                    p.grad = g.grad.float() / scaler.get_scale()
                reference.step()
            scaler.scale(dummy).backward()
            scaler.step(ours)
            scaler.update()
            for group in (*reference.param_groups, *ours.param_groups):
                group["lr"] *= 0.5  # a schedule: the kernel reads lr as data, not as a constant
    for want, got in zip(reference.param_groups[0]["params"], ours.master_views(), strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=TOL)
    assert [float(s["step"]) for s in ours.state.values()] == [3.0] * len(SHAPES)
    assert passed_flags == ([True] * 4 if skip_in_kernel else [])  # the overflowing step ran the pass too


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_read_only_inf_check_records_what_torchs_check_records(dtype: torch.dtype) -> None:
    # Reference: torch's own check at scale 1, on copies. Each case keeps the same shapes (one compile).
    cases = {"finite": None, "nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
    for bad in cases.values():
        for already in (0.0, 1.0):
            grads = _grads(0, dtype)
            if bad is not None:
                grads[1][7] = bad
            want = torch.tensor(already)
            torch._amp_foreach_non_finite_check_and_unscale_([g.clone() for g in grads], want, torch.ones(()))
            versions = [g._version for g in grads]
            got = torch.tensor(already)
            record_non_finite_(grads, got)
            assert float(got) == float(want) == (1.0 if bad is not None or already else 0.0)
            assert [g._version for g in grads] == versions  # read only: no gradient written


def test_a_scaler_checks_the_compiled_steps_half_gradients_with_the_read_only_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch_check = torch._amp_foreach_non_finite_check_and_unscale_
    checked: list[torch.dtype] = []

    def recording(grads: list[torch.Tensor], found: torch.Tensor, inv_scale: torch.Tensor) -> None:
        checked.extend(g.dtype for g in grads)
        torch_check(grads, found, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", recording)
    _, ours, half = _pair("adamw")
    scaler = GradScaler("cpu", init_scale=2.0**10)
    for step in range(2):
        for p, g in zip(half, _grads(step, torch.bfloat16), strict=True):
            p.grad = g
        if step == 1:
            half[0].grad[3, 3] = float("nan")  # found by the read-only check: the step is skipped
        scaler.scale(torch.ones((), requires_grad=True)).backward()
        scaler.step(ours)
        scaler.update()
    assert torch.bfloat16 not in checked  # the half gradients never went through torch's check
    assert [float(s["step"]) for s in ours.state.values()] == [1.0] * len(SHAPES)  # stepped, then skipped
    assert scaler.get_scale() == 2.0**9  # the NaN backed the scale off


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda ps: MasterWeights(torch.optim.AdamW(ps, amsgrad=True), master_grads=False, compile_step=True),
         "amsgrad"),
        (lambda ps: MasterWeights(torch.optim.AdamW(ps), compile_step=True), "master_grads=False"),
    ],
)
def test_what_the_compiled_step_does_not_implement_is_refused(build: object, needle: str) -> None:
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    with pytest.raises(ConfigError, match=needle):
        build(params)  # type: ignore[operator]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_the_cpu_coefficients_equal_the_device_path_that_reads_no_step_count(device: str) -> None:
    # Python doubles on the CPU, fp64 tensor ops elsewhere (no sync): the same rows, to one fp32 rounding
    # (the two pow() implementations may differ in the last bit of a double).
    groups = [
        {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
        {"lr": torch.tensor(3e-4, device=device), "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.0},
    ]
    zeros = [torch.zeros(2, device=device) for _ in range(4)]  # param, grad, moments: unread here
    group_and_step = [(0, 1), (1, 1), (0, 7), (1, 1000), (0, 7)]
    units = [KernelUnit(*zeros, None, torch.tensor(float(s), device=device), g) for g, s in group_and_step]
    cpu_units = [KernelUnit(*(z.cpu() for z in zeros), None, u.step.cpu(), u.group) for u in units]
    cpu_groups = [{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in g.items()} for g in groups]
    fast = coefficients(cpu_units, cpu_groups)
    assert fast.dtype == torch.float32 and fast.shape == (5, len(COEFFICIENTS))
    on_device = coefficients_on_device(units, groups)
    assert on_device.device.type == device
    torch.testing.assert_close(fast, on_device.cpu(), rtol=2**-23, atol=0)
    step_size = fast[:, COEFFICIENTS.index("step_size")]
    assert step_size[0].item() == pytest.approx(1e-3 / (1 - 0.9), rel=1e-7)  # torch's first-step size
    assert torch.equal(fast[2], fast[4])  # same group and step: same row


def test_a_loaded_state_dict_is_what_the_next_compiled_step_updates() -> None:
    # The step reuses its moment views between steps; after load_state_dict (new moment tensors) it must
    # update the loaded ones: redoing steps from a saved state gives the same masters as the first time.
    _, ours, half = _pair("adamw", weight_decay=0.1)

    def run(steps: range) -> None:
        for step in steps:
            for p, g in zip(half, _grads(step, torch.bfloat16), strict=True):
                p.grad = g
            ours.step()

    run(range(2))
    saved = copy.deepcopy(ours.state_dict())
    run(range(2, 4))
    first = [m.clone() for m in ours.master_views()]
    ours.load_state_dict(saved)
    run(range(2, 4))
    for want, got in zip(first, ours.master_views(), strict=True):
        assert torch.equal(got, want)
    assert [float(s["step"]) for s in ours.state.values()] == [4.0] * len(SHAPES)


def test_a_moment_moved_to_new_memory_under_the_same_tensor_is_the_one_updated() -> None:
    # `state["exp_avg"].data = ...` (how state is often moved between devices) keeps the tensor and changes
    # its memory: the step must update the new memory, as torch's AdamW does.
    reference, ours, half = _pair("adamw", weight_decay=0.1)
    for step in range(4):
        grads = _grads(step, torch.bfloat16)
        for p, q, g in zip(reference.param_groups[0]["params"], half, grads, strict=True):
            p.grad, q.grad = g.float(), g
        reference.step()
        ours.step()
        if step == 1:
            for state in ours.state.values():
                state["exp_avg"].data = state["exp_avg"].data.clone()
                state["exp_avg_sq"].set_(state["exp_avg_sq"].clone())
    for want, got in zip(reference.state.values(), ours.state.values(), strict=True):
        torch.testing.assert_close(got["exp_avg"], want["exp_avg"], rtol=0, atol=TOL)
    for want, got in zip(reference.param_groups[0]["params"], ours.master_views(), strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=TOL)


@pytest.mark.parametrize(("kind", "decay"), [("adamw", 0.1), ("adam", 0.05)])
def test_flat_masters_and_groups_of_other_decay_equal_the_uncompiled_step(kind: str, decay: float) -> None:
    # Reference: the same wrapper without compile_step (torch's fused kernel, chunk by chunk). One flat
    # buffer per group, so units of a graph are slices of one tensor; a group without decay beside one
    # with it puts both write paths of the pass (one copy, separate copies for L2) in one graph.
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    g = torch.Generator().manual_seed(1)
    fp32 = [torch.randn(s, generator=g) for s in SHAPES * 2]
    runs = []
    for compiled in (False, True):
        half = [torch.nn.Parameter(p.to(torch.bfloat16)) for p in fp32]
        groups = [{"params": half[:3], "weight_decay": decay}, {"params": half[3:], "weight_decay": 0.0}]
        opt = MasterWeights(cls(groups, lr=1e-2), flat=True, master_grads=False, compile_step=compiled,
                            initial=dict(zip(half, fp32, strict=True)))
        for step in range(3):
            for p, grad in zip(half, _grads(step, torch.bfloat16) * 2, strict=True):
                p.grad = grad
            opt.step()
        runs.append((list(opt.master_views()), half))
    (want, _), (got, half) = runs
    for w, m, model in zip(want, got, half, strict=True):
        torch.testing.assert_close(m, w, rtol=0, atol=TOL)
        assert torch.equal(model.detach(), m.to(torch.bfloat16))


@pytest.mark.parametrize("flat", [False, True])
def test_what_the_compiled_step_keeps_between_steps_follows_new_gradients_and_new_groups(flat: bool) -> None:
    # The compiled step keeps its per-tensor views from step to step (master_fused._Slot). Reference: the
    # same wrapper without compile_step. Step 0: one parameter has no gradient (no state, no update);
    # step 1: it has one (its state appears); step 2: a param group added after two steps joins.
    g = torch.Generator().manual_seed(2)
    fp32 = [torch.randn(s, generator=g) for s in SHAPES * 2]
    runs = []
    for compiled in (False, True):
        half = [torch.nn.Parameter(p.to(torch.bfloat16)) for p in fp32]
        initial = dict(zip(half, fp32, strict=True))
        opt = MasterWeights(torch.optim.AdamW(half[:3], lr=1e-2, weight_decay=0.1), flat=flat,
                            master_grads=False, compile_step=compiled, initial=initial)
        for step in range(4):
            if step == 2:
                opt.add_param_group({"params": half[3:], "weight_decay": 0.0})
            live = half if step >= 2 else half[:3]
            for i, (p, grad) in enumerate(zip(live, _grads(step, torch.bfloat16) * 2, strict=False)):
                p.grad = None if (step == 0 and i == 1) else grad
            opt.step()
        runs.append(([m.detach().clone() for m in opt.master_views()], half, opt))
    (want, _, ref), (got, half, ours) = runs
    for w, m, model in zip(want, got, half, strict=True):
        torch.testing.assert_close(m, w, rtol=0, atol=TOL)
        assert torch.equal(model.detach(), m.to(torch.bfloat16))
    steps = sorted(float(s["step"]) for s in ours.state.values())
    assert steps == sorted(float(s["step"]) for s in ref.state.values())


def test_a_model_parameter_given_new_memory_between_steps_is_the_one_updated() -> None:
    # `p.data = ...` (as some wrappers do) moves a parameter: the kept aliases must follow it.
    reference, ours, half = _pair("adamw", weight_decay=0.1)
    for step in range(3):
        grads = _grads(step, torch.bfloat16)
        for p, g in zip(reference.param_groups[0]["params"], grads, strict=True):
            p.grad = g.float()
        for p, g in zip(half, grads, strict=True):
            p.grad = g
        if step == 2:
            half[0].data = half[0].data.clone()  # same values, new memory
        reference.step()
        ours.step()
    for want, got, model in zip(reference.param_groups[0]["params"], ours.master_views(), half, strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=TOL)
        assert torch.equal(model.detach(), got.to(torch.bfloat16))  # the moved parameter too


def test_a_master_given_new_memory_between_steps_is_the_one_updated() -> None:
    # Reference: the uncompiled step, from the same start and with the same edit of the master.
    g = torch.Generator().manual_seed(3)
    fp32 = [torch.randn(s, generator=g) for s in SHAPES]
    runs = []
    for compiled in (False, True):
        half = [torch.nn.Parameter(p.to(torch.bfloat16)) for p in fp32]
        opt = MasterWeights(torch.optim.AdamW(half, lr=1e-2), master_grads=False, compile_step=compiled,
                            initial=dict(zip(half, fp32, strict=True)))
        for step in range(3):
            for p, grad in zip(half, _grads(step, torch.bfloat16), strict=True):
                p.grad = grad
            if step == 2:
                master = next(iter(opt.master_views()))
                master.data = master.data.clone() + 1  # new memory, new values
            opt.step()
        runs.append([m.detach().clone() for m in opt.master_views()])
    for want, got in zip(*runs, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_the_moments_of_a_parameter_without_gradients_are_not_kept_alive() -> None:
    # Fine-tuning: freeze a parameter and drop its optimizer state; the step must not hold its moments.
    _, ours, half = _pair("adamw")
    for p, grad in zip(half, _grads(0, torch.bfloat16), strict=True):
        p.grad = grad
    ours.step()
    frozen = next(iter(ours.master_views()))
    moments = [weakref.ref(ours.state[frozen][k]) for k in ("exp_avg", "exp_avg_sq")]
    del ours.state[frozen]
    half[0].grad = None
    for step in (1, 2):
        for p, grad in zip(half[1:], _grads(step, torch.bfloat16)[1:], strict=True):
            p.grad = grad
        ours.step()
    gc.collect()
    assert [m() is None for m in moments] == [True, True]


def test_a_step_pickled_before_the_kept_slots_still_steps() -> None:
    # A MasterWeights saved (torch.save/pickle) by the version that cached moment views in `_views`.
    reference, ours, half = _pair("adamw", weight_decay=0.1)
    old_state = {k: v for k, v in ours._fused_step.__getstate__().items()}
    old_state["_views"] = {}
    revived = FusedMasterStep.__new__(FusedMasterStep)
    revived.__setstate__(old_state)
    ours._fused_step = revived
    grads = _grads(0, torch.bfloat16)
    for p, g in zip(reference.param_groups[0]["params"], grads, strict=True):
        p.grad = g.float()
    for p, g in zip(half, grads, strict=True):
        p.grad = g
    reference.step()
    ours.step()
    for want, got in zip(reference.param_groups[0]["params"], ours.master_views(), strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=TOL)


def test_importing_mixprec_leaves_inductor_unloaded_and_passes_deprecations_as_errors() -> None:
    """A user trial: `import mixprec` compiled the pass at import, which loaded Inductor (~1 s of every
    import) and, through it, a torch module whose DeprecationWarning failed `python -W error`."""
    code = "import sys, mixprec; assert 'torch._inductor.lowering' not in sys.modules, 'Inductor loaded'"
    run = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code],
                         capture_output=True, text=True, cwd=Path(mixprec.__file__).parents[1])
    assert run.returncode == 0, run.stderr[-2000:]
