"""mixprec.autocast: op-by-op parity with torch.autocast, policies, cast cache, emulated fp16 GEMMs."""

from __future__ import annotations

import collections
import contextlib
import importlib
import importlib.util
import types
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import load_torch_autocast_lists
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import mixprec.errors
from mixprec import hardware
from mixprec import policy as P
from mixprec.autocast import AutocastError, BannedOpError, autocast, keep_fp32, release_fp32
from mixprec.region import STATE

# mixprec.autocast (the attribute) is the context manager; the engine module is reached through sys.modules
A = importlib.import_module("mixprec.autocast")

HALF = [torch.bfloat16, torch.float16]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _clean_registry(clean_registry: None) -> None:
    """Every test here starts and ends without global registrations."""


# ---- parity with torch.autocast over torch's own CPU op lists ------------------------------------------




Call = tuple[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _variants(op: str, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Call]:
    # Like torch's own harness: the module function and the Tensor method, where each exists.
    calls: list[Call] = []
    if module is not None and hasattr(module, op):
        calls.append((f"{module.__name__}.{op}", getattr(module, op), args, kwargs))
    if hasattr(torch.Tensor, op) and isinstance(args[0], torch.Tensor):
        calls.append((f"Tensor.{op}", getattr(torch.Tensor, op), args, kwargs))
    return calls


def _cpu_calls(dtype: torch.dtype) -> list[Call]:
    with torch.random.fork_rng(devices=[]):  # the lists draw random tensors: leave the global RNG alone
        lists = load_torch_autocast_lists().AutocastCPUTestLists("cpu")
    which = 1 if dtype is torch.bfloat16 else 2  # promote lists carry (bf16 args, fp16 args)
    calls: list[Call] = []
    by_module = ((torch, lists.torch_16 + lists.torch_fp32), (torch._C._nn, lists.nn_16 + lists.nn_fp32))
    for module, entries in by_module:
        for op, args, *rest in entries:
            calls += _variants(op, module, args, rest[0] if rest else {})
    for op, *args_by_dtype in lists.torch_need_autocast_promote + lists.torch_expect_builtin_promote:
        calls += _variants(op, torch, args_by_dtype[which - 1], {})
    for op, *args_by_dtype in lists.methods_expect_builtin_promote:
        calls += _variants(op, None, args_by_dtype[which - 1], {})
    return calls


def _dtypes(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, (list, tuple)):
        return tuple(_dtypes(v) for v in value)
    return type(value).__name__


@pytest.mark.parametrize("dtype", HALF)
def test_output_dtypes_match_torch_autocast_op_by_op(dtype: torch.dtype) -> None:
    calls = _cpu_calls(dtype)
    assert len(calls) > 60
    mismatches = []
    checked_lower = 0
    for label, fn, args, kwargs in calls:
        rule = P.TORCH.rule(fn, "cpu", dtype)
        if rule is not None and rule.is_deviation:
            continue  # documented deviations are tested on their own below
        with torch.autocast("cpu", dtype=dtype):
            expected = _dtypes(fn(*args, **kwargs))
        with autocast("cpu", dtype=dtype):
            got = _dtypes(fn(*args, **kwargs))
        if got != expected:
            mismatches.append((label, expected, got))
        checked_lower += rule is not None and rule.action is P.Action.LOWER
    assert not mismatches
    assert checked_lower >= 15  # the GEMM family, which fp16 emulation reroutes, was really exercised


@pytest.mark.parametrize("dtype", HALF)
def test_every_python_handler_matches_torch_autocast_op_by_op(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The layer normally handles only the ops whose action differs from torch's, so the test above meets
    # the FP32 and PROMOTE handlers rarely. Told that torch's own table is empty, the layer takes every op
    # of the table and must still give what torch.autocast gives.
    from mixprec import cast_plan
    from mixprec.policy import cast_policy

    monkeypatch.setattr(cast_policy, "_torch_rules_for", lambda device_type, dtype: {})
    monkeypatch.setattr(cast_plan, "_PLANS", {})
    monkeypatch.setattr(cast_plan, "_REGIONS", {})
    handled = collections.Counter()
    mismatches = []
    for label, fn, args, kwargs in _cpu_calls(dtype):
        rule = P.TORCH.rule(fn, "cpu", dtype)
        if rule is None or rule.is_deviation:
            continue
        with torch.autocast("cpu", dtype=dtype):
            expected = _dtypes(fn(*args, **kwargs))
        with autocast("cpu", dtype=dtype):
            assert torch._C._len_torch_function_stack() == 1  # the Python layer runs this op
            got = _dtypes(fn(*args, **kwargs))
        if got != expected:
            mismatches.append((label, expected, got))
        handled[rule.action] += 1
    assert not mismatches
    assert min(handled[a] for a in (P.Action.LOWER, P.Action.FP32, P.Action.PROMOTE)) >= 2, handled


def test_default_policy_adds_no_python_layer_for_bf16() -> None:
    with autocast("cpu", torch.bfloat16):
        assert torch._C._len_torch_function_stack() == 0
        assert A.current_region() is not None and A.current_region().actions == {}
    with autocast("cpu", torch.float16):  # fp16 on CPU: emulation needs the layer
        assert torch._C._len_torch_function_stack() == 1
    assert A.current_region() is None


# ---- policies and registrations -------------------------------------------------------------------------


def test_registrations_change_the_dtype() -> None:
    x32 = torch.randn(4, 4)
    x16 = x32.bfloat16()
    P.register_float_function(F, "gelu")
    P.register_float_function(torch, "exp")
    P.register_half_function(torch, "prod")
    P.register_promote_function(torch, "mm")
    for region, expect in ((torch.autocast, "torch"), (autocast, "mixprec")):
        with region("cpu", dtype=torch.bfloat16):
            got = (F.gelu(x16), x16.exp(), torch.exp(x16), torch.prod(x32, 0), torch.mm(x32, x16))
        dtypes = [t.dtype for t in got]
        if expect == "torch":  # what torch's tables do, unaware of the registrations
            assert dtypes == [torch.bfloat16] * 3 + [torch.float32, torch.bfloat16]
        else:
            assert dtypes == [torch.float32] * 3 + [torch.bfloat16, torch.float32]


def test_registered_functions_run_with_autocast_off_inside() -> None:
    seen: list[bool] = []

    @P.register_float_function
    def my_loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seen.append(torch.is_autocast_enabled("cpu"))
        return (a @ b).sum()

    @P.register_half_function
    def my_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b

    a, b = torch.randn(3, 3), torch.randn(3, 3).bfloat16()
    with autocast("cpu", torch.bfloat16):
        assert my_loss(a, b).dtype == torch.float32
        assert my_gemm(a, a).dtype == torch.bfloat16
    with torch.autocast("cpu", torch.bfloat16):  # registrations also apply under plain torch.autocast
        assert my_loss(a, b).dtype == torch.float32
    with autocast("cpu", torch.float16):  # half function on a CPU: emulated, result rounded to fp16
        out = my_gemm(a, a)
        assert out.dtype == torch.float16
    assert seen == [False, False]
    assert my_loss(a, b.float()).dtype == torch.float32  # outside a region: untouched


def test_registration_on_a_user_module_wraps_the_attribute() -> None:
    lib = types.ModuleType("mylib")
    lib.scale = lambda x: x * 2  # type: ignore[attr-defined]
    P.register_float_function(lib, "scale")
    with autocast("cpu", torch.bfloat16):
        assert lib.scale(torch.ones(2, dtype=torch.bfloat16)).dtype == torch.float32  # type: ignore[attr-defined]


def test_policy_argument_takes_effect() -> None:
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)
    with autocast("cpu", torch.bfloat16, policy=P.TORCH.with_fp32("linear")):
        assert lin(x).dtype == torch.float32
    with autocast("cpu", torch.bfloat16, policy=P.APEX):
        y = lin(x)
        assert y.dtype == torch.bfloat16
        assert F.softmax(y, -1).dtype == torch.float32
        assert F.cross_entropy(y, torch.tensor([0, 1])).dtype == torch.float32


class Head(nn.Linear):
    pass


@pytest.mark.parametrize("region", [torch.autocast, autocast], ids=["torch", "mixprec"])
def test_keep_fp32_runs_a_module_in_fp32(region: Callable[..., Any]) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    keep_fp32(model[2])
    hidden: list[torch.Tensor] = []
    model[0].register_forward_hook(lambda m, i, o: hidden.append(o))
    x = torch.randn(3, 4)
    with region("cpu", dtype=torch.bfloat16):
        out = model(x)
        assert torch.is_autocast_enabled("cpu")  # restored after the fp32 module
    assert hidden[0].dtype == torch.bfloat16 and out.dtype == torch.float32
    ref = model[2](model[1](hidden[0].float()))  # the head's math in plain fp32
    torch.testing.assert_close(out, ref)
    release_fp32(model[2])
    with region("cpu", dtype=torch.bfloat16):
        assert model(x).dtype == torch.bfloat16


def test_policy_fp32_modules_by_class_name() -> None:
    model = nn.Sequential(nn.Linear(4, 8), Head(8, 2))
    policy = P.TORCH.with_fp32_modules("Head")
    with autocast("cpu", torch.bfloat16, policy=policy):
        assert model(torch.randn(3, 4)).dtype == torch.float32
    with autocast("cpu", torch.bfloat16):
        assert model(torch.randn(3, 4)).dtype == torch.bfloat16


@pytest.mark.parametrize("loss", [lambda p, t: F.binary_cross_entropy(p, t), nn.BCELoss()])
def test_banned_op_raises_and_names_the_fix(loss: Callable[..., Any]) -> None:
    p, t = torch.rand(4), torch.rand(4)
    with pytest.raises(BannedOpError, match="BCEWithLogitsLoss"), autocast("cpu", torch.float16):
        loss(p, t)
    with autocast("cpu", torch.bfloat16):  # torch's CPU table (fp32) applies: no Python layer for bf16
        assert loss(p, t).dtype == torch.float32


# ---- cast cache -----------------------------------------------------------------------------------------


class CountCasts(TorchDispatchMode):
    """Counts casts of one given tensor (aten._to_copy: the emulation's eager rounding is one too)."""

    def __init__(self, source: torch.Tensor) -> None:
        super().__init__()
        self.source = source
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._to_copy.default and args[0] is self.source:
            self.count += 1
        return func(*args, **(kwargs or {}))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):  # one weight, three uses per forward
            x = torch.relu(self.lin(x))
        return x


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("cache_enabled", [True, False])
def test_one_cast_per_weight_per_region(dtype: torch.dtype, cache_enabled: bool) -> None:
    model, x = Tied(), torch.randn(2, 8)
    with CountCasts(model.lin.weight) as counter:
        for _ in range(2):  # two regions: the cache is released at exit, so each region casts again
            with autocast("cpu", dtype, cache_enabled=cache_enabled):
                model(x).float().sum().backward()
            assert len(STATE.cache) == 0
    assert counter.count == (2 if cache_enabled else 6)


