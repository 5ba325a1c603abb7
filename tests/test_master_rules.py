"""MasterWeights keeps torch.optim's rules: each case is run twice, once through MasterWeights on a half
model and once through the plain torch.optim optimizer on the fp32 model it came from, fed the same
gradients (the half gradients, upcast exactly). The masters must follow the fp32 run: bit for bit per
parameter; within 1e-6 relative for flat buffers, whose foreach kernels see one long tensor instead of
several (the same operations per element, vectorized at other boundaries)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from mixprec.errors import UnsupportedParameterError
from mixprec.master import MasterWeights, fp32_originals, model_to_half

# The frozen layer is held by the optimizer on purpose here (its master's rules are under test)
pytestmark = pytest.mark.filterwarnings("ignore:MasterWeights. the optimizer holds .* frozen:UserWarning")

OPTS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.1, foreach=True),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, foreach=True),
}


class Net(nn.Module):
    """a -> b -> head, plus a second head `c` used on some steps only, and a frozen input layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.frozen = nn.Linear(6, 6)
        self.a, self.b, self.c = nn.Linear(6, 12), nn.Linear(12, 3), nn.Linear(12, 3)

    def forward(self, x: torch.Tensor, step: int, use_c: Callable[[int], bool]) -> torch.Tensor:
        h = torch.relu(self.a(self.frozen(x)))
        out = self.b(h)
        return out + self.c(h) if use_c(step) else out


def _data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def _groups(net: Net, split: bool) -> list[dict]:
    if split:  # the head `c` in a group of its own, with its own learning rate
        return [{"params": [*net.frozen.parameters(), *net.a.parameters(), *net.b.parameters()]},
                {"params": list(net.c.parameters()), "lr": 0.02}]
    return [{"params": list(net.parameters())}]


