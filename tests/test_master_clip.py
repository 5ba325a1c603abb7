"""Gradient clipping under MasterWeights, against the same clip in fp32: torch.amp's recipe
(``scaler.unscale_(opt)``, ``clip_grad_norm_(model.parameters())``, ``scaler.step(opt)``) and the wrapper's
own ``clip_grad_norm_``. The reference steps the fp32 model with the unscaled half gradients, upcast."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mixprec.master import MasterWeights, fp32_originals, model_to_half
from mixprec.scaler import GradScaler

MAX_NORM = 0.05  # far below this model's gradient norm (~1): every step is clipped hard
SCALE = 2.0**10


Setup = tuple[nn.Module, nn.Module, MasterWeights, torch.optim.Optimizer]


def _setup(flat: bool, dtype: torch.dtype) -> Setup:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    half = copy.deepcopy(ref)
    converted = model_to_half(half, dtype)
    initial = fp32_originals(converted)
    opt = MasterWeights(torch.optim.SGD(half.parameters(), lr=0.5), flat=flat, initial=initial)
    return ref, half, opt, torch.optim.SGD(ref.parameters(), lr=0.5)


def _train(flat: bool, dtype: torch.dtype, clip: str, scale: float = SCALE
           ) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
    ref, half, opt, plain = _setup(flat, dtype)
    scaler = GradScaler("cpu", init_scale=scale, growth_interval=10**6)
    norms = []
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
        scaler.scale(nn.functional.cross_entropy(half(x.to(dtype)).float(), y)).backward()
        for p, q in zip(half.parameters(), ref.parameters(), strict=True):
            q.grad = p.grad.float() / scale  # exact: a power of two
        scaler.unscale_(opt)
        if clip == "recipe":
            norm = nn.utils.clip_grad_norm_(half.parameters(), MAX_NORM)
        else:
            norm = opt.clip_grad_norm_(MAX_NORM)
        norms.append((float(norm), float(nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))))
        scaler.step(opt)
        scaler.update()
        plain.step()
        opt.zero_grad()
        plain.zero_grad()
    return list(opt.master_views()), [p.detach() for p in ref.parameters()], norms


@pytest.mark.parametrize("scale", [SCALE, 1.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("flat", [False, True])
def test_torch_amp_clip_recipe_clips_what_the_masters_step(flat: bool, dtype: torch.dtype,
                                                           scale: float) -> None:
    """The recipe clips the model's .grad, which hold the unscaled gradients rounded to half precision;
    clip_grad_norm_ computes the norm in that dtype too. So: within half precision's rounding (bf16 keeps
    8 bits: 2**-8 ~ 0.4% per rounding, a few roundings -> 2e-2). At a scale of 1 the model's .grad are not
    written again (they hold those values already), and the clip's edits must still reach the step."""
    masters, ref, norms = _train(flat, dtype, "recipe", scale)
    for got, want in norms:
        assert got == pytest.approx(want, rel=2e-2)  # the true norm, not 2**10 times it
    start = [p.detach() for p in _setup(flat, dtype)[0].parameters()]
    for m, r, s in zip(masters, ref, start, strict=True):
        torch.testing.assert_close(m - s, r - s, rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize("flat", [False, True])
def test_wrapper_clip_is_the_fp32_clip(flat: bool) -> None:
    """opt.clip_grad_norm_ clips the fp32 master gradients: the fp32 reference's clip, exactly per
    parameter; flat buffers sum the squares in another order (1e-6)."""
    masters, ref, norms = _train(flat, torch.float16, "wrapper")
    for got, want in norms:
        assert got == pytest.approx(want, rel=1e-6)
    for m, r in zip(masters, ref, strict=True):
        if flat:
            torch.testing.assert_close(m, r, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(m, r)


def test_clip_without_scaler_clips_the_half_grads_the_step_reads() -> None:
    """bf16 without loss scaling: clipping the model's gradients before step() is what the step uses."""
    ref, half, opt, plain = _setup(False, torch.bfloat16)
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    nn.functional.cross_entropy(half(x.bfloat16()).float(), y).backward()
    nn.utils.clip_grad_norm_(half.parameters(), MAX_NORM)
    for p, q in zip(half.parameters(), ref.parameters(), strict=True):
        q.grad = p.grad.float()
    opt.step()
    plain.step()
    assert all(torch.equal(m, r) for m, r in zip(opt.master_views(), ref.parameters(), strict=True))


def test_without_master_grads_the_norm_is_fp32_and_each_gradient_is_rounded_once() -> None:
    """master_grads=False: the step reads the model's bf16 gradients. opt.clip_grad_norm_ took their norm in
    bf16 (1.0156 against the fp32 1.0188 in a review's run) though its docstring said fp32. Reference: torch's
    clip of the fp32 upcasts, rounded to bf16 once."""
    torch.manual_seed(0)
    half = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 3)).bfloat16()
    opt = MasterWeights(torch.optim.AdamW(half.parameters(), lr=1e-3), master_grads=False)
    x, y = torch.randn(128, 64), torch.randint(0, 3, (128,))
    nn.functional.cross_entropy(half(x.bfloat16()).float(), y).backward()
    ref = [nn.Parameter(p.detach().float()) for p in half.parameters()]
    for r, p in zip(ref, half.parameters(), strict=True):
        r.grad = p.grad.float()
    want = nn.utils.clip_grad_norm_(ref, MAX_NORM)
    got = opt.clip_grad_norm_(MAX_NORM)
    assert got.dtype == torch.float32 and float(got) == pytest.approx(float(want), rel=1e-6)
    for p, r in zip(half.parameters(), ref, strict=True):
        assert torch.equal(p.grad, r.grad.bfloat16())


