"""half_compute (the arithmetic of O2/O3 and to_fp16 models): sensitive ops in fp32 (issue 15)."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import mixprec
import mixprec.policy
from mixprec.diagnostics import CastTrace
from mixprec.errors import ConfigError
from mixprec.half_compute import half_compute

HALF = [torch.float16, torch.bfloat16]

# op, the aten op CastTrace sees, a call on a (4, 64) half tensor
ACTIVATION_OPS: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {
    "softmax": ("_softmax", lambda x: F.softmax(x, -1)),
    "log_softmax": ("_log_softmax", lambda x: x.log_softmax(-1)),
    "layer_norm": ("native_layer_norm", lambda x: F.layer_norm(x, (64,))),
    "exp": ("exp", torch.exp),
    "sum": ("sum", lambda x: x.sum(-1)),
    "mean": ("mean", lambda x: x.mean(-1)),
}


def _ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` numbers at |ref| (float64)."""
    mantissa = {torch.float16: 10, torch.bfloat16: 7}[dtype]
    tiny = torch.finfo(dtype).tiny
    return 2.0 ** (torch.floor(torch.log2(ref.abs().clamp_min(tiny))) - mantissa)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(ACTIVATION_OPS))
def test_sensitive_activations_run_in_fp32_and_return_the_input_dtype(name: str, dtype: torch.dtype) -> None:
    aten, op = ACTIVATION_OPS[name]
    torch.manual_seed(0)
    x = (torch.randn(4, 64) * 3).to(dtype)
    with half_compute("cpu", dtype), CastTrace() as trace:
        out = op(x)
    assert out.dtype == dtype
    ran = [r.inputs for r in trace.ops if r.op == aten]
    assert ran and all(inputs[0] == "fp32" for inputs in ran), ran  # the kernel ran on fp32 inputs
    # fp32 arithmetic rounded once to the half format: within one half ulp of the exact (fp64) result
    ref = op(x.double())
    assert bool(((out.double() - ref).abs() <= _ulp(ref, dtype)).all())


# segment sums: (call on a half target, index, source) -> the result; in place ones return the target
SEGMENT_SUMS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "index_add_": lambda t, i, s: t.index_add_(0, i, s),
    "index_add": lambda t, i, s: torch.index_add(t, 0, i, s),
    "scatter_add_": lambda t, i, s: t.scatter_add_(0, i, s),
    "scatter_add": lambda t, i, s: t.scatter_add(0, i, s),
}


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(SEGMENT_SUMS))
def test_segment_sums_accumulate_in_fp32_and_round_once(name: str, dtype: torch.dtype) -> None:
    """A GNN trial's degrees under O2: index_add_ of 1501 ones into a bf16 zero summed to 256 on the CPU
    (256 + 1 rounds to 256), and the hubs' normalisation was off by 6x. A half model's segment sums
    accumulate in fp32 and round once, in place where the op is, and gradients flow to the source."""
    torch.manual_seed(0)
    index = torch.randint(0, 3, (3000,))
    source = torch.rand(3000).to(dtype).requires_grad_()
    with half_compute("cpu", dtype):
        target = torch.zeros(3, dtype=dtype)
        out = SEGMENT_SUMS[name](target, index, source * 2)
    assert out.dtype == dtype and (out is target) == name.endswith("_")
    exact = torch.zeros(3, dtype=torch.float64).index_add_(0, index, source.detach().double() * 2)
    assert bool(((out.double() - exact).abs() <= _ulp(exact, dtype)).all())  # within one half ulp
    out.sum().backward()
    assert torch.equal(source.grad, torch.full_like(source, 2.0))


@pytest.mark.parametrize("dtype", HALF)
def test_a_loss_inside_forward_is_fp32_and_close_to_the_fp32_model(dtype: torch.dtype) -> None:
    # nanoGPT computes its loss inside forward: under a half model the loss must be fp32 arithmetic.
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 50))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.body(x), y)

    torch.manual_seed(0)
    fp32_model, x, y = WithLoss(), torch.randn(32, 16), torch.randint(0, 50, (32,))
    reference = fp32_model(x, y)
    half_model = WithLoss()
    half_model.load_state_dict(fp32_model.state_dict())
    half_model.to(dtype)
    norm_out: list[torch.dtype] = []
    half_model.body[1].register_forward_hook(lambda m, a, out: norm_out.append(out.dtype))
    with half_compute("cpu", dtype), CastTrace() as trace:
        loss = half_model(x.to(dtype), y)
    assert loss.dtype == torch.float32
    assert trace.dtypes_of("nll_loss_forward") == trace.dtypes_of("native_layer_norm") == {"fp32"}
    assert norm_out == [dtype]  # an activation: back to the model's half dtype
    # The half model's weights and activations are rounded: a few units of the format's epsilon.
    eps = torch.finfo(dtype).eps
    assert abs(float(loss) - float(reference)) <= 8 * eps * float(reference)


