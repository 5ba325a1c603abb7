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

from mixprec import native, split_adam
from mixprec.errors import ConfigError
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
    monkeypatch.setattr(native, "_LIBRARY", {})
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


# ================================================================== a second review's cases
def _train(model: nn.Module, opt: LowPrecisionOptimizer, x: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


def _generic_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "steps generically" in str(w.message)]


# ------------------------------------------------------------------ 1. zeros written into trained weights
@pytest.mark.parametrize("kernel", ["native", "generic"])
def test_a_weight_zeroed_after_training_keeps_a_finite_master_and_trains(kernel: str) -> None:
    """nn.init.zeros_ (re-initialising a layer), masking/pruning, or loading a checkpoint with zero biases
    writes bf16 +0.0 over a weight whose low half is negative (about half of them after any step).
    0x0000 << 16 plus a negative low half wraps to 0xFFFFxxxx: a NaN master. The next step splits that NaN
    into high 0x0000, low -0x8000 again, so the weight shows 0.0 forever (frozen, silently) while
    master_values() -- the docs' "fp32 weights at the end" -- holds NaN."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64).to(BF16)
    opt = LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), "split", kernel=kernel)
    x = torch.randn(8, 64, dtype=BF16)
    _train(model, opt, x, 3)
    assert (opt.extra_tensors()[1] < 0).any()  # the precondition: some negative low halves
    nn.init.zeros_(model.bias)
    assert not opt.master_values()[1].isnan().any(), "zeroed weights read back as NaN masters"
    _train(model, opt, x, 10)
    assert (model.bias != 0).all(), "zeroed weights never move again"


def test_loading_model_weights_keeps_each_master_within_half_a_bf16_spacing() -> None:
    """docs/low-precision.md: 'Loading only the model's weights later keeps the old low halves: each master
    is then within half a bf16 spacing of the loaded value' -- loaded zeros included (they read as NaN
    masters before)."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64).to(BF16)
    opt = LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), "split")
    x = torch.randn(8, 64, dtype=BF16)
    _train(model, opt, x, 3)
    loaded = {k: v.clone() for k, v in model.state_dict().items()}
    loaded["bias"][::2] = 0  # a checkpoint with some zero biases
    model.load_state_dict(loaded)
    for master, value in zip(opt.master_values(), [loaded["weight"], loaded["bias"]], strict=True):
        spacing = (value.float().abs() * 2**-7).clamp_min(2**-133)  # bf16 spacing below |value|, at least
        assert ((master - value.float()).abs() <= spacing).all()


# ------------------------------------------------------------------ 2. torch.compile
def test_a_compiled_step_runs_the_native_pass_without_a_false_reason() -> None:
    """torch.compile(train_step) with opt.step() inside: Dynamo presents param_groups with capturable=True
    while it traces an optimizer (torch/_dynamo/variables/optimizer.py, _set_capturable), so the native
    step is refused 'because the optimizer has capturable=True' -- a setting the user never made -- and the
    compiled generic step runs: several times slower, other numbers (hundreds of ulps from eager)."""
    def run(compiled: bool) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        ps = [nn.Parameter(torch.randn(64, 32, generator=g).to(BF16)),
              nn.Parameter(torch.randn(64, generator=g).to(BF16))]
        opt = LowPrecisionOptimizer(torch.optim.AdamW(ps, lr=1e-2), "split")

        def step() -> None:
            opt.step()

        f = torch.compile(step) if compiled else step
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(3):
                gg = torch.Generator().manual_seed(10 + i)
                for p in ps:
                    p.grad = torch.randn(p.shape, generator=gg).to(BF16)
                f()
        assert _generic_warnings(caught) == [], _generic_warnings(caught)
        return opt.master_values()

    torch._dynamo.reset()
    eager, compiled = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))


# ------------------------------------------------------------------ 3. the fallback warning's location
def test_the_fallback_warning_points_at_the_callers_line() -> None:
    """stacklevel=3 counts _native_applies, step, and then lands in torch/utils/_contextlib.py (the
    no_grad decorator) -- below it is torch's step wrapper, then the user's line."""
    p = nn.Parameter(torch.randn(10).to(BF16))
    opt = LowPrecisionOptimizer(torch.optim.AdamW([p], amsgrad=True), "split")
    p.grad = torch.randn(10).to(BF16)
    with pytest.warns(UserWarning, match="steps generically") as record:
        opt.step()
    assert [w.filename for w in record if "steps generically" in str(w.message)] == [__file__]


