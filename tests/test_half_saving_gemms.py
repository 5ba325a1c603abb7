"""mixprec.half_saving_gemms: emulated linear, matrix products and convolutions save half activations as
they are, and compute exactly what the generic emulation computes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import half_saving_gemms, hardware
from mixprec.emulation import emulated
from mixprec.half_compute import half_compute

HALF = [torch.bfloat16, torch.float16]
pytestmark = pytest.mark.usefixtures("half_saving_any_size")  # small GEMMs (FEW_ACTIVATIONS: tested below)




def _generic(func: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    return lambda *args, **kwargs: func(*args, **kwargs)  # not func itself: emulated()'s generic path


def _activation(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(a half activation, not a leaf; the fp32 leaf it comes from)."""
    leaf = torch.randn(*shape, requires_grad=True)
    return leaf.to(dtype).relu(), leaf


def _half_param(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape).to(dtype).requires_grad_()


Case = tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...], dict[str, Any], list[torch.Tensor]]


def _case(form: str, dtype: torch.dtype) -> Case:
    """(function, arguments, keyword arguments, the leaves whose gradients to compare) for one way a model
    calls a GEMM."""
    torch.manual_seed(3)
    if form == "linear, half model":  # O2: a half activation (not a leaf) and half parameters
        x, leaf = _activation((4, 5, 16), dtype)
        w, b = _half_param(6, 16, dtype=dtype), _half_param(6, dtype=dtype)
        return F.linear, (x, w, b), {}, [leaf, w, b]
    w = torch.randn(6, 16, requires_grad=True)
    if form == "linear, fp32 input, no bias":  # O1: autocast rounds an fp32 activation
        x = torch.randn(8, 16, requires_grad=True)
        return F.linear, (x, w), {}, [x, w]
    if form == "linear, data input":  # no input gradient
        b = torch.randn(6, requires_grad=True)
        return F.linear, (torch.randn(8, 16), w, b), {}, [w, b]
    if form == "matmul, attention scores":  # q @ k^T of half activations, 4-d
        (q, lq), (k, lk) = _activation((2, 3, 5, 8), dtype), _activation((2, 3, 5, 8), dtype)
        return torch.matmul, (q, k.transpose(-2, -1)), {}, [lq, lk]
    if form == "bmm, activation times parameter":  # a half parameter is saved as its fp32 upcast
        (a, la), p = _activation((3, 5, 8), dtype), _half_param(3, 8, 4, dtype=dtype)
        return torch.bmm, (a, p), {}, [la, p]
    if form == "conv2d, half model":  # O2 CNN: strided, padded, grouped, with bias
        (x, leaf), w2 = _activation((2, 4, 9, 9), dtype), _half_param(6, 2, 3, 3, dtype=dtype)
        b2 = _half_param(6, dtype=dtype)
        return F.conv2d, (x, w2, b2), {"stride": 2, "padding": 1, "groups": 2}, [leaf, w2, b2]
    if form == "conv1d, fp32 input":  # O1: autocast rounds an fp32 activation; dilation, no bias
        x, w1 = torch.randn(2, 3, 12, requires_grad=True), torch.randn(5, 3, 3, requires_grad=True)
        return F.conv1d, (x, w1), {"dilation": 2}, [x, w1]
    if form == "conv_transpose2d, half model":  # a UNet's upsampling: strided, output_padding, grouped, bias
        (x, leaf), wt = _activation((2, 4, 5, 5), dtype), _half_param(4, 3, 3, 3, dtype=dtype)
        bt = _half_param(6, dtype=dtype)
        geometry = {"stride": 2, "padding": 1, "output_padding": 1, "groups": 2}
        return F.conv_transpose2d, (x, wt, bt), geometry, [leaf, wt, bt]
    if form == "conv_transpose1d, fp32 input, positional":  # (input, weight, bias, stride, padding,
        # output_padding, groups, dilation): dilation last, unlike conv1d
        x, w1 = torch.randn(2, 3, 6, requires_grad=True), torch.randn(3, 4, 3, requires_grad=True)
        return F.conv_transpose1d, (x, w1, None, 2, 0, 1, 1, 2), {}, [x, w1]
    if form == "matmul, matrix times vector":  # not a product of matrices: the generic path
        (a, la), (v, lv) = _activation((5, 16), dtype), _activation((16,), dtype)
        return torch.matmul, (a, v), {}, [la, lv]
    if form == "matmul, broadcast batch":  # a 3-d stack times one matrix: the generic path
        (a, la), p = _activation((3, 5, 16), dtype), _half_param(16, 4, dtype=dtype)
        return torch.matmul, (a, p), {}, [la, p]
    x = torch.randn(8, 16, requires_grad=True)  # "mm, fp32": O1's rounding of fp32 operands
    return torch.mm, (x, w.t()), {}, [x, w]