def test_cache_sees_in_place_updates() -> None:
    lin, x = nn.Linear(4, 4, bias=False), torch.ones(1, 4)
    with autocast("cpu", torch.float16):
        before = lin(x)
        with torch.no_grad():
            lin.weight.add_(1.0)
        after = lin(x)
    torch.testing.assert_close(after.float() - before.float(), torch.full((1, 4), 4.0), atol=1e-2, rtol=0)


# ---- nesting, enabled=False, decorator ------------------------------------------------------------------


def _nested_trace(region: Callable[..., Any]) -> list[tuple[bool, torch.dtype]]:
    lin, other, x = nn.Linear(4, 4), nn.Linear(4, 4), torch.randn(2, 4)
    trace = []

    def probe(module: nn.Module = lin) -> None:
        trace.append((torch.is_autocast_enabled("cpu"), module(x).dtype))

    with region("cpu", dtype=torch.bfloat16):
        probe()
        with region("cpu", enabled=False):
            probe()
            # another module: torch's cast cache is keyed by tensor only, so torch itself would hand the
            # bf16 weight cast from the outer region to this fp16 region (and fail on mixed dtypes)
            with region("cpu", dtype=torch.float16):
                probe(other)
            probe()
        probe()
    probe()
    return trace


def test_nesting_and_enabled_false_behave_as_in_torch() -> None:
    expected = _nested_trace(torch.autocast)
    assert _nested_trace(autocast) == expected
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    assert [d for _, d in expected] == [bf16, fp32, fp16, fp32, bf16, fp32]


