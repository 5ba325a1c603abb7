"""A skipped step leaves BatchNorm's running statistics as they were (issue 14 item 2): the reference is
the same run without the bad batch."""

from __future__ import annotations

import pytest
import torch
from test_scaler import _NoSync
from torch import nn

import mixprec
from mixprec.scaler import GradScaler


def _bn_net() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _batches(bad_at: int | None) -> list[list[torch.Tensor]]:
    """Iterations of micro-batches; at ``bad_at`` one sample of the last micro-batch is NaN."""
    g = torch.Generator().manual_seed(1)
    its = [[torch.randn(8, 6, generator=g) for _ in range(2)] for _ in range(5)]
    if bad_at is not None:
        its[bad_at][-1][3, 0] = float("nan")
    return its


def _train(
    its: list[list[torch.Tensor]], watch: bool, no_sync_update: bool = False, compiled: bool = False
) -> tuple[dict, GradScaler]:
    model, opt = _bn_net()
    scaler = GradScaler("cpu", init_scale=2.0**10)
    if watch:
        scaler.watch(model)
    forward = torch.compile(model) if compiled else model
    for micro in its:
        for x in micro:  # gradient accumulation: two forwards, one snapshot
            scaler.scale(forward(x).square().mean()).backward()
        scaler.step(opt)
        if no_sync_update:
            with _NoSync():
                scaler.update()
        else:
            scaler.update()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}, scaler


def test_skipped_step_leaves_buffers_as_a_run_without_the_bad_batch() -> None:
    clean = _batches(None)
    reference, _ = _train(clean[:2] + clean[3:], watch=True)
    watched, scaler = _train(_batches(2), watch=True, no_sync_update=True)
    assert scaler.skipped_steps == 1
    assert watched.keys() == reference.keys()
    for key, value in reference.items():  # weights and buffers, num_batches_tracked included: bit-identical
        torch.testing.assert_close(watched[key], value, rtol=0, atol=0, msg=key)
    unwatched, _ = _train(_batches(2), watch=False)  # what happens without it (and in torch.amp)
    assert unwatched["1.running_mean"].isnan().any()


def test_eval_forwards_and_removed_watches_change_nothing() -> None:
    model, opt = _bn_net()
    scaler = GradScaler("cpu", init_scale=2.0**10)
    watch = scaler.watch(model)
    x = torch.randn(8, 6)
    scaler.scale(model(x).sum()).backward()
    scaler.step(opt)
    scaler.update()
    model.eval()
    model(x)  # eval forward between iterations: no snapshot, nothing to restore
    model.train()
    watch.remove()
    before = model[1].running_mean.clone()
    bad = x.clone()
    bad[0, 0] = float("nan")
    scaler.scale(model(bad).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and model[1].running_mean.isnan().any() and not before.isnan().any()


def test_a_compiled_watched_model_neither_recompiles_nor_loses_its_buffers(fresh_dynamo: None) -> None:
    # The watch's forward pre-hook runs with a compiled model too. Traced by Dynamo, its per-iteration
    # Python state (armed flag, snapshot pairs) was guarded on: a recompile every step until the limit.
    clean = _batches(None)
    reference, _ = _train(clean[:2] + clean[3:], watch=True, compiled=True)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        watched, scaler = _train(_batches(2), watch=True, compiled=True)
    assert scaler.skipped_steps == 1
    for key, value in reference.items():  # the same compiled kernels: bit-identical again
        torch.testing.assert_close(watched[key], value, rtol=0, atol=0, msg=key)


def _gan_step(watch: bool) -> list[torch.Tensor]:
    """A GAN iteration with BatchNorm in both models and the scaler updated between the two steps: the
    generator's loss goes back through a forward made before the discriminator's update."""
    torch.manual_seed(0)
    net_g = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 6))
    net_d = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    opt_g, opt_d = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (net_g, net_d))
    scaler = GradScaler("cpu", init_scale=2.0**10)
    if watch:
        scaler.watch(net_g), scaler.watch(net_d)
    fake = net_g(torch.randn(16, 4))
    scaler.scale(net_d(fake.detach()).mean() - net_d(torch.randn(16, 6)).mean()).backward()
    scaler.step(opt_d)
    scaler.update()  # restores (or not) every watched model's buffers: net_g's forward still awaits backward
    scaler.scale(-net_d(fake).mean()).backward()
    scaler.step(opt_g)
    scaler.update()
    return [p.detach().clone() for p in (*net_g.parameters(), *net_g.buffers())]


