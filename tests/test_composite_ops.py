"""nn.MultiheadAttention's inner GEMMs are handled by the region like any other (mixprec/composite_ops.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import handle_torch_function, has_torch_function

import mixprec
from mixprec.composite_ops import COMPOSITES
from mixprec.diagnostics import CastTrace

GEMMS = ("addmm", "mm", "bmm", "baddbmm", "linear", "matmul")


def _attention() -> tuple[nn.MultiheadAttention, torch.Tensor]:
    torch.manual_seed(0)
    return nn.MultiheadAttention(32, 4), torch.randn(6, 3, 32)  # (T, B, E): the module's default layout


def _gemm_dtypes(trace: CastTrace, phase: str) -> set[str]:
    return {d for op in GEMMS for d in trace.dtypes_of(op, phase=phase)}


def test_attentions_gemms_are_emulated_where_its_linears_are() -> None:
    """A user trial: MultiheadAttention's projections ran in torch's own fp16/bf16 kernels (5-10x fp32's
    time on a CPU without half units) beside nn.Linear layers emulated at fp32's speed. The suite emulates
    fp16 (conftest)."""
    mha, x = _attention()
    with CastTrace() as trace:
        with mixprec.autocast("cpu", torch.float16):
            out, _ = mha(x, x, x, need_weights=False)
        out.float().sum().backward()
    assert out.dtype is torch.float16
    assert _gemm_dtypes(trace, "forward") == {"fp16 (emulated)"}
    assert _gemm_dtypes(trace, "backward") == {"fp16 (emulated)"}


def test_attention_in_an_o2_region_is_emulated_too() -> None:
    mha, x = _attention()
    half = mha.half()
    with CastTrace() as trace, mixprec.half_compute("cpu", torch.float16):
        out, _ = half(x.half(), x.half(), x.half(), need_weights=False)
    assert _gemm_dtypes(trace, "forward") == {"fp16 (emulated)"}


def test_attention_matches_torch_autocast() -> None:
    """The same casts as torch.autocast's (GEMM inputs and outputs in fp16, fp32 accumulation): equal to
    torch's fp16 kernels up to summation order, forward and backward."""
    results = []
    for region in (torch.autocast, mixprec.autocast):
        mha, x = _attention()
        x.requires_grad_(True)
        with region("cpu", dtype=torch.float16):
            out, weights = mha(x, x, x)  # need_weights: the bmm/softmax path, not SDPA
        (out.float() ** 2).sum().backward()
        results.append((out, weights, x.grad, mha.in_proj_weight.grad))
    for ours, torchs in zip(results[1], results[0], strict=True):
        assert ours.dtype is torchs.dtype
        torch.testing.assert_close(ours.float(), torchs.float(), rtol=4e-3, atol=2e-3)


def test_the_copy_computes_what_the_function_computes() -> None:
    mha, x = _attention()
    args = (x, x, x, 32, 4, mha.in_proj_weight, mha.in_proj_bias, None, None, False, 0.0, mha.out_proj.weight,
            mha.out_proj.bias)
    for func, copy in COMPOSITES.items():
        assert copy.__code__.co_code == func.__code__.co_code and copy.__defaults__ == func.__defaults__
        torch.manual_seed(1)
        ours = copy(*args, training=True, need_weights=True)
        torch.manual_seed(1)
        assert all(torch.equal(a, b) for a, b in zip(ours, func(*args, training=True, need_weights=True),
                                                         strict=True))