FORMS = ["linear, half model", "linear, fp32 input, no bias", "linear, data input",
         "matmul, attention scores", "bmm, activation times parameter", "mm, fp32", "conv2d, half model",
         "conv1d, fp32 input", "conv_transpose2d, half model", "conv_transpose1d, fp32 input, positional",
         "matmul, matrix times vector", "matmul, broadcast batch"]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("form", FORMS)
def test_emulated_gemms_that_save_half_inputs_equal_the_generic_emulation(
    form: str, dtype: torch.dtype
) -> None:
    results = []
    for wrap in (lambda f: f, _generic):
        func, args, kwargs, leaves = _case(form, dtype)
        out = emulated(wrap(func), args, kwargs, dtype)
        out.backward(torch.randn_like(out, dtype=torch.float32, generator=torch.Generator().manual_seed(4)))
        results.append([out, *(t.grad for t in leaves)])
    for ours, generic in zip(*results, strict=True):
        assert ours is not None and generic is not None and ours.dtype == generic.dtype
        torch.testing.assert_close(ours, generic, rtol=0, atol=0)


def _saved_storages(
    func: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...], kwargs: dict[str, Any],
    dtype: torch.dtype,
) -> dict[int, torch.dtype]:
    saved: dict[int, torch.dtype] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.dtype
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        emulated(func, args, kwargs, dtype)
    return saved


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("form", "half_inputs"), [("linear, half model", 1), ("matmul, attention scores", 2),
                                                   ("bmm, activation times parameter", 1),
                                                   ("conv2d, half model", 1),
                                                   ("conv_transpose2d, half model", 1)])
def test_emulated_gemms_save_half_inputs_not_their_fp32_copies(
    form: str, half_inputs: int, dtype: torch.dtype
) -> None:
    func, args, kwargs, _ = _case(form, dtype)
    activations = {t.untyped_storage().data_ptr() for t in args[:half_inputs]}
    ours = _saved_storages(func, args, kwargs, dtype)
    generic = _saved_storages(_generic(func), args, kwargs, dtype)
    assert activations <= ours.keys() and not activations & generic.keys()  # generic: their fp32 upcasts
    # A parameter's fp32 upcast is saved by both (made once per region, not again in backward).
    fp32 = [sum(d is torch.float32 for d in saved.values()) for saved in (ours, generic)]
    assert fp32[0] == fp32[1] - half_inputs


@pytest.mark.parametrize("dtype", HALF)
def test_gemms_of_few_activations_take_the_generic_path(monkeypatch: pytest.MonkeyPatch,
                                                        dtype: torch.dtype) -> None:
    """The half-saving functions cost Python time a call (a neural ODE's tiny GEMMs ran its step 1.4x the
    generic path's) and save bytes that do not matter at that size: below FEW_ACTIVATIONS activation
    elements, autograd's own ops run, with the same values."""
    results = []
    for few in (321, 320):  # the case's activation: 4x5x16 = 320 elements
        monkeypatch.setattr(half_saving_gemms, "FEW_ACTIVATIONS", few)
        func, args, kwargs, leaves = _case("linear, half model", dtype)
        saved = _saved_storages(func, args, kwargs, dtype)
        assert (args[0].untyped_storage().data_ptr() in saved) is (few == 320)  # the half activation itself
        assert sum(d is torch.float32 for d in saved.values()) == (2 if few == 321 else 1)  # + its upcast
        out = emulated(func, args, kwargs, dtype)
        out.backward(torch.ones_like(out, dtype=torch.float32))
        results.append([out, *(t.grad for t in leaves)])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---- memory: a half model's activations are saved in half, as with native kernels ----------------------


