"""The warning for a half model whose forward ran outside every mixprec region where torch's own half
GEMMs are slow (mixprec/outside_region.py): once, at the first step, naming the fix; never where a region
ran, where the arithmetic is native, or for a model mixprec prepared (compiled too)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.low_precision import LowPrecisionOptimizer
from mixprec.region import STATE

pytestmark = pytest.mark.usefixtures("one_thread")

SAID = "outside any mixprec region"


def _model(dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)


def _batch(dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(32, 8, dtype=dtype), torch.randint(0, 4, (32,))


def _train(model: nn.Module, opt: torch.optim.Optimizer, region: Callable[[], Any], steps: int = 3) -> None:
    x, y = _batch(next(model.parameters()).dtype)
    for _ in range(steps):
        with region():
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()


def _bare() -> Any:
    return warnings.catch_warnings()  # a no-op context: the forward runs outside any region


def _masters(model: nn.Module) -> torch.optim.Optimizer:
    return mixprec.MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-3))


def _low(model: nn.Module) -> torch.optim.Optimizer:
    return LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), "kahan")


@pytest.mark.parametrize("wrap", [_masters, _low], ids=["MasterWeights", "LowPrecisionOptimizer"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_bare_forward_where_the_dtype_is_emulated_warns_once_with_the_fix(
    wrap: Callable[[nn.Module], torch.optim.Optimizer], dtype: torch.dtype, arithmetic: Any
) -> None:
    arithmetic("fp16=emulated,bf16=emulated")
    model = _model(dtype)
    opt = wrap(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, opt, _bare)
    ours = [w for w in caught if SAID in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    message = str(ours[0].message)
    assert f"mixprec.half_compute('cpu', {dtype})" in message
    assert type(opt).__name__ in message
    assert ours[0].filename == __file__  # names the user's opt.step(), not torch's step wrapper


@pytest.mark.parametrize(
    ("forced", "region"),
    [
        ("fp16=emulated,bf16=emulated", lambda: mixprec.half_compute("cpu", torch.bfloat16)),
        ("fp16=emulated,bf16=emulated", lambda: mixprec.autocast("cpu", torch.bfloat16)),
        ("fp16=native,bf16=native", _bare),  # torch's kernels are the fast ones there
    ],
    ids=["in half_compute", "in autocast", "bare, native arithmetic"],
)
def test_no_warning_in_a_region_or_where_torch_is_fast(
    forced: str, region: Callable[[], Any], arithmetic: Any
) -> None:
    arithmetic(forced)
    model = _model()
    opt = _masters(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, opt, region)
    assert not [w for w in caught if SAID in str(w.message)]


def test_a_forward_in_a_closure_is_checked_after_it_ran(arithmetic: Any) -> None:
    arithmetic("fp16=emulated,bf16=emulated")
    model = _model()
    opt = _masters(model)
    x, y = _batch()

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        return loss

    with pytest.warns(UserWarning, match=SAID):
        opt.step(closure)


def test_a_model_mixprec_prepared_and_compiled_does_not_warn(arithmetic: Any) -> None:
    arithmetic("fp16=emulated,bf16=emulated")
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = mixprec.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0)
    compiled = torch.compile(model, backend="eager")  # the region is traced: nothing enters it eagerly
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    before = STATE.entries
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            loss = F.cross_entropy(compiled(x), y)
            with mixprec.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
    assert STATE.entries == before  # so the count alone would have warned
    assert not [w for w in caught if SAID in str(w.message)]


def test_the_filter_the_warning_quotes_silences_it(arithmetic: Any) -> None:
    """Where the check cannot see a region (half_compute entered only inside compiled code), the message
    offers a filter: it must match the message."""
    arithmetic("fp16=emulated,bf16=emulated")
    model = _model()
    opt = _masters(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, opt, _bare, steps=1)
    quoted = next(w for w in caught if SAID in str(w.message))
    pattern = str(quoted.message).split("warnings.filterwarnings('ignore', '")[1].split("')")[0]
    model = _model()
    opt = _masters(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", pattern)
        _train(model, opt, _bare, steps=1)
    assert not [w for w in caught if SAID in str(w.message)]