def test_the_copy_reads_the_module_as_it_is_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """A patch of a function the attention calls (an attention kernel swap, DeepSpeed's F.linear) made after
    import is seen inside a region too: the copy's globals are the module's, read live."""
    calls = []
    original = F.scaled_dot_product_attention

    def patched(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", patched)
    mha, x = _attention()
    with mixprec.autocast("cpu", torch.float16):
        mha(x, x, x, need_weights=False)
    assert calls == [1]


def test_an_unhashable_callable_is_passed_on() -> None:
    """A callable object that checks has_torch_function itself reaches the mode: a dict lookup of it
    raised TypeError (an eq dataclass is unhashable)."""

    @dataclasses.dataclass
    class Scaled:
        k: float

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            if has_torch_function((x,)):
                return handle_torch_function(self, (x,), x)
            return x * self.k

    with mixprec.autocast("cpu", torch.bfloat16):
        assert torch.equal(Scaled(2.0)(torch.ones(3)), torch.full((3,), 2.0))


# torch functions and Tensor methods that run a GEMM kernel (names as Dynamo's graph records them; it
# records torch's attention as one call, decomposed later)
_GRAPH_GEMMS = frozenset(
    {*GEMMS, "scaled_dot_product_attention", "__matmul__", "multi_head_attention_forward"}
)


def _native_half_gemms(graph: torch.fx.GraphModule) -> list[str]:
    """GEMM calls in a Dynamo graph whose result (traced under the region's autocast state) is half: a
    native half kernel, where an emulated region runs fp32 kernels on rounded inputs."""
    found = []
    for node in graph.graph.nodes:
        name = getattr(node.target, "__name__", str(node.target))
        value = node.meta.get("example_value")
        values = value if isinstance(value, tuple) else (value,)
        half = any(isinstance(v, torch.Tensor) and v.dtype is torch.float16 for v in values)
        if name in _GRAPH_GEMMS and half:
            found.append(name)
    return found


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_attention_is_emulated_as_eager_is() -> None:
    """Compiled code traced torch's own attention, whose inner GEMMs ran in torch's half kernels: a
    Transformer LM's compiled bf16 step took 8.5-9.3x fp32's on a CPU without half units (RESULTS.md)."""
    mha, x = _attention()
    graphs: list[torch.fx.GraphModule] = []

    def capture(graph: torch.fx.GraphModule, _: Any) -> Any:
        graphs.append(graph)
        return graph.forward

    def attend(x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu", torch.float16):
            return mha(x, x, x, need_weights=False)[0]

    compiled = torch.compile(attend, backend=capture, fullgraph=True)(x)
    assert graphs and not [gemm for graph in graphs for gemm in _native_half_gemms(graph)]
    eager = attend(x)
    assert compiled.dtype is eager.dtype is torch.float16
    torch.testing.assert_close(compiled.float(), eager.float(), rtol=2**-9, atol=2e-3)


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_tensor_method_written_in_python_compiles_in_one_graph() -> None:
    """``Tensor.unflatten`` ends in ``super().unflatten()``, which Dynamo cannot call from the mode's
    frame: it gave up on the whole function and ran it eagerly, where torch.autocast compiles it."""
    linear = nn.Linear(64, 64)

    def heads(x: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu", torch.float16):  # a region with a Python layer (the suite's fp16)
            return linear(x).unflatten(-1, (4, 16)).sum(-1)

    x = torch.randn(8, 64)
    compiled = torch.compile(heads, fullgraph=True, backend="eager")(x)  # fullgraph: a break raises
    torch.testing.assert_close(compiled, heads(x))


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_attention_with_a_padding_mask_compiles_in_one_graph() -> None:
    """torch's key_padding_mask check passes its message as a closure to torch._check_with, which Dynamo
    cannot convert inside the copy: every padded attention call broke the graph (a user trial's seq2seq
    model; torch's own attention Dynamo records whole). The copy reads a plain-Python check instead,
    which still refuses a mask of the wrong shape."""
    mha, x = _attention()
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[0, -2:] = True  # (B, S): the first sequence's last two positions are padding

    def attend(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with mixprec.autocast("cpu", torch.float16):
            return mha(x, x, x, key_padding_mask=mask, need_weights=False)[0]

    compiled = torch.compile(attend, fullgraph=True, backend="eager")(x, padding)  # a break raises
    torch.testing.assert_close(compiled.float(), attend(x, padding).float(), rtol=2**-9, atol=2e-3)
    with pytest.raises(AssertionError, match=r"key_padded_mask.shape\[1\] to be 6, but got 5"):
        attend(x, padding[:, :5])