def _saved_activation_bytes(model: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> int:
    """Bytes of the batch-sized tensors autograd saves in one forward (weight copies excluded by shape)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() and t.shape[0] == x.shape[0]:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with half_compute("cpu", dtype), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(saved.values())


@pytest.mark.parametrize("dtype", HALF)
def test_an_emulated_half_mlp_saves_what_native_half_kernels_save(
    arithmetic: Callable[[str], None], dtype: torch.dtype
) -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10)).to(dtype)
    x = torch.randn(8, 64).to(dtype)
    arithmetic("native")
    native = _saved_activation_bytes(model, x, dtype)
    arithmetic("emulated")
    # Linear 1 saves x and Linear 2 the ReLU's output (which ReLU saves anyway) as they are, in half; the
    # generic emulation saved their fp32 upcasts as well (4352 bytes here, not 1792)
    assert _saved_activation_bytes(model, x, dtype) == native == (8 * 64 + 8 * 48) * 2


@pytest.mark.parametrize("dtype", HALF)
def test_an_emulated_half_cnn_saves_what_native_half_kernels_save(
    arithmetic: Callable[[str], None], dtype: torch.dtype
) -> None:
    torch.manual_seed(6)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 5, 3, stride=2)).to(dtype)
    x = torch.randn(8, 3, 9, 9).to(dtype)
    arithmetic("native")
    native = _saved_activation_bytes(model, x, dtype)
    arithmetic("emulated")
    assert _saved_activation_bytes(model, x, dtype) == native == (8 * 3 * 81 + 8 * 4 * 81) * 2


@pytest.mark.parametrize(("func", "shapes"),
                         [(torch.mm, ((2, 3, 4), (2, 4, 5))), (torch.bmm, ((3, 4), (4, 5)))])
def test_calls_torch_refuses_are_refused_as_torch_refuses_them(
    func: Callable[..., torch.Tensor], shapes: tuple[tuple[int, ...], ...]
) -> None:
    args = tuple(torch.randn(*s) for s in shapes)
    with pytest.raises(RuntimeError) as theirs:
        func(*args)
    with pytest.raises(RuntimeError) as ours:
        emulated(func, args, {}, torch.bfloat16)
    assert str(ours.value) == str(theirs.value)


# ---- attention: the CPU flash kernel on half q, k, v ----------------------------------------------------


def _attention_case(dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
    """Half q, k, v activations (B, H, T, E) and the fp32 leaves they come from."""
    torch.manual_seed(3)
    pairs = [_activation((2, 3, 7, 8), dtype) for _ in range(3)]
    return tuple(p[0] for p in pairs), [p[1] for p in pairs]


def _attend(func: Callable[..., torch.Tensor], dtype: torch.dtype, **kwargs: Any) -> list[torch.Tensor]:
    args, leaves = _attention_case(dtype)
    out = emulated(func, args, kwargs, dtype)
    out.backward(torch.randn_like(out, dtype=torch.float32, generator=torch.Generator().manual_seed(4)))
    return [out, *(t.grad for t in leaves)]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"is_causal": True, "scale": 0.5}])
def test_emulated_attention_equals_the_generic_emulation_up_to_its_half_output(
    dtype: torch.dtype, kwargs: dict[str, Any]
) -> None:
    """The same fp32 kernel on the same upcasts: the output and v's gradient bit for bit. q's and k's
    gradients read the output, which backward now reads rounded to half (as torch's half kernel reads its
    own): within one rounding of the half format at their scale."""
    ours = _attend(F.scaled_dot_product_attention, dtype, **kwargs)
    generic = _attend(_generic(F.scaled_dot_product_attention), dtype, **kwargs)
    assert ours[0].dtype is dtype
    assert torch.equal(ours[0], generic[0]) and torch.equal(ours[3], generic[3])
    eps = torch.finfo(dtype).eps
    for a, b in zip(ours[1:3], generic[1:3], strict=True):
        torch.testing.assert_close(a, b, rtol=eps, atol=eps * b.abs().max().item())


@pytest.mark.parametrize("dtype", HALF)
def test_emulated_attention_is_torchs_half_kernel_within_a_rounding(dtype: torch.dtype) -> None:
    ours = _attend(F.scaled_dot_product_attention, dtype, is_causal=True)
    native = _attention_case(dtype)
    out = F.scaled_dot_product_attention(*native[0], is_causal=True)  # torch's own half CPU kernel
    out.backward(torch.randn_like(out, dtype=torch.float32, generator=torch.Generator().manual_seed(4)))
    eps = torch.finfo(dtype).eps
    for a, b in zip(ours, [out, *(t.grad for t in native[1])], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 * eps, atol=2 * eps * b.abs().max().item())


@pytest.mark.parametrize("kwargs", [{}, {"dropout_p": 0.0, "is_causal": True}])
def test_emulated_attention_saves_half_q_k_v_and_output_not_fp32_copies(
    kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The generic path saved the fp32 upcasts of q, k, v and the fp32 output: twice a half kernel's
    bytes (a ViT's emulated bf16 step kept ~88% of fp32's activations, a user trial). At any size: its q
    and k gradients are not the generic path's, and must not change with the batch (FEW_ACTIVATIONS)."""
    monkeypatch.setattr(half_saving_gemms, "FEW_ACTIVATIONS", 1 << 30)
    dtype = torch.bfloat16
    args, _ = _attention_case(dtype)
    half_inputs = {t.untyped_storage().data_ptr() for t in args}
    for func in (F.scaled_dot_product_attention, _generic(F.scaled_dot_product_attention)):
        saved = _saved_storages(func, args, kwargs, dtype)
        fp32 = sum(d is torch.float32 for d in saved.values())
        if func is F.scaled_dot_product_attention:  # q, k, v, the output; fp32: the logsumexp, (B, H, T)
            assert half_inputs <= saved.keys() and (len(saved), fp32) == (5, 1)
        else:  # the fp32 upcasts of q, k, v, the fp32 output and logsumexp
            assert not half_inputs & saved.keys() and (len(saved), fp32) == (5, 5)


@pytest.mark.parametrize("kwargs", [{"attn_mask": torch.zeros(7, 7)}, {"dropout_p": 0.5}])
def test_attention_forms_the_flash_kernel_does_not_take_stay_generic(kwargs: dict[str, Any]) -> None:
    args, _ = _attention_case(torch.bfloat16)
    saved = _saved_storages(F.scaled_dot_product_attention, args, kwargs, torch.bfloat16)
    assert not {t.untyped_storage().data_ptr() for t in args} & saved.keys()


def _fp32_activation_case(form: str) -> tuple[Case, torch.Tensor]:
    """(a call with an fp32 activation first, the leaf that activation comes from)."""
    torch.manual_seed(7)
    leaf = torch.randn(4, 6, 16, requires_grad=True)
    x = leaf * 1.5  # an fp32 activation: not a leaf
    if form == "linear":
        return (F.linear, (x, torch.randn(8, 16, requires_grad=True)), {}, [leaf]), leaf
    if form == "conv1d":
        return (F.conv1d, (x, torch.randn(5, 6, 3, requires_grad=True)), {"padding": 1}, [leaf]), leaf
    return (torch.matmul, (x, torch.randn(4, 16, 3)), {}, [leaf]), leaf  # matmul: no weight


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("form", ["linear", "conv1d", "matmul"])
def test_an_fp32_activation_is_saved_as_its_half_rounding(form: str, dtype: torch.dtype) -> None:
    """O1: an fp32 activation (a LayerNorm's output, the input batch) was saved as its rounded fp32 copy,
    twice a native half kernel's bytes. Now its half cast is saved (the generic rounding's own first cast),
    with the same results bit for bit."""
    counts = []
    for wrap in (lambda f: f, _generic):
        (func, args, kwargs, _), _ = _fp32_activation_case(form)
        saved = _saved_storages(wrap(func), args, kwargs, dtype)
        assert args[0].untyped_storage().data_ptr() not in saved  # neither saves the fp32 activation
        dtypes = list(saved.values())
        counts.append((dtypes.count(dtype), dtypes.count(torch.float32)))
    # generic: the activation's rounded fp32 copy; now its half cast in its place, nothing else changed
    assert counts[0] == (counts[1][0] + 1, counts[1][1] - 1)
    results = []
    for wrap in (lambda f: f, _generic):
        (func, args, kwargs, _), leaf = _fp32_activation_case(form)
        out = emulated(wrap(func), args, kwargs, dtype)
        out.float().square().sum().backward()
        results.append((out, leaf.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


# ---- torch.func -------------------------------------------------------------------------------------------


class _FuncNet(nn.Module):
    """A convolution, a ReLU, linears, a causal attention and matrix products: every autograd function of
    the emulated path (the attention's where no vmap batches it)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.qkv, self.out = nn.Conv1d(2, 4, 3, padding=1), nn.Linear(4, 12), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(x)).transpose(1, 2)
        q, k, v = self.qkv(h).unsqueeze(1).chunk(3, -1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1)
        return self.out(a @ a.transpose(1, 2) @ h).mean(1)


@pytest.fixture
def func_net(monkeypatch: pytest.MonkeyPatch) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    monkeypatch.setenv(hardware.ENV_VAR, "cpu:emulated")  # both half dtypes through the emulated path
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return _FuncNet(), torch.randn(4, 2, 5, generator=g), torch.randint(0, 3, (4,), generator=g)


@pytest.mark.parametrize("dtype", HALF)
def test_torch_func_grad_and_vmap_give_the_gradients_backward_gives(
    func_net: tuple[nn.Module, torch.Tensor, torch.Tensor], dtype: torch.dtype
) -> None:
    """torch.func's transforms (per-sample gradients with vmap(grad), MAML-style functional_call) raised
    "an autograd.Function ... must override the setup_context staticmethod" under every interface on a
    CPU without half units. Inside them the emulated GEMMs take their generic path (plain ops, which
    compose with every transform: mixprec.func_transforms): backward's gradients within a half rounding
    (the generic attention reads an fp32 output where the half-saving one reads its half rounding)."""
    net, x, y = func_net
    params = {name: p.detach() for name, p in net.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(torch.func.functional_call(net, p, (xi[None],)).float(), yi[None])

    with mixprec.autocast("cpu", dtype):
        per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
        for i in range(len(x)):
            one = torch.func.grad(loss)(params, x[i], y[i])
            net.zero_grad()
            loss(dict(net.named_parameters()), x[i], y[i]).backward()
            for name, p in net.named_parameters():
                bound = 4 * torch.finfo(dtype).eps * p.grad.abs().max().item()
                torch.testing.assert_close(one[name], p.grad, rtol=0, atol=bound)
                torch.testing.assert_close(per_sample[name][i], p.grad, rtol=0, atol=bound)


@pytest.mark.parametrize("dtype", HALF)
def test_torch_func_jvp_is_the_fp32_tangent_within_half_roundings(
    func_net: tuple[nn.Module, torch.Tensor, torch.Tensor], dtype: torch.dtype
) -> None:
    """Forward-mode AD (jvp, jacfwd) raised "You must implement the jvp function". The tangent is fp32's
    within a few roundings to the half dtype, and jacrev's Jacobian times the same direction. (torch's
    CPU flash attention has no forward AD, in fp32 either: both run its math kernel.)"""
    net, x, _ = func_net
    direction = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    def math_attention() -> Any:
        return torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)

    with mixprec.autocast("cpu", dtype), math_attention():
        _, tangent = torch.func.jvp(net, (x,), (direction,))
        jacobian = torch.func.jacrev(net)(x)
    with math_attention():
        _, fp32 = torch.func.jvp(net, (x,), (direction,))
    assert tangent.dtype is dtype  # the output's dtype, as torch's own half ops give it
    bound = 8 * torch.finfo(dtype).eps * fp32.abs().max().item()
    torch.testing.assert_close(tangent.float(), fp32, rtol=0, atol=bound)
    torch.testing.assert_close(tangent.float(), torch.einsum("abcde,cde->ab", jacobian.float(), direction),
                               rtol=0, atol=2 * bound)
