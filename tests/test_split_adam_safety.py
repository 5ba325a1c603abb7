"""The native split Adam step (mixprec/split_adam.py) against what users do to parameters, state and the
wrapper between steps: it must follow every move of memory, refuse what it cannot step, and give torch's
numbers (the generic step's) where it steps. Found by a review of its first version, where each of these
failed. Cases that corrupted memory then run in a child process, so that a regression fails as an
assertion here rather than crashing pytest."""

from __future__ import annotations

import copy
import io
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec import split_adam
from mixprec.low_precision import LowPrecisionOptimizer
from mixprec.split_adam import library_error

pytestmark = pytest.mark.skipif(library_error() is not None, reason=f"no native step: {library_error()}")

BF16 = torch.bfloat16
ROOT = Path(__file__).resolve().parents[1]


def _params(shapes=((300, 200), (200,)), seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).to(BF16)) for s in shapes]


def _grads(ps, seed: int) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(BF16)


def _child(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=300)


# ------------------------------------------------------------------ stale raw pointers
def test_a_pickled_wrapper_steps_its_own_tensors_not_the_originals() -> None:
    """torch.save(opt) / torch.load: the plan's pointer tables travel in the pickle and still match
    (the loaded parameters and the plan's held aliases share storage), so the copy writes into the
    original's memory."""
    ps = _params()
    opt = LowPrecisionOptimizer(torch.optim.AdamW(ps, lr=1e-2), "split")
    _grads(ps, 0)
    opt.step()
    before = [p.detach().clone() for p in ps]
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    mine = [p for g in loaded.param_groups for p in g["params"]]
    _grads(mine, 1)
    loaded.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before, strict=True)), "the original was written"
    assert not any(torch.equal(p, b) for p, b in zip(mine, before, strict=True)), "the copy was not stepped"


def test_a_pickled_wrapper_resumes_in_a_new_process() -> None:
    save = _child("""
        import torch
        from torch import nn
        from mixprec.low_precision import LowPrecisionOptimizer
        p = nn.Parameter(torch.randn(1000, 1000).bfloat16())
        opt = LowPrecisionOptimizer(torch.optim.AdamW([p], lr=1e-2), "split")
        p.grad = torch.randn(1000, 1000).bfloat16(); opt.step()
        torch.save(opt, "OPT")
    """.replace("OPT", str(Path(os.environ.get("TMPDIR", "/tmp")) / f"mixprec-review-{os.getpid()}.pt")))
    assert save.returncode == 0, save.stderr
    load = _child("""
        import torch
        opt = torch.load("OPT", weights_only=False)
        p = opt.param_groups[0]["params"][0]; before = p.detach().clone()
        p.grad = torch.randn(1000, 1000).bfloat16(); opt.step()
        print("stepped", not torch.equal(p, before))
    """.replace("OPT", str(Path(os.environ.get("TMPDIR", "/tmp")) / f"mixprec-review-{os.getpid()}.pt")))
    assert load.returncode == 0, f"child died with {load.returncode}: {load.stderr[-500:]}"
    assert "stepped True" in load.stdout


def test_deepcopy_with_plain_tensor_parameters_steps_the_copy() -> None:
    """Leaf tensors (not nn.Parameter) deepcopy with shared storage, so the copied plan looks current."""
    ps = [torch.randn(300, 200).to(BF16).requires_grad_()]
    opt = LowPrecisionOptimizer(torch.optim.AdamW(ps, lr=1e-2), "split")
    _grads(ps, 0)
    opt.step()
    before = ps[0].detach().clone()
    clone = copy.deepcopy(opt)
    c = clone.param_groups[0]["params"][0]
    _grads([c], 1)
    clone.step()
    assert torch.equal(ps[0], before), "the copy's step wrote into the original"
    assert not torch.equal(c, before)


