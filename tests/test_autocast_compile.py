"""mixprec.autocast and half_compute under torch.compile (issue 9 and 15's compile items). Few and tiny.

Tolerances, where compiled and eager results are not compared bitwise: Inductor computes a fused chain
of pointwise ops (bias add, gelu, log_softmax) in fp32 and rounds once, where eager rounds every op's
half output, so compiled and eager differ by about one rounding of the half format, as they do for
torch's own compiled autocast. Under torch's own tables (bf16, default policy) compiled mixprec is
compared *bitwise* with compiled torch.autocast, and eager with eager. Elsewhere: one fp16 rounding
(rtol 2**-9, twice fp16's half-ulp) or one bf16 rounding (2**-8).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from collections.abc import Callable

import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

import mixprec
from mixprec import policy as P
from mixprec.half_compute import half_compute

FP16_ROUNDING = 2.0**-9
# mixprec.autocast (the attribute) is the context manager; the engine module is reached through sys.modules
A = importlib.import_module("mixprec.autocast")
# Traced regions (fullgraph) need torch >= 2.13; before it a region is entered eagerly (tested below).
TRACED = pytest.mark.skipif(not A.TRACEABLE_ENTER, reason=f"torch {torch.__version__} cannot trace it")


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def _in_region(region: Callable[[], object], model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def f(x: torch.Tensor) -> torch.Tensor:
        with region():  # type: ignore[attr-defined]
            return F.log_softmax(model(x), -1)

    return f


@TRACED
def test_compiled_function_entering_autocast_bf16_is_torch_compiled_autocast() -> None:
    model, x = _mlp(), torch.randn(4, 16)
    ours = _in_region(lambda: mixprec.autocast("cpu", torch.bfloat16), model)
    theirs = _in_region(lambda: torch.autocast("cpu", torch.bfloat16), model)
    compiled = torch.compile(ours, fullgraph=True)(x)
    assert torch.equal(compiled, torch.compile(theirs, fullgraph=True)(x))
    assert torch.equal(ours(x), theirs(x))


@TRACED
def test_a_decorated_function_compiles_in_one_graph_as_torchs_decorator() -> None:
    """``@mixprec.autocast(...)`` on a function torch.compile traces: torch's decorator compiles with
    fullgraph=True; ours was a region made outside the traced code, which Dynamo refused."""
    model, x = _mlp(), torch.randn(4, 16)

    def f(x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(model(x), -1)

    ours = torch.compile(mixprec.autocast("cpu", torch.bfloat16)(f), fullgraph=True)(x)
    theirs = torch.compile(torch.autocast("cpu", torch.bfloat16)(f), fullgraph=True)(x)
    assert ours.dtype is theirs.dtype
    assert torch.equal(ours, theirs)


@TRACED
def test_a_decorated_function_keeps_its_region_across_a_graph_break_as_torchs() -> None:
    """Without fullgraph, a break in a decorated function ran all of it in fp32 (the region is an object
    made outside the traced code); torch's decorator keeps bf16 on both sides."""
    def make(decorate: Callable[[Callable[..., object]], Callable[..., object]]) -> Callable[..., object]:
        @decorate
        def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            before = torch.mm(x, w)
            torch._dynamo.graph_break()
            return before, torch.mm(before.float(), w)

        return f

    x, w = torch.randn(4, 4), torch.randn(4, 4)
    ours = torch.compile(make(mixprec.autocast("cpu", torch.bfloat16)))(x, w)
    theirs = torch.compile(make(torch.autocast("cpu", torch.bfloat16)))(x, w)
    assert [t.dtype for t in ours] == [t.dtype for t in theirs] == [torch.bfloat16, torch.bfloat16]  # type: ignore[union-attr]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))  # type: ignore[arg-type]