def test_ops_without_half_inputs_and_explicit_dtypes_pass_through() -> None:
    x32, x16 = torch.randn(4, 8), torch.randn(4, 8).half()
    with half_compute("cpu", torch.float16), CastTrace() as trace:
        assert F.softmax(x32, -1).dtype == torch.float32
        assert x16.sum(dtype=torch.float16).dtype == torch.float16  # the caller chose the dtype
    assert {r.inputs[0] for r in trace.ops if r.op == "sum"} == {"fp16"}


@pytest.mark.usefixtures("fresh_dynamo", "clean_registry")
def test_a_registration_after_compiling_reaches_a_compiled_half_model(
    arithmetic: Callable[[str], None]
) -> None:
    # The compiled region looks its mode up by a key that includes the registry version: a new
    # register_half_function makes the compiled code retrace with the new plan instead of keeping the old one.
    arithmetic("emulated")
    model = nn.Linear(8, 8).bfloat16()

    def run(x: torch.Tensor) -> torch.Tensor:
        with half_compute("cpu", torch.bfloat16):
            return model(x).cumsum(0)

    compiled = torch.compile(run)
    x = torch.randn(4, 8).bfloat16()
    compiled(x)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled(x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames  # no registration: no retrace
    mixprec.policy.register_half_function(torch, "cumsum")
    compiled(x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(self.norm(x))


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_forward_dynamo_gives_up_on_still_computes_its_loss_in_fp32() -> None:
    """Checkpointed blocks in a loop: torch 2.11's Dynamo gave up on the whole function and ran it eagerly,
    and compiled the region's __torch_function__ as a frame of its own for each op, which let the loss
    through in fp16. That method is now only compiled inlined (on every torch: 2.13 recompiled it per op),
    and eager code runs in the region, entered eagerly before 2.13 (region.TRACEABLE_ENTER)."""
    blocks = nn.ModuleList(_Block() for _ in range(2)).half()
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)  # type: ignore[method-assign]

    def run(x: torch.Tensor) -> torch.Tensor:
        with half_compute("cpu", torch.float16):
            for block in blocks:
                x = block(x)
            return F.cross_entropy(x * 3, torch.arange(4) % 8)

    x = torch.randn(4, 8).half()
    assert run(x).dtype == torch.compile(run)(x).dtype == torch.float32


# ------------------------------------------------------------------ inside an autocast region
_HALVES = (torch.float16, torch.bfloat16)


def _outer_autocast(kind: str, dtype: torch.dtype) -> Any:
    return torch.autocast("cpu", dtype) if kind == "torch" else mixprec.autocast("cpu", dtype)


def _normed_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


@pytest.mark.parametrize("kind", ["torch", "mixprec"])
@pytest.mark.parametrize("model_dtype", _HALVES)
def test_a_half_model_inside_autocast_of_the_other_half_dtype_is_a_clear_error(
    kind: str, model_dtype: torch.dtype
) -> None:
    outer = next(d for d in _HALVES if d is not model_dtype)
    model = _normed_model().to(model_dtype)
    x = torch.randn(4, 8, dtype=model_dtype)
    with pytest.raises(RuntimeError, match="mixed dtype"):  # torch's own failure, with no word on the cause
        with torch.autocast("cpu", outer):
            model(x)
    said = f"runs inside an autocast region of {outer}"
    with _outer_autocast(kind, outer), pytest.raises(ConfigError, match=said):
        with half_compute("cpu", model_dtype):
            model(x)
    with half_compute("cpu", model_dtype):  # the region was left clean: the model runs again
        assert model(x).dtype is model_dtype


@pytest.mark.parametrize("kind", ["torch", "mixprec"])
@pytest.mark.parametrize("dtype", _HALVES)
def test_a_half_model_inside_autocast_of_its_dtype_follows_autocast(kind: str, dtype: torch.dtype) -> None:
    model = _normed_model().to(dtype)
    x = torch.randn(4, 8, dtype=dtype)
    with _outer_autocast(kind, dtype):
        expected = model(x)
        with half_compute("cpu", dtype):  # autocast's rules decide inside it (module docstring)
            got = model(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_half_models_lstm_runs_in_fp32_and_returns_half() -> None:
    """A half model's LSTM ran torch's half kernel, 6-11x fp32's time on a CPU without half units (a user
    trial): where the region emulates (fp16 in the suite), fp32 arithmetic on the exact upcasts, each
    result rounded once to the model's dtype."""
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 8, 2)
    x = torch.randn(5, 3, 8)
    half = copy.deepcopy(lstm).half()
    ref_lstm = copy.deepcopy(half).float()  # the half weights, exactly, in fp32
    with half_compute("cpu", torch.float16):
        out, (h, c) = half(x.half())
    ref_out, (ref_h, ref_c) = ref_lstm(x.half().float())
    for got, ref in ((out, ref_out), (h, ref_h), (c, ref_c)):
        assert got.dtype is torch.float16 and torch.equal(got, ref.half())


class _Embedded(nn.Module):
    """DiT's timestep embedding: sines computed in fp32 inside forward, fed to a half Linear; and a module
    kept fp32 whose GEMM must stay fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp, self.head = nn.Linear(16, 8), nn.Linear(8, 4)
        self.kept = mixprec.keep_fp32(nn.Linear(8, 8))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        freqs = torch.exp(-torch.arange(8, dtype=torch.float32) / 8)
        angles = t[:, None].float() * freqs  # fp32, whatever the model's dtype
        return self.head(self.kept(self.mlp(torch.cat([angles.sin(), angles.cos()], -1))))


@pytest.mark.parametrize("arithmetic", ["emulated", "native"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_gemm_of_half_and_fp32_operands_runs_on_native_and_emulated_devices_alike(
    arithmetic: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where mixprec emulates (an AVX2 CPU) every operand is rounded to the half dtype, so DiT's fp32
    timestep embedding fed to a half Linear trained; where torch's half kernels run (a GPU, an AMX CPU)
    the same O2 model raised "mat1 and mat2 must have the same dtype". The fp32 operands are cast first,
    the emulated GEMM's rounding; a module kept fp32 keeps its fp32 GEMM."""
    monkeypatch.setenv("MIXPREC_HALF_ARITHMETIC", f"cpu:{arithmetic}")
    torch.manual_seed(0)
    model = _Embedded()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.initialize(model, opt, opt_level="O2", dtype=dtype, verbosity=0)
    t = torch.tensor([3.0, 97.0, 500.0])
    out = model(t)
    assert model.kept.weight.dtype is torch.float32 and out.dtype is torch.float32
    torch.testing.assert_close(out, reference(t), rtol=0, atol=8 * torch.finfo(dtype).eps)
    out.sum().backward()
    assert model.mlp.weight.grad is not None and model.mlp.weight.grad.dtype is dtype
    mixprec.amp.reset()


@pytest.mark.parametrize("arithmetic", ["emulated", "native"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_fp32_input_reaches_a_half_layer_norm_and_cdist_runs_in_a_half_model(
    arithmetic: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forecaster's trial with its inputs left as given (cast_model_inputs=False): LayerNorm of an fp32
    input with half weights raised torch's "mixed dtype (CPU)" -- F.layer_norm hands the mode its weight
    as a keyword, which the fp32 check did not read -- and a DETR matcher's torch.cdist in a half model
    raised "not implemented for 'Half'". Both compute in fp32 now, as the norms and autocast's cdist do."""
    monkeypatch.setenv("MIXPREC_HALF_ARITHMETIC", f"cpu:{arithmetic}")

    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.lin = nn.LayerNorm(8), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return torch.cdist(self.lin(self.norm(x)), targets, p=1)

    torch.manual_seed(0)
    model = Normed()
    reference = copy.deepcopy(model)
    x, targets = torch.randn(6, 8) * 3 + 1, torch.randn(3, 4)
    model, _ = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", dtype=dtype,
                                  cast_model_inputs=False, verbosity=0)
    out = model(x, targets)
    assert out.dtype is torch.float32
    torch.testing.assert_close(out, reference(x, targets), rtol=16 * torch.finfo(dtype).eps, atol=0)
    mixprec.amp.reset()


def _listed_by_torch(x: torch.Tensor, cov: torch.Tensor) -> list[torch.Tensor]:
    """An FNet's token mixing, an FNO's spectral product, a flow's Gaussian factor (torch's CPU fp32 list)."""
    return [torch.fft.fft2(x).real, torch.fft.irfft(torch.fft.rfft(x) * 2, n=x.shape[-1]),
            torch.linalg.cholesky(cov), torch.linalg.svdvals(x)]


def _not_listed(x: torch.Tensor, cov: torch.Tensor) -> list[torch.Tensor]:
    """A flow's Gaussian base log-density and log-determinant: solvers torch.autocast does not list."""
    base = torch.distributions.MultivariateNormal(torch.zeros(4, dtype=cov.dtype), cov)
    sign, logabsdet = torch.linalg.slogdet(cov)
    solved = torch.linalg.solve_triangular(cov, x[:, :4].T, upper=False)
    return [base.log_prob(x[:, :4]), sign * logabsdet, solved]


def _rounded_back(x: torch.Tensor) -> list[torch.Tensor]:
    """Computed in fp32, returned in the model's dtype: the matrix exponential (parametrizations.orthogonal's
    default map; its half kernel returns NaN), an L2 normalisation's norm, the spectral norm."""
    return [torch.linalg.matrix_exp(x[:4, :4]), torch.linalg.norm(x, dim=-1),
            torch.linalg.matrix_norm(x[:4, :4], ord=2)]


@pytest.mark.parametrize("arithmetic", ["emulated", "native"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ffts_and_linear_algebra_compute_in_fp32_as_torch_autocast_computes_them(
    arithmetic: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FFTs and cholesky have no half kernel on the CPU: in O2 and to_fp16() an FNet's fft2 raised
    "Unsupported dtype Half" and a flow's MultivariateNormal base "cholesky_cpu not implemented for
    'Half'", where torch.autocast (whose CPU table lists them fp32) ran. Same half inputs: torch.autocast's
    results and dtypes; the solvers its table leaves out: the fp32 results of the same inputs."""
    monkeypatch.setenv("MIXPREC_HALF_ARITHMETIC", f"cpu:{arithmetic}")
    torch.manual_seed(0)
    x = torch.randn(6, 16).to(dtype)
    cov = (torch.eye(4) * 2 + 0.3).to(dtype)
    with torch.autocast("cpu", dtype=dtype):
        expected = _listed_by_torch(x, cov)
    expected += _not_listed(x.float(), cov.float())
    with half_compute("cpu", dtype):
        got = _listed_by_torch(x, cov) + _not_listed(x, cov)
        rounded = _rounded_back(x)
    assert [t.dtype for t in got] == [t.dtype for t in expected] == [torch.float32] * 7
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    for g, e in zip(rounded, _rounded_back(x.float()), strict=True):
        assert g.dtype is dtype and torch.equal(g, e.to(dtype))  # a review: linalg.norm had turned fp32


@pytest.mark.parametrize("arithmetic", ["emulated", "native"])
def test_attentions_fp32_bias_and_an_out_tensor_are_kept_as_torch_keeps_them(
    arithmetic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review: an fp32 ALiBi-like bias of ~300 beside bf16 q, k, v was rounded to bf16 (outputs off by
    0.7 where torch's own kernel, which takes the fp32 mask as it is, is off by 0.005), and an op's out=
    tensor was computed into an fp32 copy of it, never written."""
    monkeypatch.setenv("MIXPREC_HALF_ARITHMETIC", f"cpu:{arithmetic}")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16).to(torch.bfloat16) for _ in range(3))
    pos = torch.arange(32, dtype=torch.float32)
    bias = (-(pos[:, None] - pos[None, :]).abs() * 0.37 + 300.0).expand(1, 2, 32, 32)
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias)
    torchs = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    x, y = torch.randn(4), torch.empty(4, dtype=torch.bfloat16)
    with half_compute("cpu", torch.bfloat16):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        written = torch.exp(x, out=y)
    bound = 2 * (torchs.float() - reference).abs().max().item()
    assert (out.float() - reference).abs().max().item() <= bound
    assert written is y and torch.equal(y, x.exp().to(torch.bfloat16))