def test_state_whose_storage_is_replaced_in_place_is_followed() -> None:
    """exp_avg.data = ... (pinning, offloading) keeps the tensor object, frees the old storage: the plan
    (checked by identity) writes into freed memory."""
    r = _child("""
        import torch
        from torch import nn
        from mixprec.low_precision import LowPrecisionOptimizer
        model = nn.Linear(1000, 1000).to(torch.bfloat16)
        opt = LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), "split")
        x = torch.randn(8, 1000, dtype=torch.bfloat16)
        model(x).sum().backward(); opt.step()
        for st in opt.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                st[k].data = st[k].data.clone()
        before = opt.state[model.weight]["exp_avg"].clone()
        opt.zero_grad(); model(x).sum().backward(); opt.step()
        print("updated", not torch.equal(before, opt.state[model.weight]["exp_avg"]))
    """)
    assert r.returncode == 0, f"child died with {r.returncode}: {r.stderr[-500:]}"
    assert "updated True" in r.stdout


def test_model_share_memory_after_a_step_is_followed() -> None:
    """model.share_memory() (Hogwild) swaps each parameter's storage in place: p and the plan's alias of
    p.data both report the new pointer, the table still holds the old, freed one."""
    r = _child("""
        import torch
        from torch import nn
        from mixprec.low_precision import LowPrecisionOptimizer
        model = nn.Linear(1000, 1000).to(torch.bfloat16)
        opt = LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), "split")
        x = torch.randn(8, 1000, dtype=torch.bfloat16)
        model(x).sum().backward(); opt.step()
        model.share_memory()
        before = model.weight.detach().clone()
        opt.zero_grad(); model(x).sum().backward(); opt.step()
        print("updated", not torch.equal(before, model.weight))
    """)
    assert r.returncode == 0, f"child died with {r.returncode}: {r.stderr[-500:]}"
    assert "updated True" in r.stdout


# ------------------------------------------------------------------ unchecked sizes and dtypes
def test_a_grown_parameter_raises_instead_of_writing_past_its_buffers() -> None:
    """p.data = a bigger tensor: the generic step raises (size mismatch); the native one runs its loop over
    the new numel through the old low half and moments (heap overflow)."""
    r = _child("""
        import torch
        from torch import nn
        from mixprec.low_precision import LowPrecisionOptimizer
        emb = nn.Embedding(1000, 64).to(torch.bfloat16)
        opt = LowPrecisionOptimizer(torch.optim.AdamW(emb.parameters(), lr=1e-2), "split")
        emb(torch.arange(10)).sum().backward(); opt.step()
        with torch.no_grad():
            emb.weight.data = torch.cat([emb.weight.data, torch.zeros(1000, 64, dtype=torch.bfloat16)])
        opt.zero_grad(); emb(torch.arange(1990, 2000)).sum().backward()
        try:
            opt.step()
            print("ran")
        except Exception as e:
            print("raised", type(e).__name__)
    """)
    assert r.returncode == 0, f"child died with {r.returncode}: {r.stderr[-500:]}"
    assert "raised" in r.stdout