@pytest.mark.parametrize("setting", [{"enabled": "yes"}, {"enabled": 0}, {"enabled": None},
                                     {"cache_enabled": 0}])
def test_settings_that_are_not_bools_raise_typeerror_as_in_torch(setting: dict[str, object]) -> None:
    """torch raises TypeError on entering ("set_autocast_enabled(): argument 'enabled' (position 2) must
    be bool, not str"; not run here: its failed entry leaves the thread's autocast state changed); ours
    read "yes" as True and 0 as False."""
    with pytest.raises(TypeError, match="must be a bool"), autocast("cpu", **setting):  # type: ignore[arg-type]
        pass


def test_torch_enabled_false_inside_an_emulating_region_is_plain_fp32() -> None:
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)
    with autocast("cpu", torch.float16), torch.autocast("cpu", enabled=False):
        y = lin(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, lin(x), rtol=0, atol=0)


def test_autocast_as_decorator_is_reentrant() -> None:
    lin = nn.Linear(4, 4)

    @autocast("cpu", torch.bfloat16)
    def forward(x: torch.Tensor, depth: int) -> torch.Tensor:
        return lin(x) if depth == 0 else forward(lin(x).float(), depth - 1)

    assert forward(torch.randn(2, 4), 2).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu") and A.current_region() is None