@pytest.mark.parametrize(("scale", "written"), [(SCALE, True), (1.0, False)])
def test_unscale_writes_the_model_gradients_only_where_the_scale_changed_them(scale: float,
                                                                              written: bool) -> None:
    """The mirror into the model's .grad is a pass over every gradient; at an inverse scale of exactly 1
    (bf16's static scale) it would write the bits that are there already, so it is skipped (a write
    would move the version counters). Either way the model's .grad are the masters' rounding, bit for bit."""
    _, half, opt, _ = _setup(False, torch.bfloat16)
    scaler = GradScaler("cpu", init_scale=scale, growth_interval=10**6)
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    scaler.scale(nn.functional.cross_entropy(half(x.bfloat16()).float(), y)).backward()
    versions = [p.grad._version for p in half.parameters()]
    scaler.unscale_(opt)
    assert ([p.grad._version for p in half.parameters()] != versions) is written
    for p, m in zip(half.parameters(), opt.master_views(), strict=True):
        assert torch.equal(p.grad, m.grad.to(p.dtype))


@pytest.mark.parametrize("flat", [False, True])
def test_model_gradient_edits_before_and_after_taking_them_early_all_reach_the_step(flat: bool) -> None:
    """take_grad_edits (amp.master_params calls it) copies edits into the masters' gradients before the
    step; with flat masters (views of one buffer, one version counter) that copy made every other master
    gradient look edited by the user, and a later edit of their model gradients was dropped. Reference:
    SGD (lr 0.5) subtracts half the gradients as last edited."""
    _, half, opt, _ = _setup(flat, torch.bfloat16)
    scaler = GradScaler("cpu", init_scale=1.0)
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    scaler.scale(nn.functional.cross_entropy(half(x.bfloat16()).float(), y)).backward()
    scaler.unscale_(opt)
    params = list(half.parameters())
    params[0].grad.mul_(0.5)
    opt.take_grad_edits()
    params[2].grad.mul_(0.25)
    want = [0.5 * p.grad.float() for p in params]
    before = [m.detach().clone() for m in opt.master_views()]
    scaler.step(opt)
    for b, m, w in zip(before, opt.master_views(), want, strict=True):
        torch.testing.assert_close(b - m, w, rtol=0, atol=1e-6)