def test_a_parameter_cast_to_fp32_is_refused_not_stepped_as_bf16_bits() -> None:
    """model.float() after wrapping: the generic step raises; the native one reads the fp32 weights and
    grads as bf16/int16 pairs over the first half of their bytes and silently scrambles the weights."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64).to(BF16)
    opt = LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), "split")
    x = torch.randn(8, 64)
    model(x.to(BF16)).sum().backward()
    opt.step()
    model.float()
    opt.zero_grad()
    model(x).sum().backward()
    with pytest.raises(Exception):  # noqa: B017 - any refusal; the generic step's RuntimeError would do
        opt.step()


# ------------------------------------------------------------------ numbers that are not torch's
@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2), weight_decay=0.1),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.999))),
], ids=["tensor lr", "tensor betas"])
def test_tensor_hyperparameters_give_torchs_numbers(make, exact_sqrt: None) -> None:
    """torch keeps a Tensor lr/beta a 0-dim fp32 tensor (_to_scalar), so its step size, decay factor and
    bias corrections are fp32 tensor arithmetic; the native step computes them in fp64 from .item()."""
    half = _params()
    ref = [nn.Parameter(p.detach().float()) for p in half]
    opt, ref_opt = LowPrecisionOptimizer(make(half), "split"), make(ref)
    for i in range(6):
        _grads(half, i)
        for h, r in zip(half, ref, strict=True):
            r.grad = h.grad.float()
        opt.step()
        ref_opt.step()
    for m, r in zip(opt.master_values(), ref, strict=True):
        assert torch.equal(m.view(torch.int32), r.detach().view(torch.int32))


def _native_vs_generic(build, between=None, steps: int = 4, exact=True):
    out = []
    for kernel in ("auto", "generic"):
        ps = _params(((300, 200), (200,), (5,)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = LowPrecisionOptimizer(build(ps), "split", kernel=kernel)
        for i in range(steps):
            _grads(ps, i)
            if between is not None:
                between(opt, ps, i)
            opt.step()
        out.append((opt.master_values(), [opt.state[p]["step"].item() for p in ps]))
    (a, sa), (b, sb) = out
    assert sa == sb
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_replaced_step_count_is_used(exact_sqrt: None) -> None:
    """state['step'] = torch.tensor(0.) (restarting bias correction): the plan keeps incrementing the old
    tensor (current() checks the moments' identity, not the step's)."""
    def reset(opt, ps, i):
        if i == 2:
            for p in ps:
                opt.state[p]["step"] = torch.tensor(0.0)
    _native_vs_generic(lambda ps: torch.optim.AdamW(ps, lr=1e-2), reset)


def test_a_parameter_moved_to_another_group_takes_that_groups_settings(exact_sqrt: None) -> None:
    """The plan is reused when the parameters are the same objects in the same order, even if their group
    indices changed: b keeps group 1's lr after moving into group 0."""
    def merge(opt, ps, i):
        if i == 2:
            a, b = opt.param_groups
            a["params"] = a["params"] + b["params"]
            b["params"] = []
    _native_vs_generic(lambda ps: torch.optim.AdamW([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.1}],
                                                    lr=1e-2), merge)


def test_a_parameter_listed_twice_steps_like_torch(exact_sqrt: None) -> None:
    """torch (and the generic step) steps a duplicated parameter twice, with step counts t+1 then t+2; the
    native step adds 2 to the shared step tensor first and runs both updates with t+2."""
    _native_vs_generic(lambda ps: torch.optim.AdamW(ps + ps[:1], lr=1e-2))


# ------------------------------------------------------------------ silent fallbacks
def test_channels_last_weights_keep_the_native_step(exact_sqrt: None) -> None:
    """A channels_last conv weight is dense (its grad, moments and low half have its strides): stepped
    natively, with the generic step's numbers (an early version sent the whole model to the generic step,
    10x+ slower, without a word)."""
    results = []
    for kernel in ("native", "generic"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.Flatten(), nn.Linear(16 * 30 * 30, 10)).to(BF16)
        model = model.to(memory_format=torch.channels_last)
        opt = LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), "split", kernel=kernel)
        x = torch.randn(2, 3, 32, 32, dtype=BF16).to(memory_format=torch.channels_last)
        for _ in range(2):
            opt.zero_grad()
            model(x).float().square().mean().backward()
            opt.step()
        results.append(opt.master_values())
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_cc_with_arguments_builds(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """$CC is commonly a command line ("ccache gcc", "gcc -m64"); it is run as one program name, fails,
    and kernel='auto' silently steps generically."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None
    monkeypatch.setattr(split_adam, "_LIBRARY", {})
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", f"{cc} -m64")
    assert library_error() is None


def test_a_scheduler_on_the_wrapped_optimizer_sees_its_step() -> None:
    """The native step never calls inner.step(): an LR scheduler made on the optimizer before wrapping
    (its step tracked by torch) warns that scheduler.step() came before optimizer.step()."""
    ps = _params(((10,),))
    inner = torch.optim.AdamW(ps, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(inner, 1)
    opt = LowPrecisionOptimizer(inner, "split")
    _grads(ps, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
        sched.step()