# ---- backward -------------------------------------------------------------------------------------------


def _grad_dtypes(region: Callable[..., Any], dtype: torch.dtype) -> list[torch.dtype]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(4, 6, requires_grad=True)
    grads: list[torch.dtype] = []
    with region("cpu", dtype=dtype):
        hidden = model[0](x)
        hidden.register_hook(lambda g: grads.append(g.dtype))
        out = model[2](model[1](hidden))
        out.register_hook(lambda g: grads.append(g.dtype))
        loss = F.cross_entropy(out, torch.tensor([0, 1, 2, 0]))
    loss.backward()  # outside the region, as in a training loop
    return grads + [x.grad.dtype] + [p.grad.dtype for p in model.parameters()]


@pytest.mark.parametrize("dtype", HALF)
def test_backward_runs_in_the_dtypes_forward_chose(dtype: torch.dtype) -> None:
    expected = _grad_dtypes(torch.autocast, dtype)
    assert expected[:2] == [dtype, dtype]
    assert _grad_dtypes(autocast, dtype) == expected


# ---- emulated fp16 arithmetic ---------------------------------------------------------------------------


def _half_ulp(x: torch.Tensor) -> torch.Tensor:
    """Half the spacing of fp16 numbers at |x| (fp16 rounding error bound), in float64."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-14)))
    return 2.0 ** (exponent - 11)


def _assert_fp16_rounding_of(out: torch.Tensor, ref: torch.Tensor, slack: torch.Tensor) -> None:
    # out: an fp16 result; ref: the exact (float64) result of the fp16-rounded inputs; slack bounds fp32
    # accumulation error. out must be ref rounded to fp16, up to that slack.
    assert out.dtype == torch.float16
    err = (out.double() - ref).abs()
    bound = torch.maximum(_half_ulp(ref), _half_ulp(out.double())) + slack
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float((out.double() == ref.half().double()).double().mean()) > 0.95


def _r16(t: torch.Tensor) -> torch.Tensor:
    return t.half().double()


EMULATED: dict[str, tuple[Callable[..., torch.Tensor], Callable[[], tuple[torch.Tensor, ...]]]] = {
    "linear": (F.linear, lambda: (torch.randn(16, 32), torch.randn(24, 32), torch.randn(24))),
    "matmul": (torch.matmul, lambda: (torch.randn(3, 16, 32), torch.randn(32, 8))),
    "conv2d": (F.conv2d, lambda: (torch.randn(2, 3, 9, 9), torch.randn(5, 3, 3, 3), torch.randn(5))),
    "bmm": (torch.bmm, lambda: (torch.randn(2, 8, 16), torch.randn(2, 16, 4))),
}


@pytest.mark.parametrize("name", list(EMULATED))
def test_emulated_fp16_equals_float64_reference_to_fp16_rounding(name: str) -> None:
    fn, make = EMULATED[name]
    torch.manual_seed(1)
    inputs = make()
    with autocast("cpu", torch.float16):
        out = fn(*inputs)
    ref = fn(*(_r16(t) for t in inputs))
    # fp32 accumulation: each of K products adds at most 2**-24 relative error to a partial sum.
    slack = 64 * 2.0**-24 * fn(*(_r16(t).abs() for t in inputs))
    _assert_fp16_rounding_of(out, ref, slack)


@pytest.mark.parametrize("name", list(EMULATED))
def test_emulated_fp16_equals_torch_fp16_where_torch_is_exact(name: str) -> None:
    fn, make = EMULATED[name]
    torch.manual_seed(2)
    # small integers: products and sums are exact in fp32 and representable in fp16
    inputs = tuple(torch.randint(-3, 4, t.shape).float() for t in make())
    with torch.autocast("cpu", torch.float16):
        theirs = fn(*inputs)
    with autocast("cpu", torch.float16):
        ours = fn(*inputs)
    assert theirs.dtype == ours.dtype == torch.float16
    assert torch.equal(ours, theirs)
    assert torch.equal(ours.double(), fn(*(t.double() for t in inputs)))


def test_emulated_backward_is_fp16_gemm_with_fp32_accumulation() -> None:
    torch.manual_seed(3)
    x = torch.randn(16, 32, requires_grad=True)
    lin = nn.Linear(32, 24)
    g = torch.randn(16, 24)
    hidden_grads: list[torch.Tensor] = []
    with autocast("cpu", torch.float16):
        y = lin(x)
        y.register_hook(hidden_grads.append)
    (y.float() * g).sum().backward()
    (grad_y,) = hidden_grads
    assert grad_y.dtype == torch.float16  # the gradient that flows between ops is fp16, as in real fp16
    g16 = _r16(g)
    ref_x = g16 @ _r16(lin.weight)
    ref_w = g16.T @ _r16(x)
    for got, ref, k in ((x.grad, ref_x, 24), (lin.weight.grad, ref_w, 16)):
        assert got.dtype == torch.float32
        slack = k * 2.0**-24 * (g16.abs().sum() * ref.abs().max())
        _assert_fp16_rounding_of(got.half(), ref, slack)
        assert torch.equal(got.half().float(), got)  # values are fp16 numbers: an fp16 GEMM's output


def test_emulation_can_be_switched_off() -> None:
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)
    with autocast("cpu", torch.float16, policy=P.TORCH_NATIVE.with_emulate_fp16(False)):
        assert torch._C._len_torch_function_stack() == 0  # torch's own fp16 kernels, no Python layer
        assert lin(x).dtype == torch.float16


# ---- bad input ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device_type": "tpu"}, r"(?s)unknown device type 'tpu'.*use one of \['cpu', 'cuda'\]"),
        ({"device_type": "cuda:0"}, "'cuda', not 'cuda:0'"),
        ({"device_type": "cpu", "dtype": torch.int32}, "(?s)not one.*torch.bfloat16, torch.float16"),
        ({"device_type": "cpu", "dtype": torch.float64}, "(?s)does not support torch.float64.*enabled=False"),
        ({"device_type": "cpu", "dtype": "bf16"}, "must be a torch.dtype"),
        ({"device_type": "cpu", "policy": "torch"}, "get_preset"),
        ({"device_type": 0}, "use 'cpu' or 'cuda'"),
    ],
)
def test_bad_arguments_name_the_fix(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(AutocastError, match=match):
        autocast(**kwargs)


@pytest.mark.parametrize("enabled", [True, False])
def test_float32_region_is_what_torch_makes_of_it(enabled: bool) -> None:
    # issue 9: torch accepts dtype=float32; enabled=True warns and runs the region disabled.
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)
    seen: dict[str, tuple[torch.dtype, bool, bool]] = {}
    for name, region in (("torch", torch.autocast), ("mixprec", autocast)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with region("cpu", dtype=torch.float32, enabled=enabled):
                seen[name] = (lin(x).dtype, torch.is_autocast_enabled("cpu"), bool(caught))
    assert seen["mixprec"] == seen["torch"] == (torch.float32, False, enabled)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_a_disabled_region_accepts_any_dtype_as_torch_does(dtype: torch.dtype) -> None:
    with torch.autocast("cpu", dtype=dtype, enabled=False):
        pass  # the reference: torch accepts it
    with autocast("cpu", dtype=dtype, enabled=False):
        assert not torch.is_autocast_enabled("cpu")
        assert nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float32


@pytest.mark.parametrize("device_type", ["xpu", "mps", "cuda:0"])
def test_a_disabled_region_accepts_any_device_type_torch_knows(device_type: str) -> None:
    """Code written for several devices switches autocast off with enabled=False; mixprec refused every
    device but "cpu" and "cuda" even then."""
    made = {name: region(device_type, enabled=False) for name, region in (("torch", torch.autocast),
                                                                           ("mixprec", autocast))}
    assert made["mixprec"].fast_dtype == made["torch"].fast_dtype
    with autocast("cpu"), made["mixprec"]:
        assert torch.is_autocast_enabled("cpu")  # another device's switch leaves the CPU's as it was


def _cache_settings(region: Callable[..., Any]) -> tuple[bool, bool]:
    with region("cpu", cache_enabled=None):
        explicit_none = torch.is_autocast_cache_enabled()
    with region("cpu", cache_enabled=False), region("cpu"):
        inherited = torch.is_autocast_cache_enabled()
    return explicit_none, inherited


def test_cache_enabled_none_inherits_as_in_torch() -> None:
    """torch's default is None: the cache setting in force where the region is made. mixprec's was True,
    and None turned the cache off (bool(None)), so a stale cached cast could differ from torch's."""
    assert _cache_settings(autocast) == _cache_settings(torch.autocast) == (True, False)