# ------------------------------------------------------------------ 4. layouts refused for no reason
def test_a_gradient_whose_strides_differ_only_in_size_one_dims_steps_natively() -> None:
    """_grad_reason compares every stride, but the stride of a size-1 dim is meaningless (_dense ignores
    it, and torch's AccumulateGrad keeps such a gradient as autograd made it). A (64, 1) weight used
    transposed gets a grad with strides (1, 64) against its (1, 1): the whole model steps generically."""
    w = nn.Parameter(torch.randn(64, 1).to(BF16))
    (w.t() * torch.randn(8, 64, dtype=BF16)).float().sum().backward()
    assert w.grad is not None and w.grad.stride() != w.stride()  # as autograd made it
    opt = LowPrecisionOptimizer(torch.optim.AdamW([w], lr=1e-2), "split", kernel="native")
    opt.step()  # ConfigError: "the gradient of a parameter of shape (64, 1) is not bf16 laid out as it"


def test_a_zero_element_parameter_does_not_send_the_model_to_the_generic_step() -> None:
    """nn.Linear(0, 8) (a feature group of size 0) has an (8, 0) weight with strides (1, 1): _dense says
    'not dense' (a size-0 dim's stride is meaningless too), and every parameter steps generically."""
    empty = nn.Linear(0, 8).to(BF16)
    dense = nn.Linear(16, 8).to(BF16)
    ps = list(empty.parameters()) + list(dense.parameters())
    for p in ps:
        p.grad = torch.ones_like(p)
    LowPrecisionOptimizer(torch.optim.AdamW(ps, lr=1e-2), "split", kernel="native").step()


def test_channels_last_after_wrapping_steps_natively() -> None:
    """model.to(memory_format=torch.channels_last) after the wrapper was built: p.data is replaced by a
    channels_last copy, the low half (made with the old layout) no longer has p's strides, and the native
    step is refused for good ('was it replaced after wrapping?'). The values are right -- only the memory
    order differs -- so the plan could lay the low half (and moments) out like p once, instead."""
    torch.manual_seed(0)
    model = nn.Conv2d(3, 8, 3).to(BF16)
    opt = LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), "split", kernel="native")
    model.to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8, dtype=BF16).to(memory_format=torch.channels_last)
    _train(model, opt, x, 2)  # ConfigError


def test_a_checkpoint_of_generic_steps_resumes_natively_for_channels_last_weights() -> None:
    """The generic step lends torch contiguous fp32 views, so the moments torch makes there are contiguous
    even for a channels_last weight. A run begun generically (kernel='generic', a machine without a C
    compiler, one step under a hook) and resumed where the native step runs is refused for good: 'the Adam
    state ... is not fp32 of its shape and layout'."""
    torch.manual_seed(0)
    model = nn.Conv2d(3, 8, 3).to(BF16).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8, dtype=BF16).to(memory_format=torch.channels_last)
    first = LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), "split", kernel="generic")
    _train(model, first, x, 1)
    resumed = LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), "split", kernel="native")
    resumed.load_state_dict(first.state_dict())
    _train(model, resumed, x, 1)  # ConfigError


# ------------------------------------------------------------------ 5. a step count torch accepts
def test_an_integer_step_count_is_stepped_as_torch_steps_it() -> None:
    """opt.state[p]['step'] = torch.tensor(0) (restarting bias correction): torch's AdamW and the generic
    step accept an int64 count; the native step passes the checks and then raises in
    torch._foreach_add_(steps, 1.0): 'result type Float can't be cast to the desired output type Long'."""
    p = nn.Parameter(torch.randn(100).to(BF16))
    opt = LowPrecisionOptimizer(torch.optim.AdamW([p], lr=1e-2), "split")
    p.grad = torch.randn(100).to(BF16)
    opt.step()
    opt.state[p]["step"] = torch.tensor(0)
    opt.step()
    assert opt.state[p]["step"].item() == 1