def test_a_torch_that_cannot_trace_the_region_enters_it_eagerly_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.11's Dynamo failed on entering the region ("Global autocast state changed while dynamo
    tracing"): there the region is entered eagerly, with a warning, and gives the eager region's result."""
    monkeypatch.setattr(A, "TRACEABLE_ENTER", False)
    A._warn_eager_region.cache_clear()
    model, x = _mlp(), torch.randn(4, 16)
    f = _in_region(lambda: mixprec.autocast("cpu", torch.bfloat16, policy=P.APEX), model)
    with pytest.warns(UserWarning, match="needs torch 2.13 or newer"):
        compiled = torch.compile(f)(x)
    torch.testing.assert_close(compiled, f(x), rtol=2.0**-8, atol=2.0**-8)  # inside compiled: one rounding
    fp32 = F.log_softmax(model(x), -1)  # no region: the region must have been in force (bf16 GEMMs)
    assert not torch.allclose(compiled, fp32, rtol=1e-5, atol=1e-5)
    A._warn_eager_region.cache_clear()


@pytest.mark.parametrize(
    ("dtype", "policy", "rtol"),
    [
        (torch.float16, None, FP16_ROUNDING),  # emulated GEMMs, fused pointwise: one fp16 rounding
        (torch.bfloat16, P.APEX, 2.0**-8),  # a Python layer (gelu, log_softmax fp32): one bf16 rounding
    ],
)
@TRACED
def test_compiled_function_with_the_python_layer_matches_eager(
    dtype: torch.dtype, policy: P.Policy | None, rtol: float
) -> None:
    model, x = _mlp(), torch.randn(4, 16)
    f = _in_region(lambda: mixprec.autocast("cpu", dtype, policy=policy), model)
    eager = f(x)
    compiled = torch.compile(f, fullgraph=True)(x)
    assert compiled.dtype == eager.dtype
    torch.testing.assert_close(compiled, eager, rtol=rtol, atol=rtol)


def test_compiled_model_inside_an_fp16_region_does_not_recompile_per_step() -> None:
    # issue 15: each step's region used to give Dynamo new objects to guard on (recompile limit hit).
    model = _mlp()
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            with mixprec.autocast("cpu", torch.float16):
                out = compiled(x)
            assert out.dtype == torch.float16
            out.float().square().mean().backward()
            opt.step()
            opt.zero_grad()