def test_an_update_between_two_backwards_of_watched_models_keeps_the_graph() -> None:
    """The restore wrote every buffer at every update; a forward whose backward had not run yet (net_g's,
    BatchNorm saving its running statistics) then failed autograd's version check ("modified by an
    inplace operation"): apex's DCGAN example and two losses of one forward under mixprec.amp did."""
    watched, unwatched = _gan_step(watch=True), _gan_step(watch=False)
    for a, b in zip(watched, unwatched, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _HealingScale(nn.Module):
    """A buffer the forward reads and updates: an EMA pulled from a stale 6e4 toward 1 (a VQ-VAE's dead
    code at 1/eps), which makes the fp16 forward overflow until the forward's own updates heal it (6e4: an
    fp16 value, for a half model's fp16 buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.register_buffer("scale", torch.tensor(6e4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.scale.mul_(0.1).add_(0.9)
        return self.lin(x * self.scale)


def _healing_run(interface: str) -> tuple[int, float]:
    """Steps skipped of 8 and the buffer at the end, under torch.amp or one of mixprec's interfaces."""
    torch.manual_seed(0)
    model, data = _HealingScale(), [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(8)]
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    if interface == "Learner.to_fp16":
        loader = torch.utils.data.DataLoader(data, batch_size=None)
        learn = mixprec.Learner(mixprec.DataBunch(loader, loader, None, (4,), "toy"), model,
                                loss_func=nn.functional.mse_loss, silent=True).to_fp16()
        learn.fit(1, lr=1e-2)
        return learn.recorder.skipped.count(True), model.scale.item()
    if interface == "initialize O1":
        model, opt = mixprec.initialize(model, opt, opt_level="O1", verbosity=0)
        for x, y in data:
            with mixprec.scale_loss(nn.functional.mse_loss(model(x), y), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
        return mixprec.amp.state_dict()["loss_scaler0"]["mixprec"]["skipped_steps"], model.scale.item()
    scaler, skipped = torch.amp.GradScaler("cpu"), 0
    for x, y in data:
        with torch.autocast("cpu", torch.float16):
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        before = scaler.get_scale()
        scaler.update()
        skipped += scaler.get_scale() < before  # torch's scaler backs off on a skipped step only
        opt.zero_grad()
    return skipped, model.scale.item()


@pytest.mark.parametrize("interface", ["initialize O1", "Learner.to_fp16"])
def test_a_buffer_the_forward_reads_is_left_as_the_forward_made_it(interface: str) -> None:
    """initialize and to_fp16 put every buffer back on a skipped step, so a forward that overflowed
    because of a buffer it was healing met the same stale value every step: every step skipped, for good
    (a VQ-VAE trial's EMA codebook). Only norm layers' running statistics go back now (a training forward
    does not read them); the others stay as the forward left them, as torch.amp (the reference here), apex
    and fastai leave every buffer."""
    skipped, scale = _healing_run(interface)
    reference_skipped, reference_scale = _healing_run("torch.amp")
    assert 1 <= reference_skipped <= 5 and reference_scale < 2.0  # torch.amp skipped a few, then trained
    # (a half model's buffer is fp16: 1.0006 is 1.0 there)
    assert (skipped, scale) == (reference_skipped, pytest.approx(reference_scale, abs=1e-3))


def test_all_buffers_puts_back_a_buffer_that_is_not_a_running_statistic() -> None:
    for all_buffers, expected in ((False, 6000.9), (True, 6e4)):
        model = _HealingScale()
        scaler = GradScaler("cpu")
        scaler.watch(model, all_buffers=all_buffers)
        scaler.scale(model(torch.full((2, 4), float("nan"))).sum()).backward()
        scaler.step(torch.optim.SGD(model.parameters(), lr=0.1))
        scaler.update()
        assert scaler.last_step_skipped and model.scale.item() == pytest.approx(expected)


def test_a_lazy_batchnorm_is_watched_once_it_has_statistics() -> None:
    """A LazyBatchNorm's buffers have no size before its first forward: the snapshot raised there (a
    review); it starts with the iteration after, and a skipped step then puts its statistics back."""
    model = nn.Sequential(nn.Linear(6, 4), nn.LazyBatchNorm1d())
    scaler, opt = GradScaler("cpu"), None
    scaler.watch(model)
    for bad in (False, False, True):
        x = torch.randn(8, 6)
        if bad:
            x[0, 0] = float("nan")
            before = model[1].running_mean.clone()
        scaler.scale(model(x).sum()).backward()
        opt = opt or torch.optim.SGD(model.parameters(), lr=0.1)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert scaler.last_step_skipped and torch.equal(model[1].running_mean, before)