# ------------------------------------------------------------------ 6. an unwritable cache
def test_an_unusable_cache_dir_is_named_with_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A read-only or uncreatable cache ($HOME read-only in a container, a shared cache) falls back with
    '[Errno 30] Read-only file system: '/path/tmpab12cd'' as the reason: a temporary name, no word that
    it is the build cache or that MIXPREC_CACHE_DIR moves it. (Root ignores chmod 555; a path under a
    regular file fails for root too.)"""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(native, "_LIBRARY", {})
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(blocker / "cache"))
    error = library_error()
    assert error is None or "MIXPREC_CACHE_DIR" in error, error


# ------------------------------------------------------------------ 7. gradients freed during the loop
def test_gradients_dropped_by_another_thread_during_the_step_are_not_read_after_free() -> None:
    """step() passes raw gradient pointers to ctypes, which releases the GIL, and holds no reference to the
    gradients (the list given to _pointers is a temporary). zero_grad(set_to_none=True) from another thread
    while the loop runs frees them (large blocks are unmapped): a segfault. torch's own fused AdamW, whose
    kernel holds its tensor arguments, survives the same race. Then the step read each gradient twice
    (checking, then pointing at it): one gone in between raised AttributeError mid-step, and torch's
    garbage collection of that traceback's tensors aborted (an internal assert) or left a segfault for
    later: this test failed in about half its runs."""
    code = textwrap.dedent("""
        import threading, time, torch
        from torch import nn
        from mixprec.low_precision import LowPrecisionOptimizer
        ps = [nn.Parameter(torch.randn(4096, 4096).to(torch.bfloat16)) for _ in range(2)]
        opt = LowPrecisionOptimizer(torch.optim.AdamW(ps), "split", kernel="native")
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
        for _ in range(12):
            for p in ps:
                p.grad = torch.randn_like(p)
            t = threading.Thread(target=opt.step)
            t.start()
            # during the loop, after the step read the gradients: a zero_grad racing those reads would be
            # a race on .grad inside torch itself (its fused AdamW crashes there too)
            time.sleep(0.003)
            opt.zero_grad(set_to_none=True)
            t.join()
        print("survived")
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and "survived" in run.stdout, f"child died with {run.returncode}"


# ================================================================== a third review's cases
# ------------------------------------------------------------------ a gradient of another shape
def test_a_gradient_resized_to_another_shape_with_the_same_strides_is_refused() -> None:
    """resize_ keeps the storage (so the read stays in bounds here), but the loop steps rows 1-2 with
    stale memory instead of refusing: the (1, 3) gradient has the (3, 3) parameter's strides (3, 1)."""
    p = nn.Parameter(torch.randn(3, 3).to(BF16))
    opt = LowPrecisionOptimizer(torch.optim.AdamW([p], lr=1e-2), "split", kernel="native")
    p.grad = torch.ones(3, 3, dtype=BF16)
    opt.step()
    p.grad.resize_(1, 3)
    assert p.grad.shape != p.shape and p.grad.stride() == p.stride()
    with pytest.raises(ConfigError, match="gradient"):
        opt.step()