def test_a_compiled_model_inside_an_eager_region_traces_its_backward_as_eager_runs_it() -> None:
    # AOTAutograd traces the backward with the forward's autocast state unless told otherwise: inside a
    # region, the backward GEMM of an op the policy keeps in fp32 (and of every emulated GEMM) became a
    # native fp16 GEMM -- 20x slower on a CPU without half units, and the fp32 op's gradients rounded to
    # fp16. Eager runs that backward outside the region, in fp32: the gradients must agree at fp32
    # tolerance, far below one fp16 rounding (2**-11).
    torch.manual_seed(0)
    fp32_linear = P.DEFAULT_POLICY.with_fp32("linear", reason="test: a GEMM kept in fp32")
    eager_model, x = nn.Linear(64, 32), torch.randn(8, 64)
    compiled_model = torch.compile(copy.deepcopy(eager_model))
    grads = []
    for model in (eager_model, compiled_model):
        with mixprec.autocast("cpu", torch.float16, policy=fp32_linear):
            out = model(x)
        assert out.dtype == torch.float32
        (out * x[:, :32]).sum().backward()
        grads.append(model.weight.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_initialized_models_compile_and_match_eager(opt_level: str, fresh_amp_state: None) -> None:
    # mixprec.amp's hooks enter autocast (O1) or half_compute (O2) inside the compiled forward.
    eager_model, x = _mlp(), torch.randn(4, 16)
    eager_model = mixprec.initialize(eager_model, opt_level=opt_level, verbosity=0)
    compiled_model = torch.compile(copy.deepcopy(eager_model))
    eager, compiled = eager_model(x), compiled_model(x)
    assert compiled.dtype == eager.dtype == torch.float32  # outputs cast back to fp32 by amp
    torch.testing.assert_close(compiled, eager, rtol=FP16_ROUNDING, atol=FP16_ROUNDING)


def test_half_compute_compiles_with_its_fp32_loss() -> None:
    # A half model computing its loss inside forward (issue 15), compiled: the loss is still fp32.
    model, x = _mlp().half(), torch.randn(4, 16).half()
    y = torch.randint(0, 8, (4,))

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        with half_compute("cpu", torch.float16):
            return F.cross_entropy(model(x), y)

    eager = loss_fn(x)
    compiled = torch.compile(loss_fn, fullgraph=True)(x)
    assert compiled.dtype == eager.dtype == torch.float32
    torch.testing.assert_close(compiled, eager, rtol=FP16_ROUNDING, atol=FP16_ROUNDING)


@TRACED
def test_compiled_code_names_the_policy_by_its_compile_key() -> None:
    """Keyed by id(), the mode of a freed policy was found again for a new policy at the same address (a
    derived policy's gelu-in-fp32 ran in bf16); a compile key is never reused."""
    region_module = importlib.import_module("mixprec.region")
    policy = P.TORCH.with_fp32("gelu")
    f = _in_region(lambda: mixprec.autocast("cpu", torch.bfloat16, policy=policy), nn.Sequential(nn.GELU()))
    torch.compile(f, fullgraph=True)(torch.randn(4, 16))
    assert any(policy.compile_key in key for key in region_module._COMPILED_MODES)
    with pytest.raises(TypeError, match="strings, bools, ints and dtypes"):
        region_module.compiled_mode(lambda *_: None, policy)


def _mm_in_a_frame_dynamo_runs_eagerly(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    with contextlib.ExitStack():  # a graph break in it: Dynamo runs this frame eagerly
        torch._dynamo.graph_break()
        return torch.mm(a, b)


@pytest.mark.usefixtures("fresh_dynamo", "clean_registry")
def test_a_frame_dynamo_runs_eagerly_inside_a_compiled_region_keeps_the_policy() -> None:
    """A review's case: frames run eagerly inside a region entered in compiled code once ran the mode's
    method eagerly too (a change that kept Dynamo from compiling it as a frame of its own, on every torch);
    that method then found no eager region and let the user's register_float_function(mm) rule go."""
    P.register_float_function(torch, "mm")
    region = mixprec.autocast("cpu", torch.bfloat16)

    @region
    def decorated(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _mm_in_a_frame_dynamo_runs_eagerly(a, b)

    def block(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu", torch.bfloat16):
            return _mm_in_a_frame_dynamo_runs_eagerly(a, b)

    a, b = torch.randn(8, 8), torch.randn(8, 8)
    for f in (decorated, block):
        assert f(a, b).dtype == torch.compile(f, backend="eager")(a, b).dtype == torch.float32


class _ForwardDynamoGivesUpOn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            torch._dynamo.graph_break()  # a graph break in a loop: Dynamo runs the whole frame eagerly
            x = x + F.linear(x, layer.weight, layer.bias)
        return x


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_modes_method_is_never_compiled_as_a_frame_of_its_own() -> None:
    """A user trial (a BERT whose forward Dynamo ran eagerly, for a side-effecting hook): each op's call of
    the mode's __torch_function__ from those eager frames was compiled as a frame, recompiled per op
    signature up to recompile_limit, and warned pointing into mixprec; the step took 2.3x torch.autocast's."""
    model = _ForwardDynamoGivesUpOn()
    compiled = torch.compile(model, backend="eager")
    with mixprec.autocast("cpu", torch.float16):  # emulated in the suite: the mode has work
        for rows in (4, 5, 6):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
    method = A._PolicyMode.__torch_function__
    assert torch._dynamo.eval_frame._debug_get_cache_entry_list(method.__code__) == []


class _WritesADict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)
        self.stats: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.stats["absmax"] = h.detach().abs().max()  # a dict written in forward (logging, HF outputs)
        return self.b(torch.relu(h))


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_forward_writing_a_dict_compiles_without_graph_breaks(arithmetic: Callable[[str], None]) -> None:
    """A user trial: with emulated GEMMs the policy's mode read an op alias from a mappingproxy, and Dynamo
    breaks the graph at such a read once the frame has written a dict (2 breaks per forward here)."""
    arithmetic("emulated")
    torch._dynamo.utils.counters.clear()  # reset() leaves the counts of earlier tests
    model, x = torch.compile(_WritesADict()), torch.randn(4, 16)
    with mixprec.autocast("cpu", torch.bfloat16):
        assert model(x).dtype == torch.bfloat16
    assert not torch._dynamo.utils.counters["graph_break"]