def run_against_fp32(
    opt_name: str, flat: bool, zero: str, use_c: Callable[[int], bool], split: bool, freeze: bool = True
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(masters, fp32 reference params, initial values) after 4 steps; frozen layer when `freeze`."""
    ref = Net()
    if freeze:
        ref.frozen.requires_grad_(False)
    half = copy.deepcopy(ref)
    converted = model_to_half(half, torch.bfloat16)
    opt = MasterWeights(OPTS[opt_name](_groups(half, split)), flat=flat, fused=False,
                        initial=fp32_originals(converted))
    plain = OPTS[opt_name](_groups(ref, split))
    start = [p.detach().clone() for p in ref.parameters()]
    for i in range(4):
        x, y = _data(i)
        nn.functional.cross_entropy(half(x.bfloat16(), i, use_c).float(), y).backward()
        for p, q in zip(half.parameters(), ref.parameters(), strict=True):
            q.grad = None if p.grad is None else p.grad.float()
        opt.step()
        plain.step()
        if zero == "model":
            half.zero_grad()  # what many loops do: clears the model's .grad only
        else:
            opt.zero_grad()
        plain.zero_grad()
    return list(opt.master_views()), [p.detach() for p in ref.parameters()], start


def _assert_tracks(masters: list[torch.Tensor], ref: list[torch.Tensor], flat: bool) -> None:
    for m, r in zip(masters, ref, strict=True):
        if flat:
            torch.testing.assert_close(m, r, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(m, r)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("opt_name", sorted(OPTS))
def test_frozen_params_are_never_stepped_and_stay_out_of_flat_buffers(opt_name: str, flat: bool) -> None:
    masters, ref, start = run_against_fp32(opt_name, flat, "opt", lambda i: True, split=False)
    _assert_tracks(masters, ref, flat)
    assert torch.equal(masters[0], start[0]) and torch.equal(masters[1], start[1])  # frozen: untouched


def test_flat_buffer_holds_trainable_params_only() -> None:
    net = Net().bfloat16()
    net.frozen.requires_grad_(False)
    opt = MasterWeights(torch.optim.SGD(net.parameters(), lr=0.1), flat=True)
    n_trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    flat = opt.param_groups[0]["params"][0]
    assert flat.numel() == n_trainable
    assert len(opt.param_groups[0]["params"]) == 1 + 2  # the buffer, the frozen weight and bias


@pytest.mark.parametrize("zero", ["model", "opt"])
@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("opt_name", sorted(OPTS))
def test_group_without_gradient_in_a_step_is_not_stepped(opt_name: str, flat: bool, zero: str) -> None:
    """Head `c` (its own param group) is used on steps 0 and 3 only: steps 1 and 2 must not move it, not
    with weight decay, not with momentum, not with the gradient of step 0 (model.zero_grad() leaves it)."""
    masters, ref, _ = run_against_fp32(opt_name, flat, zero, lambda i: i in (0, 3), split=True)
    _assert_tracks(masters, ref, flat)


@pytest.mark.parametrize("zero", ["model", "opt"])
@pytest.mark.parametrize(("opt_name", "flat"), [("sgd", True), ("sgd", False), ("adamw", False)])
def test_param_without_gradient_in_a_step_is_not_stepped(opt_name: str, flat: bool, zero: str) -> None:
    """Head `c` shares a group with used parameters. Flat with Adam is left out on purpose: the flat buffer
    has one step count, so the bias correction of `c`'s first step differs (documented in HoleGuard)."""
    masters, ref, _ = run_against_fp32(opt_name, flat, zero, lambda i: i in (0, 3), split=False)
    _assert_tracks(masters, ref, flat)


def test_flat_adam_leaves_a_param_without_gradient_where_it_was() -> None:
    half = Net().bfloat16()
    opt = MasterWeights(torch.optim.AdamW(half.parameters(), lr=1e-2, weight_decay=0.1), flat=True)
    for i in range(3):
        x, y = _data(i)
        nn.functional.cross_entropy(half(x.bfloat16(), i, lambda s: s == 0).float(), y).backward()
        before = [m.clone() for m in opt.master_views()][-2:]  # head c's weight and bias
        opt.step()
        opt.zero_grad()
        if i > 0:
            assert all(torch.equal(a, b) for a, b in zip(before, list(opt.master_views())[-2:], strict=True))


class Tied(nn.Module):
    """A weight shared by two layers (tied embeddings) and a layer applied twice (shared)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mid, self.out = nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = self.mid(torch.tanh(self.mid(h)))  # the same layer twice
        return self.out(h)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("opt_name", sorted(OPTS))
def test_tied_and_shared_params(opt_name: str, flat: bool) -> None:
    ref = Tied()
    half = copy.deepcopy(ref)
    converted = model_to_half(half, torch.bfloat16)
    assert half.out.weight is half.emb.weight
    opt = MasterWeights(OPTS[opt_name](half.parameters()), flat=flat, fused=False,
                        initial=fp32_originals(converted))
    plain = OPTS[opt_name](ref.parameters())
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        idx, y = torch.randint(0, 10, (12,), generator=g), torch.randint(0, 10, (12,), generator=g)
        nn.functional.cross_entropy(half(idx).float(), y).backward()
        for p, q in zip(half.parameters(), ref.parameters(), strict=True):
            q.grad = p.grad.float()
        opt.step()
        plain.step()
        opt.zero_grad()
        plain.zero_grad()
    assert half.out.weight is half.emb.weight  # still tied, and the model holds the rounded master
    assert torch.equal(half.emb.weight, list(opt.master_views())[0].bfloat16())
    _assert_tracks(list(opt.master_views()), [p.detach() for p in ref.parameters()], flat)


def test_add_param_group_with_an_optimized_param_raises_as_torch_does() -> None:
    net = Net().bfloat16()
    plain = torch.optim.SGD(net.a.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="more than one parameter group"):
        plain.add_param_group({"params": [net.a.weight]})
    opt = MasterWeights(torch.optim.SGD(net.a.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [net.a.weight]})
    opt.add_param_group({"params": net.b.parameters(), "lr": 0.01})  # new parameters are fine
    assert len(list(opt.master_views())) == 4


@pytest.mark.parametrize("flat", [False, True])
def test_deepcopy_gives_an_independent_wrapper(flat: bool) -> None:
    net = Net().bfloat16()
    opt = MasterWeights(torch.optim.AdamW(net.parameters(), lr=1e-2), flat=flat)

    def train(model: Net, o: MasterWeights, steps: range) -> None:
        for i in steps:
            x, y = _data(i)
            nn.functional.cross_entropy(model(x.bfloat16(), i, lambda s: True).float(), y).backward()
            o.step()
            o.zero_grad()

    train(net, opt, range(2))
    net2, opt2 = copy.deepcopy((net, opt))
    assert list(opt2.model_params())[0] is net2.frozen.weight  # the copy steps the copied model
    train(net, opt, range(2, 4))
    train(net2, opt2, range(2, 4))
    for a, b in zip(opt.master_views(), opt2.master_views(), strict=True):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    assert opt2.param_groups[0]["fused"] is True  # the copy kept the implementation the wrapper chose


def test_sparse_gradient_names_the_fix() -> None:
    emb = nn.Embedding(10, 4, sparse=True).bfloat16()
    opt = MasterWeights(torch.optim.SGD(emb.parameters(), lr=0.1))
    emb(torch.tensor([1, 2])).float().sum().backward()
    with pytest.raises(UnsupportedParameterError, match="sparse=False"):
        opt.step()