def test_decorating_something_not_callable_is_a_type_error_as_in_torch() -> None:
    # torch 2.11's autocast returned a wrapper of the int, which failed only when called; 2.13 checks.
    regions = (torch.autocast, autocast) if torch.__version__ >= (2, 13) else (autocast,)
    for region in regions:
        with pytest.raises(TypeError):
            region("cpu")(3)


def test_banned_op_error_is_what_torch_and_apex_raised() -> None:
    # torch raises RuntimeError for its banned op; apex raised NotImplementedError for banned functions.
    assert issubclass(BannedOpError, RuntimeError) and issubclass(BannedOpError, NotImplementedError)
    assert mixprec.errors.BannedOpError is BannedOpError
    with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"), autocast("cpu", torch.float16):
        F.binary_cross_entropy(torch.rand(3), torch.rand(3))


def test_keep_fp32_rejects_non_modules() -> None:
    with pytest.raises(AutocastError, match="register_float_function"):
        keep_fp32(lambda x: x)  # type: ignore[arg-type]


# ---- CUDA -----------------------------------------------------------------------------------------------


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("dtype", HALF)
def test_cuda_default_policy_is_torch_autocast(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    # the suite's CPU arithmetic (fp16 emulated) would apply to the GPU too: this tests what is detected
    monkeypatch.delenv(hardware.ENV_VAR)
    lin, x = nn.Linear(8, 8).cuda(), torch.randn(4, 8, device="cuda")
    with contextlib.ExitStack() as stack:
        stack.enter_context(autocast("cuda", dtype))
        assert torch._C._len_torch_function_stack() == 0  # fast fp16 GEMMs: no emulation, no layer
        y = lin(x)
        assert y.dtype == dtype and F.softmax(y, -1).dtype == torch.float32
        with pytest.raises(RuntimeError, match="BCEWithLogitsLoss"):
            F.binary_cross_entropy(torch.rand(3, device="cuda"), torch.rand(3, device="cuda"))



def test_half_compute_writes_out_tensors() -> None:
    a, b = torch.randn(8, 16).half(), torch.randn(16, 4).half()
    out = torch.zeros(8, 4, dtype=torch.float16)
    with A.half_compute("cpu"):
        returned = torch.mm(a, b, out=out)
    assert returned is out
    torch.testing.assert_close(out, (a.double() @ b.double()).half(), rtol=1e-3, atol=1e-3)


def test_torch_export_of_an_o1_model_matches_eager_and_of_a_region_block_is_refused() -> None:
    """torch.export (non-strict) of an O1 model wrote a program returning fp16 where eager returned fp32,
    and of a ``with mixprec.autocast`` block followed by .float() one that failed its own dtype check when
    run. The model's region now exports as it runs; the block is refused, naming the ways out."""
    import mixprec

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    model = mixprec.initialize(model, opt_level="O1", dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(2, 8)
    exported = torch.export.export(model, (x,)).module()
    assert torch.equal(exported(x), model(x))

    class Block(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with autocast("cpu", dtype=torch.bfloat16):
                y = model[0](x)
            return y.float()

    with pytest.raises(AutocastError, match="initialize prepared"):
        torch.export.export(Block(), (x,))


def test_a_mode_compiled_code_entered_and_eager_code_runs_applies_the_policy_and_caches_nothing() -> None:
    """What a frame Dynamo runs eagerly sees inside a region entered by compiled code: torch's autocast and
    the policy's mode, with no eager region on the thread's stack. The mode applies the policy there (it
    stepped aside: not the innermost region, it judged) and fills no cast cache (nothing would clear it)."""
    P.register_float_function(torch, "mm")
    P.register_half_function(torch, "cumsum")  # the policy's Python layer casts the parameter
    weight = nn.Parameter(torch.randn(4, 4))
    torch_region, mode = autocast("cpu", torch.bfloat16).compiled_contexts()
    with torch_region, mode:  # as Dynamo restores them around a frame it runs eagerly
        kept = torch.mm(torch.randn(4, 4), weight)
        lowered = torch.cumsum(weight, 0)
    assert kept.dtype == torch.float32 and lowered.dtype == torch.bfloat16
    assert len(STATE.cache) == 0
    with autocast("cpu", torch.bfloat16):  # an eager region does cache the parameter's cast
        torch.cumsum(weight, 0)
        assert len(STATE.cache) == 1


def test_a_region_that_fails_to_enter_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error in the last step of entering (the fp32-module hooks) used to leave the region on the
    thread's stack and its mode on torch's: every later op ran under a region nobody had entered."""
    def refuse(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(A, "ModuleRules", refuse)
    region = autocast("cpu", torch.float16, policy=P.TORCH.with_fp32_modules(nn.Linear))
    with pytest.raises(KeyboardInterrupt):
        region.__enter__()
    assert STATE.regions == [] and STATE.entered_under == []
    assert torch.overrides._get_current_function_mode_stack() == []
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: torch enables the region")
def test_a_cuda_region_without_cuda_warns_where_it_is_made_as_torchs() -> None:
    """A user trial: torch warns once, at the line that makes the region; mixprec warned from its own file
    at every entry (a decorated function's every call), so Python's filter folded the user's call sites."""
    for make in (torch.autocast, autocast):
        with pytest.warns(UserWarning, match="CUDA is not available") as caught:
            region = make("cuda", dtype=torch.float16)
        assert [w.filename for w in caught] == [__file__]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with region:  # disabled, as torch's: no second warning
                assert not torch.is_autocast_enabled("cuda")


def _custom_functions() -> dict[str, type[torch.autograd.Function]]:
    """torch.amp.custom_fwd/custom_bwd as torch's docs use them: inputs cast to fp32 in the region, or left
    as they are with the region's state kept inside forward and backward."""

    class Fp32Inputs(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
        def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(a, b)
            return a.mm(b)

        @staticmethod
        @torch.amp.custom_bwd(device_type="cpu")
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = ctx.saved_tensors
            return grad.mm(b.t()), a.t().mm(grad)

    class KeepsRegion(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu")
        def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(a, b)
            return a.mm(b)  # cast by the region, which custom_fwd keeps on

        @staticmethod
        @torch.amp.custom_bwd(device_type="cpu")
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = ctx.saved_tensors
            return grad.mm(b.t()), a.t().mm(grad)  # in the forward's region: cast again

    return {"fp32 inputs": Fp32Inputs, "keeps the region": KeepsRegion}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["fp32 inputs", "keeps the region"])
def test_custom_fwd_and_custom_bwd_run_as_under_torch_autocast(kind: str, dtype: torch.dtype) -> None:
    function = _custom_functions()[kind]
    results = []
    for region in (torch.autocast, autocast):
        seeds = (torch.Generator().manual_seed(i) for i in (1, 2))
        a, b = (torch.randn(8, 8, generator=g, requires_grad=True) for g in seeds)
        with region("cpu", dtype=dtype):
            out = function.apply(a, b)
        out.float().sum().backward()
        assert a.grad is not None and b.grad is not None
        results.append((out, a.grad, b.grad))
    (want, *want_grads), (got, *got_grads) = results
    assert got.dtype == want.dtype
    # the same dtypes and values: fp16 here is emulated (fp32 accumulation, one rounding) where torch's CPU
    # kernel rounds on its own schedule, so values agree to the format's rounding
    tolerance = {"rtol": 2.0**-7, "atol": 2.0**-7} if want.dtype != torch.float32 else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(got, want, **tolerance)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, **tolerance)


def _warns_here() -> None:
    warnings.warn("a user's warning, once per line", UserWarning, stacklevel=1)


def test_making_regions_leaves_once_per_line_warnings_once_as_torchs() -> None:
    """A review: a region made with warnings.catch_warnings inside (to re-point torch's CUDA warning) reset
    Python's registry, so a warning under "default" repeated at every region an O1 forward made."""
    for region in (torch.autocast, autocast):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("default")
            for _ in range(3):
                with region("cpu", dtype=torch.bfloat16):
                    _warns_here()
        assert len(seen) == 1, region


@pytest.mark.parametrize("layer", ["LSTM", "GRU", "RNN", "LSTMCell", "GRUCell"])
def test_recurrent_layers_run_in_fp32_where_half_is_emulated(layer: str) -> None:
    """A user trial (pytorch/examples' word_language_model): an LSTM under mixprec.autocast fp16 failed in
    oneDNN ("could not create a primitive descriptor", as under torch.autocast) where mixprec emulates fp16
    (the suite does, conftest); fp32 there, as the fp32 model computes, and its gradients alike."""
    torch.manual_seed(0)
    module = getattr(nn, layer)(8, 8)
    x = torch.randn(5, 3, 8) if not layer.endswith("Cell") else torch.randn(3, 8)
    ref = module(x)
    with autocast("cpu", dtype=torch.float16):
        out = module(x)
    flat, refs = tree_leaves(out), tree_leaves(ref)
    assert all(a.dtype is torch.float32 and torch.equal(a, b) for a, b in zip(flat, refs, strict=True))
    grads = torch.autograd.grad(flat[0].sum(), list(module.parameters()))
    ref_grads = torch.autograd.grad(refs[0].sum(), list(module.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))


def test_a_policy_rule_for_lstm_wins_over_the_fp32_default() -> None:
    """A rule the user set for a recurrent op is kept: NATIVE (torch's own handling) had looked like no rule
    and was turned into fp32 (a review)."""
    from mixprec.cast_plan import plan
    from mixprec.policy import Action, OpRule, Source
    from mixprec.policy.presets import DEFAULT_POLICY

    assert plan(DEFAULT_POLICY, "cpu", torch.float16).actions["lstm"] is Action.FP32  # emulated (conftest)
    for action in (Action.NATIVE, Action.LOWER):
        policy = DEFAULT_POLICY.with_rules(OpRule("lstm", action, source=Source.USER))
        assert plan(policy, "cpu", torch.float16).actions.get("lstm") is not Action.FP32
    lowered = DEFAULT_POLICY.with_rules(OpRule("lstm", Action.LOWER, source=Source.USER))
    with autocast("cpu", dtype=torch.float16, policy=lowered):
        out, _ = nn.LSTM(8, 8)(torch.randn(5, 3, 8))
    assert out.dtype is torch.float16  # emulated as the rule asks: half inputs, fp32 arithmetic, half out
