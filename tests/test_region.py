"""mixprec/region.py: the base of the regions' torch-function modes, whose memo of the functions a mode
leaves alone must never hold one that a region changes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import mixprec
import mixprec.policy as P
from mixprec import half_compute
from mixprec.emulation import emulated


def _top_mode() -> TorchFunctionMode | None:
    depth = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(depth - 1) if depth else None


def test_a_function_left_alone_is_changed_once_a_registration_asks(clean_registry: None) -> None:
    x = torch.randn(4, 4)
    with mixprec.autocast("cpu", torch.float16):  # fp16: emulated in the suite, so a mode is on
        first = torch.tanh(x)  # no rule: passed on, and remembered so
        assert _top_mode()._plain.get(torch.tanh) is True  # the memo this test is about
    P.register_half_function(torch, "tanh")
    with mixprec.autocast("cpu", torch.float16):
        then = torch.tanh(x)
    reference = torch.tanh(x.half())
    assert first.dtype is torch.float32
    assert then.dtype is torch.float16
    assert torch.equal(then, reference)


def test_the_memo_never_holds_a_function_a_region_changes() -> None:
    x, w = torch.randn(8, 16), torch.randn(32, 16)
    with mixprec.autocast("cpu", torch.float16):
        for _ in range(3):  # the second and third calls run after the memo has seen linear
            out = F.linear(torch.relu(x), w)
        assert _top_mode()._plain.get(F.linear) is False
    # linear stayed an fp16 GEMM each time: the emulated result (fp16 inputs, fp32 sums, one rounding)
    assert out.dtype is torch.float16
    assert torch.equal(out, emulated(F.linear, (torch.relu(x), w), {}, torch.float16))


def test_a_half_model_still_computes_its_loss_in_fp32_after_the_memo() -> None:
    # squared errors of 300 overflow fp16 (90000 > 65504): the loss must be summed in fp32
    pred = torch.full((4,), 300.0, dtype=torch.float16)
    target = torch.zeros(4, dtype=torch.float16)
    with half_compute("cpu", torch.float16):
        torch.add(pred, 0)  # a function the mode leaves alone, remembered
        got = [F.mse_loss(pred, target) for _ in range(2)]
    for g in got:
        assert g.dtype is torch.float32
        assert g.item() == 90000.0


def test_an_unhashable_callable_is_decided_at_each_call() -> None:
    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, t: torch.Tensor) -> torch.Tensor:
            # the mode receives this object itself as the function (as a dataclass of a library may)
            return torch.overrides.handle_torch_function(self, (t,), t) \
                if torch.overrides.has_torch_function((t,)) else _twice(t)

    def _twice(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    x = torch.ones(3)
    with mixprec.autocast("cpu", torch.float16):
        assert torch.equal(Unhashable()(x), x * 2)