def test_a_gradient_replaced_by_a_smaller_tensor_is_not_read_past_its_end() -> None:
    """p.grad.data = a (1, 4096) tensor (the setter checks shapes, .data does not): the loop reads 16M
    elements from a 4096-element buffer -- a segfault. Run in a child so a regression fails here."""
    code = textwrap.dedent("""
        import torch
        from torch import nn
        from mixprec.errors import ConfigError
        from mixprec.low_precision import LowPrecisionOptimizer
        p = nn.Parameter(torch.zeros(4096, 4096).to(torch.bfloat16))
        opt = LowPrecisionOptimizer(torch.optim.AdamW([p], lr=1e-2), "split", kernel="native")
        p.grad = torch.zeros_like(p)
        opt.step()
        p.grad.data = torch.zeros(1, 4096, dtype=torch.bfloat16)
        try:
            opt.step()
            print("stepped")
        except ConfigError:
            print("refused")
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and "refused" in run.stdout, (run.returncode, run.stdout, run.stderr[-500:])


# ------------------------------------------------------------------ the warning's frame
def _prefixes() -> list[str]:
    return [str(ROOT / "mixprec_experiments" / "train.py"),  # a user's sibling of the package directory
            str(Path(torch.__file__).parent) + "vision_user_train.py"]  # '<site-packages>/torchvision...'


@pytest.mark.parametrize("filename", _prefixes(), ids=["mixprec-prefix", "torch-prefix"])
def test_the_fallback_warning_points_at_a_user_file_whose_path_extends_a_package_path(filename: str) -> None:
    p = nn.Parameter(torch.randn(10).to(BF16))
    opt = LowPrecisionOptimizer(torch.optim.AdamW([p], amsgrad=True), "split")
    p.grad = torch.randn(10).to(BF16)
    # user code as if it lived in `filename` (no file is written: the frame's co_filename is what counts)
    code = compile("def train(opt):\n    opt.step()\n", filename, "exec")
    scope: dict = {}
    exec(code, scope)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        scope["train"](opt)
    assert [w.filename for w in record if "steps generically" in str(w.message)] == [filename]


# ------------------------------------------------------------------ the documented zero rule
@pytest.mark.parametrize("kernel", ["native", "generic"])
def test_a_zero_written_over_a_trained_weight_reads_as_zero_or_a_subnormal(kernel: str) -> None:
    """docs/low-precision.md, Resuming: '(a zero written over a weight reads as 0 or a subnormal below
    2**-133)': a stale non-negative low half is kept under a zero high half (a review found the docs'
    first wording, 'exactly zero', untrue)."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 64).to(BF16)
    opt = LowPrecisionOptimizer(torch.optim.AdamW(lin.parameters(), lr=1e-3), "split", kernel=kernel)
    for _ in range(3):
        lin(torch.randn(8, 64, dtype=BF16)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    nn.init.zeros_(lin.weight)
    master = opt.master_values()[0]
    assert (master.abs() < 2.0**-133).all() and not master.isnan().any()
    assert (master == 0).any()


# ================================================================== a fourth review's cases: the build
_OPENMP = pytest.mark.skipif(
    library_error() is not None or "OpenMP threads" not in split_adam.library_threads(),
    reason="needs a native build with OpenMP on this machine",
)


def _wrapper(tmp_path: Path, body: str) -> Path:
    """A compiler wrapper around the real cc: `body` runs first (sh, with the arguments in "$@")."""
    real = shutil.which("cc") or shutil.which("gcc")
    assert real is not None
    cc = tmp_path / "wrapped-cc"
    cc.write_text(f"#!/bin/sh\n{body}\nexec {real} \"$@\"\n")
    cc.chmod(0o755)
    return cc


def _fresh(monkeypatch: pytest.MonkeyPatch, cache: Path, cc: Path) -> None:
    """As a new process would start: no library loaded, this cache, this compiler."""
    monkeypatch.setattr(native, "_LIBRARY", {})
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(cache))
    monkeypatch.setenv("CC", str(cc))


@_OPENMP
def test_a_compiler_with_openmp_but_without_march_native_keeps_openmp(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """gcc/clang on POWER (and other compilers that do not know -march=native) have OpenMP: dropping
    -march=native must not drop the threads too, and `mixprec info` must not say there is no OpenMP (a
    first version went omp+native -> serial+native -> portable)."""
    cc = _wrapper(tmp_path, 'for a in "$@"; do [ "$a" = -march=native ] && exit 1; done')
    _fresh(monkeypatch, tmp_path / "cache", cc)
    assert split_adam.library_error() is None
    threads = split_adam.library_threads()
    assert "no OpenMP" not in threads, threads
    assert "OpenMP threads" in threads, threads


@_OPENMP
def test_a_transient_openmp_build_failure_is_not_cached_as_one_thread_forever(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The first OpenMP compile is killed (OOM killer, ^C of a parallel build): the fallback is built and
    cached, and every later process with the same, healthy compiler found the serial file first and never
    tried OpenMP again, in a first version (now a killed compile caches nothing)."""
    flag = tmp_path / "killed-once"
    kill_once = f'[ -e {flag} ] || {{ touch {flag}; kill -KILL $$; }}'
    cc = _wrapper(tmp_path, f'case " $* " in *" -fopenmp "*) {kill_once};; esac')
    cache = tmp_path / "cache"
    _fresh(monkeypatch, cache, cc)
    split_adam.library_error()  # this process may fall back (or fail), as long as nothing degraded is cached
    assert flag.exists()  # the OpenMP compile was killed once
    first = split_adam.library_threads()
    _fresh(monkeypatch, cache, cc)  # a later process: the compiler now builds OpenMP fine
    assert split_adam.library_error() is None
    later = split_adam.library_threads()
    assert "OpenMP threads" in later, (first, later, sorted(p.name for p in cache.iterdir()))


@_OPENMP
def test_the_picky_compiler_test_leaves_the_normal_library_in_place() -> None:
    """After the tests above swapped _LIBRARY and $CC, the process's library is the normal (OpenMP) one."""
    assert split_adam.library_error() is None
    assert "OpenMP threads" in split_adam.library_threads()
