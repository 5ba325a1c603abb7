"""Pure half-precision training: ``LowPrecisionOptimizer`` lets any ``torch.optim`` optimizer update bf16 or
fp16 weights without fp32 master weights.

Why: fp32 masters cost 4 bytes per parameter (8 with their gradients) on top of the half weights. Without
them, an update ``lr * grad`` smaller than half a unit in the last place (ulp) of its weight is rounded away:
in bf16 ``1.0 - 1e-4 == 1.0``, so the weight stalls. Four ways to write the fp32 result of an update back
into half precision, chosen by ``mode``:

==========  ==============================================================  ===========  ================
mode        the stored weight                                               extra bytes  precision
==========  ==============================================================  ===========  ================
naive       rounded to nearest (the baseline that stalls)                   0            8 / 11 bits
stochastic  rounded up with probability (distance to the lower neighbour)   0            unbiased: E[w] is
            / ulp, from a seeded generator                                               the fp32 value
kahan       rounded to nearest, plus a compensation (weight's dtype) that   2            ~16 / up to ~22
            keeps what the weight could not absorb (compensated summation)               bits (fp16: the
                                                                                         compensation is
                                                                                         floored at 2**-24,
                                                                                         ~15 bits at 0.01)
split       bf16 high half (rounded to nearest) + int16 low half: together  2            fp32, exactly
            the fp32 master, bit for bit (bf16 only: fp16 is not a half
            of fp32)
==========  ==============================================================  ===========  ================

One step, per chunk of at most ``chunk_numel`` parameter elements of one device and dtype::

    half weights (+ compensation / low half) --reconstruct--> flat fp32 buffer (the weights)
    half grads --exact copy, x 1/loss scale--> flat fp32 buffer (the grads)
    the wrapped optimizer steps: for that call each parameter's .data and .grad are its fp32 views
    fp32 result --store (mode)--> half weights (+ compensation / low half)

The wrapped optimizer never sees half tensors, so every ``torch.optim`` optimizer that updates parameters
one by one works unchanged (SGD, Adam, AdamW, RMSprop, Adagrad, ...); its state stays keyed by the model's
own Parameter objects, so ``state_dict`` and LR schedulers see an ordinary optimizer. ``state_dtype=
torch.bfloat16`` stores that state in bf16 between steps (Adam: 4 bytes per parameter instead of 8).

Cost: every conversion is a ``torch._foreach_*`` call or a whole-buffer op per chunk; the only Python loops
are over parameters to collect tensor lists. Mode ``split`` with torch's Adam/AdamW on the CPU skips all
of that: :mod:`mixprec.split_adam` updates both halves and the moments in one native pass (``kernel``
argument), faster than torch's fused fp32 AdamW (0.86-0.94x on an AMX Xeon, benchmarks/RESULTS.md).
Bytes per parameter, counted from live tensors by :func:`footprint`, with Adam: split 14, kahan with bf16
state 10, fp32 masters 16 plus the fp32 grads.

Why one module over 450 lines: the modes' load/store rules, the stochastic rounding they share with the bf16
state, the wrapper that lends fp32 views to the wrapped optimizer, and the byte count of what it all holds are
one concept (storing an fp32 update in half precision); none is useful alone, and a third of the lines are
the why-comments on the bit-level numerics.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import Tensor

from mixprec.errors import ConfigError, UnsupportedParameterError
from mixprec.hardware import HALF_DTYPES
from mixprec.master import _views_like, clip_half_grads_
from mixprec.outside_region import RegionWatch
from mixprec.skip_step import record_step_called
from mixprec.split_adam import SUPPORTED as SPLIT_ADAM_OPTIMIZERS
from mixprec.split_adam import NativeSplitAdam
from mixprec.warn_site import user_stacklevel

__all__ = ["LowPrecisionOptimizer", "UpdateMode", "Footprint", "footprint", "stochastic_round"]

# 4M elements per chunk: the transient fp32 copies of one chunk (weights and grads, 32 MiB; twice that with
# bf16 optimizer state upcast for the step) stay small next to any model worth training in pure half
# precision, and each foreach kernel still runs over millions of elements, so launch overhead is amortized.
DEFAULT_CHUNK_NUMEL = 1 << 22
# How a step is computed: "auto" uses the native split step where it applies (see LowPrecisionOptimizer).
KERNELS = ("auto", "native", "generic")
# The state dtypes offered: bf16 has fp32's exponent range, so squared gradients (Adam's second moment)
# neither underflow nor overflow; fp16 would flush them below 2**-24.
STATE_DTYPES = (torch.bfloat16,)


class UpdateMode(str, Enum):
    """How the fp32 result of an update is stored back into half precision (see the module docstring)."""

    NAIVE = "naive"
    STOCHASTIC = "stochastic"
    KAHAN = "kahan"
    SPLIT = "split"


# ----------------------------------------------------------------------------------- stochastic rounding
def _random16(n: int, device: torch.device, generator: torch.Generator | None) -> Tensor:
    """n uniform random integers in [0, 2**16) as int32. Drawn as full-range 64-bit words cut in four: one
    generator call per four values (measured 3x faster than randint on CPU, where drawing dominates)."""
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device)
    words.random_(-(1 << 63), None, generator=generator)  # every one of the 64 bits uniform
    return words.view(torch.int16)[:n].to(torch.int32).add_(1 << 15)  # int16 [-2**15, 2**15) -> [0, 2**16)


def _round_bf16_(x: Tensor, generator: torch.Generator | None) -> None:
    # bf16 is the high half of fp32. Adding uniform random 16 bits to the bit pattern and truncating carries
    # into the high half with probability (discarded low bits) / 2**16: exactly the distance to the lower
    # neighbour over the ulp, so E[result] == x. On the raw pattern this acts on the magnitude (the sign bit
    # is untouched), so negative numbers round symmetrically.
    bits = x.view(torch.int32)
    bits.add_(_random16(x.numel(), x.device, generator).view(x.shape)).bitwise_and_(-(1 << 16))


def _rounder_via_neighbours(dtype: torch.dtype) -> Callable[[Tensor, torch.Generator | None], None]:
    """Stochastic rounding to any float dtype through its two neighbours (fp16: its exponent bias differs
    from fp32's, so the bit trick of bf16 does not apply)."""

    def round_(x: Tensor, generator: torch.Generator | None) -> None:
        near = x.to(dtype)
        away = torch.full((), math.inf, dtype=dtype, device=x.device)
        other = torch.nextafter(near, torch.where(x > near, away, -away))
        low, high = torch.minimum(near, other), torch.maximum(near, other)
        # x - low is exact (Sterbenz: they are within a factor 2) and high - low a power of two, so p_up has a
        # single fp32 rounding. u is a multiple of 2**-16 and P(u < p_up) = ceil(p_up * 2**16) / 2**16: exact
        # for fp16 normals (fp32 has 13 bits below them), a bias under 2**-16 ulp for subnormals.
        p_up = (x - low.float()) / (high.float() - low.float())
        u = _random16(x.numel(), x.device, generator).view(x.shape).float().mul_(2.0**-16)
        rounded = torch.where(u < p_up, high, low)
        x.copy_(torch.where(torch.isfinite(near), rounded, near))  # inf/NaN stay visible; exact upcast

    return round_


# In place on a contiguous fp32 tensor: afterwards every value is representable in the dtype, so the copy
# into the half tensors that follows is exact (no second rounding, no intermediate half buffer).
_ROUND_IN_PLACE: dict[torch.dtype, Callable[[Tensor, torch.Generator | None], None]] = {
    torch.bfloat16: _round_bf16_,
    torch.float16: _rounder_via_neighbours(torch.float16),
}


def stochastic_round(x: Tensor, dtype: torch.dtype, generator: torch.Generator | None = None) -> Tensor:
    """``x`` (fp32) rounded to ``dtype`` (bf16 or fp16) stochastically: to the neighbour above with
    probability (x - lower neighbour) / (upper - lower), so the expected result is ``x``. Values exactly
    representable in ``dtype`` are returned unchanged."""
    if x.dtype != torch.float32 or dtype not in _ROUND_IN_PLACE:
        raise ConfigError(
            f"stochastic_round rounds float32 to bf16 or fp16; got {x.dtype} -> {dtype}.",
            "pass a float32 tensor and dtype=torch.bfloat16 or torch.float16.",
        )
    y = x.clone(memory_format=torch.contiguous_format)
    _ROUND_IN_PLACE[dtype](y, generator)
    return y.to(dtype)  # exact


# --------------------------------------------------------------------------------- per-mode load / store
@dataclass
class _Chunk:
    """The flat fp32 buffers one chunk is stepped in, and the half tensors they mirror."""

    halves: list[Tensor]  # the parameters' half-precision data, in chunk order
    extras: list[Tensor]  # the mode's per-parameter buffers (compensations, low halves), or []
    master: Tensor  # flat fp32: the weights the wrapped optimizer updates
    scratch: Tensor  # flat fp32: the grads during the step, working space before and after

    def views(self, flat: Tensor) -> list[Tensor]:
        return _views_like(flat, self.halves)


def _load_half(c: _Chunk) -> None:
    torch._foreach_copy_(c.views(c.master), c.halves)  # fp16/bf16 -> fp32 is exact


def _load_kahan(c: _Chunk) -> None:
    _load_half(c)
    torch._foreach_copy_(c.views(c.scratch), c.extras)
    # Exact: |compensation| <= ulp(w)/2 and both have 8 (11) significant bits, so w + c needs at most ~17 (23)
    # bits, within fp32's 24.
    c.master.add_(c.scratch)


def _load_split(c: _Chunk) -> None:
    bits, low = c.master.view(torch.int32), c.scratch.view(torch.int32)
    torch._foreach_copy_(c.views(bits), [h.view(torch.int16) for h in c.halves])  # sign-extends the high half
    torch._foreach_copy_(c.views(low), c.extras)
    # A zero high half never has a negative low half (the sum would be a NaN) unless a zero was written over
    # a trained weight (re-initialised, pruned, loaded): the master is then that zero. split_adam.c agrees.
    low.masked_fill_(((bits & 0x7FFF) == 0) & (low < 0), 0)
    bits.bitwise_left_shift_(16).add_(low)  # fp32 bits = high * 2**16 + low, low in [-2**15, 2**15)


def _store_nearest(c: _Chunk, generator: torch.Generator) -> None:
    torch._foreach_copy_(c.halves, c.views(c.master))  # round to nearest even


def _store_stochastic(c: _Chunk, generator: torch.Generator) -> None:
    _ROUND_IN_PLACE[c.halves[0].dtype](c.master, generator)  # one dtype per chunk
    _store_nearest(c, generator)  # exact now


def _store_kahan(c: _Chunk, generator: torch.Generator) -> None:
    _store_nearest(c, generator)
    torch._foreach_copy_(c.views(c.scratch), c.halves)
    c.master.sub_(c.scratch)  # the rounding error, exact (Sterbenz: the weight is the master rounded)
    torch._foreach_copy_(c.extras, c.views(c.master))  # rounded to the weight's dtype: the compensation


def _split_bits_(bits: Tensor, high: Tensor) -> None:
    """fp32 bit patterns (int32) split in place: ``high`` = round-half-away(bits / 2**16) and ``bits`` =
    bits - high * 2**16, in [-2**15, 2**15). The forward's bf16 weight is the master rounded to nearest
    (not truncated), and the low half fits int16 with no tie overflow."""
    bits.add_(1 << 15)
    torch.bitwise_right_shift(bits, 16, out=high)  # arithmetic shift: keeps the sign of the pattern
    bits.bitwise_and_((1 << 16) - 1).sub_(1 << 15)


def _split_pair(bits: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 bit patterns (int32, consumed) as the split layout's (high, low) halves, both int16."""
    high = torch.empty_like(bits)
    _split_bits_(bits, high)
    return high.to(torch.int16), bits.to(torch.int16)  # both in int16's range by construction


@torch.no_grad()
def split_fp32(value: Tensor) -> tuple[Tensor, Tensor]:
    """``value`` (any floating dtype; fp64 is rounded to fp32 first) as the split layout's pair: the bf16
    weight (the fp32 value rounded half away from zero) and the int16 low half that completes it to that
    fp32 value exactly. New tensors of ``value``'s shape, on its device."""
    fp32 = value.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    high, low = _split_pair(fp32.view(torch.int32))
    return high.view(torch.bfloat16), low


def _store_split(c: _Chunk, generator: torch.Generator) -> None:
    bits, high = c.master.view(torch.int32), c.scratch.view(torch.int32)
    _split_bits_(bits, high)
    torch._foreach_copy_([h.view(torch.int16) for h in c.halves], c.views(high))
    torch._foreach_copy_(c.extras, c.views(bits))


@dataclass(frozen=True)
class _Mode:
    load: Callable[[_Chunk], None]
    store: Callable[[_Chunk, torch.Generator], None]
    extra_dtype: Callable[[torch.dtype], torch.dtype | None]  # per-parameter buffer for a weight dtype
    dtypes: tuple[torch.dtype, ...]  # weight dtypes it supports
    fix: str  # what to do with another dtype


_HALF_FIX = "cast the model to torch.bfloat16 or torch.float16 (model.to(torch.bfloat16))."
_MODES: dict[UpdateMode, _Mode] = {
    UpdateMode.NAIVE: _Mode(_load_half, _store_nearest, lambda d: None, HALF_DTYPES, _HALF_FIX),
    UpdateMode.STOCHASTIC: _Mode(_load_half, _store_stochastic, lambda d: None, HALF_DTYPES, _HALF_FIX),
    # The compensation in the weight's own dtype: it holds at most half an ulp of the weight, and its own
    # 8 (bf16) or 11 (fp16) bits extend the weight's precision to about twice as many.
    UpdateMode.KAHAN: _Mode(_load_kahan, _store_kahan, lambda d: d, HALF_DTYPES, _HALF_FIX),
    UpdateMode.SPLIT: _Mode(
        _load_split, _store_split, lambda d: torch.int16, (torch.bfloat16,),
        "split needs bf16 weights (bf16 is the high half of fp32; fp16 is not): cast the model to "
        "torch.bfloat16, or use mode='kahan' or 'stochastic' for fp16.",
    ),
}


@dataclass
class _StateSwap:
    """Optimizer state lent to one step in fp32: the half tensors it came from, and the fp32 buffer."""

    kept: dict[tuple[int, Any], Tensor]  # (id(state dict), key) -> the half tensor, refilled after the step
    flat: Tensor
    views: list[Tensor]  # what the state dicts held during the step


def _is_moment(key: Any, value: Any, param: Tensor) -> bool:
    """An optimizer state tensor shaped like its parameter (momentum, Adam's moments), not a step count."""
    moment = isinstance(value, Tensor) and value.is_floating_point() and value.shape == param.shape
    return moment and key != "step"


# ----------------------------------------------------------------------------------- the wrapper
class LowPrecisionOptimizer(torch.optim.Optimizer):
    """Update bf16/fp16 parameters with ``optimizer`` without fp32 master weights (see the module docstring).

    Args:
        optimizer: any ``torch.optim`` optimizer over half-precision parameters (state it already holds, such
            as Adagrad's accumulators, is upcast exactly and kept).
        mode: ``"naive"``, ``"stochastic"``, ``"kahan"`` or ``"split"`` (:class:`UpdateMode`).
        state_dtype: None keeps the wrapped optimizer's state as it makes it (fp32); ``torch.bfloat16`` stores
            it in bf16 between steps, rounded stochastically (Adam's second moment moves by 0.1% a step with
            beta2=0.999, less than bf16's half ulp of 0.2%: rounding to nearest would freeze it).
        seed: seeds the generator of stochastic rounding (one per device). 0 by default so that runs are
            reproducible, and so that data-parallel replicas, which see identical gradients, round alike.
        chunk_numel: at most this many elements are converted to fp32 at once (see DEFAULT_CHUNK_NUMEL).
        kernel: ``"auto"`` steps mode ``"split"`` with :mod:`mixprec.split_adam`'s one native pass where it
            can run (torch's Adam/AdamW, fused or not, on dense CPU tensors; no amsgrad, tensor settings or
            step hooks) and the generic step elsewhere, with a warning once per reason. The native pass is
            torch's Adam arithmetic with a correctly rounded sqrt (torch's CPU sqrt is one ulp off in ~0.6%
            of elements), so its masters match the generic step's within a few ulps. ``"native"`` raises
            where it cannot run, naming why; ``"generic"`` never uses it
            (torch's own numbers, bit for bit).
        initial: mode ``"split"`` only: each parameter's exact fp32 starting value (a dict from parameter to
            tensor, e.g. the fp32 weights a model was cast from): the masters start there, not at the bf16
            weights' rounding, as ``MasterWeights(..., initial=...)``. Parameters left out start at their
            bf16 value. A weight whose fp32 value lies exactly between two bf16 values is rounded away from
            zero (the split layout's rule) where ``.to(torch.bfloat16)`` rounded it to even.

    It *is* a ``torch.optim.Optimizer`` whose ``param_groups`` and ``state`` are the wrapped optimizer's and
    list the model's half parameters: LR schedulers, ``zero_grad`` and ``GradScaler.unscale_`` see those.
    ``GradScaler.step(wrapper)`` checks the half grads for inf/NaN and passes the scale; the wrapper unscales
    after the exact copy to fp32 (so fp16 grads need no ``allow_fp16_grads``) and skips on inf/NaN, reading
    the flag once (one host sync). Calling ``scaler.unscale_(wrapper)`` yourself (to clip) unscales the half
    grads in place: fine for bf16; for fp16 it needs ``GradScaler(allow_fp16_grads=True)``.
    Where it differs from a plain optimizer: the wrapped optimizer steps once per chunk, so a global step
    hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``) runs once for the wrapper and once per
    chunk; state-dict hooks registered on the wrapper do not run (its ``state_dict`` is its own).
    """

    _step_supports_amp_scaling = True  # GradScaler.step passes grad_scale / found_inf instead of unscaling

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        mode: UpdateMode | str,
        *,
        state_dtype: torch.dtype | None = None,
        seed: int = 0,
        chunk_numel: int = DEFAULT_CHUNK_NUMEL,
        kernel: str = "auto",
        initial: Mapping[Tensor, Tensor] | None = None,
    ) -> None:
        check_wrappable(optimizer)
        self.mode = _parse_mode(mode)
        if kernel not in KERNELS:
            raise ConfigError(f"kernel={kernel!r} is not one of {', '.join(map(repr, KERNELS))}.",
                              "kernel='auto' picks the native split step wherever it can run.")
        if kernel == "native" and (self.mode is not UpdateMode.SPLIT or state_dtype is not None):
            raise ConfigError(
                "kernel='native' is the one-pass Adam/AdamW step of mode='split' with fp32 state.",
                "pass mode='split' without state_dtype, or kernel='auto'.",
            )
        self.kernel = kernel
        if state_dtype is not None and state_dtype not in STATE_DTYPES:
            raise ConfigError(
                f"state_dtype={state_dtype} is not supported.",
                "pass state_dtype=torch.bfloat16 (fp32's range) or None (the optimizer's own fp32 state).",
            )
        if not (isinstance(chunk_numel, int) and chunk_numel >= 1):
            raise ConfigError(f"chunk_numel must be an int >= 1, got {chunk_numel!r}.", "e.g. 1 << 22.")
        self.inner = optimizer  # not `.optimizer`: GradScaler unwraps that name to judge torch's fused SGD
        self.state_dtype = state_dtype
        self.seed = seed
        self.chunk_numel = chunk_numel
        # shared with a live wrapper of the same optimizer: its low halves and its rounding generators
        self._extras, self._generators = _buffers_of(optimizer, (self.mode, state_dtype, seed))
        self._native = NativeSplitAdam(optimizer, self._extras)
        self._fallbacks: set[str] = set()  # reasons the native step could not run, warned about once each
        self._region_watch = RegionWatch("LowPrecisionOptimizer")  # a bare forward where half GEMMs crawl
        # ids of the parameters whose low halves load_state_dict set, until the next step or the weight's own
        # load (low_half_awaits_weight): they came from a checkpoint and await their weights
        self._lows_await_weights: set[int] = set()
        initial_bits = None if initial is None else self._initial_bits(initial)
        for group in optimizer.param_groups:
            self._adopt(group["params"])
        self._share_inner_bookkeeping()
        self._own_existing_state()
        if initial_bits is not None:
            self._seed_split(initial_bits)
        _register_buffers(self)

    @torch.no_grad()
    def _initial_bits(self, initial: Mapping[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """``initial`` checked entry by entry and made fp32 bits in each parameter's layout, before anything
        is written: a refused ``initial`` leaves the model and a first wrapper's low halves as they were."""
        if self.mode is not UpdateMode.SPLIT:
            raise ConfigError(f"initial= seeds the exact fp32 masters of mode='split'; "
                              f"mode={self.mode.value!r} keeps no exact master.",
                              "pass initial only with mode='split'.")
        params = {p for g in self.inner.param_groups for p in g["params"]}
        for p, value in initial.items():
            if p not in params:
                raise ConfigError(f"initial names a tensor of shape {tuple(p.shape)} that is not a "
                                  "parameter of this optimizer.",
                                  "key initial by the optimizer's own parameters.")
            if not (isinstance(value, Tensor) and value.is_floating_point() and value.shape == p.shape):
                raise ConfigError(f"initial's value for a parameter of shape {tuple(p.shape)} is not a "
                                  "floating tensor of that shape.", "pass the fp32 weight itself.")
        return {p: torch.empty_like(p, dtype=torch.float32).copy_(v).view(torch.int32)
                for p, v in initial.items()}

    @torch.no_grad()
    def _seed_split(self, bits: dict[Tensor, Tensor]) -> None:
        """Each parameter's weight and low half set so that together they are its fp32 value (the split
        :func:`_store_split` makes)."""
        for p, b in bits.items():
            high, low = _split_pair(b)
            p.view(torch.int16).copy_(high)
            self._extras[p].copy_(low)

    def _own_existing_state(self) -> None:
        """State made before wrapping (Adagrad's accumulators at construction, or a half-precision run being
        continued) is in the parameters' dtype: hold it in the dtype this wrapper keeps (exact upcasts)."""
        for p in (p for g in self.param_groups for p in g["params"]):
            st = self.state.get(p, {})
            for k, v in list(st.items()):
                if _is_moment(k, v, p):
                    st[k] = v.to(self.state_dtype or torch.float32)
                elif k != "step" and isinstance(v, Tensor) and v.dtype in HALF_DTYPES:
                    st[k] = v.float()  # NAdam's mu_product, Adafactor's variances: fp32 as torch makes them

    def _share_inner_bookkeeping(self) -> None:
        # torch's own __setstate__ creates the hook registries and patches step() (schedulers rely on it);
        # defaults, state and param_groups are the wrapped optimizer's objects, so lr changes reach it.
        inner = self.inner
        state = {"defaults": inner.defaults, "state": inner.state, "param_groups": inner.param_groups}
        torch.optim.Optimizer.__setstate__(self, state)

    def _adopt(self, params: list[Tensor]) -> None:
        spec = _MODES[self.mode]
        for p in params:
            _check_param(p, self.mode, spec)
        with torch.no_grad():
            for p in params:
                extra = spec.extra_dtype(p.dtype)
                if extra is not None and p not in self._extras:  # kept: another wrapper's, or re-adopted
                    self._extras[p] = torch.zeros_like(p, dtype=extra)  # the weight is exactly its half value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of half parameters (checked first) to the wrapped optimizer. A group torch refuses
        (a parameter already in another group) leaves every buffer as it was."""
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        kept = {p: self._extras[p] for p in params if p in self._extras}
        self._adopt(params)
        try:
            self.inner.add_param_group({**param_group, "params": params})
        except Exception:
            for p in params:  # _adopt zeroed their compensation / low half: put back what they held
                self._extras.pop(p, None)
            self._extras.update(kept)
            raise

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    # ------------------------------------------------------------------ the step
    # Not traced: Dynamo shows the optimizer's groups with capturable=True while it traces a step (so the
    # native step would refuse), and the pointer checks and the C call are no graph anyway.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One update of every parameter with a gradient. Syncs once to read ``found_inf`` when a GradScaler
        passed it (``scaler.step(wrapper)``), otherwise never."""
        self._lows_await_weights = set()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._region_watch.check(p for g in self.param_groups for p in g["params"])
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and found_inf.item() > 0:
            record_step_called(self)  # skipped: neither step() ran, as a scheduler built on either sees
            return loss
        grad_scale = getattr(self, "grad_scale", None)
        # The reciprocal in fp64, as GradScaler: fp32 division can be imprecise under some compile options.
        inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
        if self._native_applies():
            self._native.step(None if inv_scale is None else inv_scale.item())
            return loss
        for per_group in self._chunks():
            self._step_chunk(per_group, inv_scale)
        return loss

    def _native_applies(self) -> bool:
        """Whether this step runs split_adam's one pass (torch's Adam arithmetic, correctly rounded sqrt).
        Where it cannot for an Adam/AdamW, kernel='native' raises and 'auto' warns once per reason: the
        generic step is several times slower, which a user should hear about."""
        if self.kernel == "generic" or self.mode is not UpdateMode.SPLIT or self.state_dtype is not None:
            return False
        reason = self._native.reason()
        if reason is not None:  # a gradient the generic step refuses too (sparse, another dtype) raises here
            for p in (p for g in self.param_groups for p in g["params"]):
                _check_grad(p)  # reads p.grad once (None passes)
        if reason is not None and self.kernel == "native":
            raise ConfigError(f"kernel='native' cannot step this optimizer: {reason}.",
                              "use kernel='auto' (the generic step where the native one cannot run).")
        adam = isinstance(self.inner, SPLIT_ADAM_OPTIMIZERS)  # a subclass falls back, with the warning
        if reason is not None and adam and reason not in self._fallbacks:
            self._fallbacks.add(reason)
            warnings.warn(f"LowPrecisionOptimizer(mode='split') steps generically, several times slower than "
                          f"its native Adam step, because {reason}. Pass kernel='generic' to choose that "
                          "step without this warning (where initialize or the Learner builds the wrapper: "
                          "warnings.filterwarnings('ignore', 'LowPrecisionOptimizer.mode=.split.. steps "
                          "generically')).", UserWarning, stacklevel=user_stacklevel())
        return reason is None

    def _chunks(self) -> list[list[list[Tensor]]]:
        """The parameters with gradients, grouped by (device, dtype) and cut after ``chunk_numel`` elements;
        each chunk as one list per param group (the wrapped optimizer steps every group it has)."""
        n_groups, chunks = len(self.param_groups), []
        open_: dict[tuple[torch.device, torch.dtype], tuple[list[list[Tensor]], list[int]]] = {}
        for i, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                _check_grad(p)
                per_group, size = open_.setdefault((p.device, p.dtype), ([[] for _ in range(n_groups)], [0]))
                per_group[i].append(p)
                size[0] += p.numel()
                if size[0] >= self.chunk_numel:
                    chunks.append(open_.pop((p.device, p.dtype))[0])
        return chunks + [per_group for per_group, _ in open_.values()]

    def _step_chunk(self, per_group: list[list[Tensor]], inv_scale: Tensor | None) -> None:
        params = [p for ps in per_group for p in ps]
        device = params[0].device
        master = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=device)
        c = _Chunk([p.data for p in params], [self._extras[p] for p in params if p in self._extras],
                   master, torch.empty_like(master))
        spec = _MODES[self.mode]
        spec.load(c)
        torch._foreach_copy_(c.views(c.scratch), [p.grad for p in params])  # exact
        if inv_scale is not None:
            c.scratch.mul_(inv_scale.to(device))
        kept = self._state_to_fp32(params)
        with self._inner_sees(per_group, params, c.views(c.master), c.views(c.scratch)):
            self.inner.step()
        self._state_from_fp32(params, kept)
        spec.store(c, self._generator(device))

    @contextmanager
    def _inner_sees(
        self, per_group: list[list[Tensor]], params: list[Tensor], weights: list[Tensor], grads: list[Tensor]
    ) -> Iterator[None]:
        """For the wrapped optimizer's step: each group lists only this chunk's parameters, whose .data and
        .grad are their fp32 views. The Parameter objects stay the same, so its state stays keyed by them;
        afterwards every parameter gets its own half storage back (views and data_ptr unchanged)."""
        halves, half_grads = [p.data for p in params], [p.grad for p in params]
        saved = [g["params"] for g in self.param_groups]
        try:
            for group, ps in zip(self.param_groups, per_group, strict=True):
                group["params"] = ps
            for p, w, g in zip(params, weights, grads, strict=True):
                p.data, p.grad = w, g
            yield
        finally:
            for p, h, g in zip(params, halves, half_grads, strict=True):
                p.data = h
                p.grad = g
            for group, ps in zip(self.param_groups, saved, strict=True):
                group["params"] = ps

    def _moments(self, params: list[Tensor]) -> list[tuple[dict[Any, Any], Any, Tensor]]:
        return [
            (st, k, v)
            for p in params
            if (st := self.state.get(p))
            for k, v in st.items()
            if _is_moment(k, v, p)
        ]

    def _state_to_fp32(self, params: list[Tensor]) -> _StateSwap | None:
        """With ``state_dtype``: swap the state for fp32 views of one buffer; remember the half tensors."""
        entries = self._moments(params) if self.state_dtype is not None else []
        if not entries:
            return None
        flat = torch.empty(sum(v.numel() for _, _, v in entries), device=entries[0][2].device)
        views = _views_like(flat, [v for _, _, v in entries])
        torch._foreach_copy_(views, [v for _, _, v in entries])  # bf16 -> fp32 is exact
        for (st, k, _), view in zip(entries, views, strict=True):
            st[k] = view
        return _StateSwap({(id(st), k): v for st, k, v in entries}, flat, views)

    def _state_from_fp32(self, params: list[Tensor], swap: _StateSwap | None) -> None:
        """With ``state_dtype``: round the stepped state (or what the first step made) into half tensors."""
        entries = self._moments(params) if self.state_dtype is not None else []
        if not entries:
            return
        now = [v for _, _, v in entries]
        lent = swap.views if swap is not None else []
        if swap is not None and len(now) == len(lent) and all(a is b for a, b in zip(now, lent, strict=True)):
            flat = swap.flat  # the optimizer updated our views in place (torch's optimizers do)
        else:  # it made its state in this step, or replaced tensors: gather them
            flat = torch.empty(sum(v.numel() for v in now), device=now[0].device)
            torch._foreach_copy_(_views_like(flat, now), now)
        _ROUND_IN_PLACE[self.state_dtype](flat, self._generator(flat.device))  # type: ignore[index]
        kept = swap.kept if swap is not None else {}
        stores = [kept.get((id(st), k)) for st, k, _ in entries]
        stores = [s if s is not None else torch.empty_like(v, dtype=self.state_dtype)
                  for s, v in zip(stores, now, strict=True)]
        torch._foreach_copy_(stores, _views_like(flat, stores))  # exact: already representable
        for (st, k, _), s in zip(entries, stores, strict=True):
            st[k] = s

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
                        ) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the half gradients the step reads, with the norm taken in
        fp32 (torch's, over half gradients, is up to ~1% off in bf16) and each gradient scaled with one
        rounding: ``MasterWeights(master_grads=False).clip_grad_norm_``'s rule. Call it where torch.amp
        clips: after ``scaler.unscale_(opt)`` (or ``scale_loss``'s exit), before the step."""
        params = [p for g in self.param_groups for p in g["params"]]
        return clip_half_grads_(params, max_norm, norm_type, error_if_nonfinite)

    # ------------------------------------------------------------------ access
    def extra_tensors(self) -> list[Tensor]:
        """The mode's per-parameter buffers (kahan: compensations; split: low halves), in param order."""
        return [self._extras[p] for g in self.param_groups for p in g["params"] if p in self._extras]

    def low_half(self, param: Tensor) -> Tensor | None:
        """Mode ``"split"``: ``param``'s int16 low half (the tensor the step writes), or None for a tensor
        this wrapper does not hold (yet: a group added later has one from then on)."""
        if self.mode is not UpdateMode.SPLIT:
            raise ConfigError(f"mode={self.mode.value!r} keeps no low halves.", "use mode='split'.")
        return self._extras.get(param)

    def low_half_awaits_weight(self, param: Tensor) -> bool:
        """Whether ``param``'s low half came with :meth:`load_state_dict` since the last step and its weight
        was not loaded since (mixprec.split_state_dict asks when it loads the weight: from then on, no)."""
        awaited = id(param) in self._lows_await_weights
        self._lows_await_weights.discard(id(param))
        return awaited

    @torch.no_grad()
    def master_values(self, params: Iterable[Tensor] | None = None) -> list[Tensor]:
        """Each parameter's value as the mode knows it, in fp32 (split: the exact fp32 master; kahan: weight
        plus compensation; naive/stochastic: the weight itself), for ``params`` (default: every parameter,
        in ``param_groups`` order). New tensors, one per parameter: an inspection method (a loop over
        parameters), not part of the step."""
        values = []
        for p in (p for g in self.param_groups for p in g["params"]) if params is None else params:
            flat = torch.empty(p.numel(), dtype=torch.float32, device=p.device)
            extras = [self._extras[p]] if p in self._extras else []
            _MODES[self.mode].load(_Chunk([p.data], extras, flat, torch.empty_like(flat)))
            values.append(flat.view_as(p))
        return values

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state, the mode's buffers and the generators' states. The weights are the
        model's: save ``model.state_dict()`` too (split: the high halves are half of each fp32 master)."""
        return {
            "optimizer": self.inner.state_dict(),
            "mode": self.mode.value,
            "state_dtype": None if self.state_dtype is None else str(self.state_dtype),
            "extras": [t.detach().clone() for t in self.extra_tensors()],
            "generators": {device: g.get_state() for device, g in self._generators.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: bit-identical when the model's weights are restored as well."""
        self._check_loadable(state_dict)
        saved = state_dict["optimizer"]
        self.inner.load_state_dict(saved)
        self._share_inner_bookkeeping()  # torch's load_state_dict replaced the state and group objects
        self._restore_state_dtypes(saved)
        with torch.no_grad():
            for extra, saved_extra in zip(self.extra_tensors(), state_dict["extras"], strict=True):
                extra.copy_(saved_extra)
        for device, gen_state in state_dict["generators"].items():
            self._generator(torch.device(device)).set_state(gen_state)
        if self.mode is UpdateMode.SPLIT:
            self._lows_await_weights = {id(p) for g in self.param_groups for p in g["params"]}

    def _check_loadable(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != {"optimizer", "mode", "state_dtype", "extras", "generators"}:
            raise ConfigError(
                "This is not a LowPrecisionOptimizer state_dict (expected keys optimizer, mode, state_dtype, "
                "extras, generators).",
                "resume from the wrapper's own state_dict(); to start from a plain optimizer's state, load "
                "it into that optimizer before wrapping it (inner.load_state_dict(sd), then "
                "LowPrecisionOptimizer(inner, ...): its state is taken over).",
            )
        mine = (self.mode.value, None if self.state_dtype is None else str(self.state_dtype))
        theirs = (state_dict["mode"], state_dict["state_dtype"])
        if mine != theirs:
            raise ConfigError(
                f"The checkpoint was saved with mode={theirs[0]!r}, state_dtype={theirs[1]}; this wrapper "
                f"has mode={mine[0]!r}, state_dtype={mine[1]}.",
                "construct the wrapper with the checkpoint's mode and state_dtype to resume it.",
            )
        extras = self.extra_tensors()
        if [t.shape for t in state_dict["extras"]] != [t.shape for t in extras]:
            raise ConfigError(
                "The saved compensation / low-half buffers do not match this model's parameters.",
                "load a checkpoint saved from the same model architecture and param groups.",
            )

    def _restore_state_dtypes(self, saved: dict[str, Any]) -> None:
        """torch casts loaded floating state (all but "step") to its parameter's dtype, here half: put back
        the saved dtype, so an fp32 state resumes without rounding -- moments, and state of other shapes
        too (NAdam's mu_product, Adafactor's row and column variances)."""
        ids = [i for g in saved["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params, strict=True):
            for k, v in saved["state"].get(i, {}).items():
                if isinstance(v, Tensor) and k != "step":  # torch casts integer and bool state too
                    self.state[p][k] = v.to(p.device, copy=True)

    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer pickles only defaults/state/param_groups; deepcopy needs all of the wrapper, but
        # not an LR scheduler's per-instance step wrapper (not picklable; torch drops it the same way).
        return {k: v for k, v in self.__dict__.items() if k != "step"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        _register_buffers(self)  # a copy (deepcopy, pickle) wraps its own copy of the optimizer

    def __repr__(self) -> str:
        n = sum(p.numel() for g in self.param_groups for p in g["params"])
        return (f"LowPrecisionOptimizer(mode={self.mode.value!r}, state_dtype={self.state_dtype}, "
                f"{n:,} half parameters,\n  {self.inner!r})")


def _parse_mode(mode: UpdateMode | str) -> UpdateMode:
    try:
        return UpdateMode(mode)
    except ValueError:
        names = ", ".join(repr(m.value) for m in UpdateMode)
        raise ConfigError(f"Unknown mode {mode!r}.", f"pick one of {names}.") from None


# The buffers a wrapper keeps per weight (split's low halves, kahan's compensations) are per-parameter state
# like the moments, which live in the wrapped optimizer: they are kept per wrapped optimizer too, while a
# wrapper of it is alive. A second wrapper of the same optimizer (a notebook cell run again) then continues
# from them; with buffers of its own, it would step the weights with fresh zero low halves while the first
# still held the real ones. Once no wrapper is left they are let go (2 bytes per parameter).
_BufferKey = tuple[UpdateMode, "torch.dtype | None", int]  # mode, state_dtype, seed


@dataclass
class _Buffers:
    key: _BufferKey
    extras: dict[Tensor, Tensor]
    generators: dict[str, torch.Generator]  # stochastic rounding's, which a second wrapper continues too
    wrappers: weakref.WeakSet[LowPrecisionOptimizer]


_BUFFERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Buffers] = weakref.WeakKeyDictionary()


def _buffers_of(optimizer: torch.optim.Optimizer, key: _BufferKey
                ) -> tuple[dict[Tensor, Tensor], dict[str, torch.Generator]]:
    """The per-weight buffers of a live wrapper of ``optimizer``, shared; new ones (registered by
    :func:`_register_buffers` once the wrapper is built) when there is none."""
    held = _BUFFERS.get(optimizer)
    if held is None or not held.wrappers:
        _BUFFERS.pop(optimizer, None)
        return {}, {}
    if held.key != key:
        (was_mode, was_dtype, was_seed), (mode, state_dtype, seed) = held.key, key
        raise ConfigError(
            f"This optimizer is already wrapped by a LowPrecisionOptimizer with mode={was_mode.value!r}, "
            f"state_dtype={was_dtype}, seed={was_seed}; its buffers and generators cannot serve "
            f"mode={mode.value!r}, state_dtype={state_dtype}, seed={seed}.",
            "wrap each optimizer in one mode; to change mode, build a new optimizer over the model's "
            "parameters and wrap that (or let the first wrapper go).",
        )
    return held.extras, held.generators


def _register_buffers(wrapper: LowPrecisionOptimizer) -> None:
    held = _BUFFERS.get(wrapper.inner)
    if held is None or held.extras is not wrapper._extras:
        key = (wrapper.mode, wrapper.state_dtype, wrapper.seed)
        held = _Buffers(key, wrapper._extras, wrapper._generators, weakref.WeakSet())
        _BUFFERS[wrapper.inner] = held
    held.wrappers.add(wrapper)


def check_wrappable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse what LowPrecisionOptimizer cannot wrap, before anything is built (initialize's split_masters
    asks before it casts the model)."""
    if not isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "model_params") or isinstance(
        optimizer, LowPrecisionOptimizer
    ):
        raise ConfigError(
            f"LowPrecisionOptimizer wraps a plain torch.optim optimizer, got {type(optimizer).__name__}.",
            "build the optimizer over the half model first: LowPrecisionOptimizer(torch.optim.AdamW(model."
            "parameters()), mode='kahan'); do not combine it with MasterWeights.",
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ConfigError(
            "LBFGS re-evaluates the model inside step() and keeps a whole-model history: it cannot be "
            "stepped chunk by chunk on fp32 copies.",
            "use a first-order optimizer (SGD, Adam, AdamW, ...), or fp32 weights with LBFGS.",
        )


def _check_param(p: Tensor, mode: UpdateMode, spec: _Mode) -> None:
    if p.dtype in (torch.float32, torch.float64):
        raise UnsupportedParameterError(
            f"LowPrecisionOptimizer updates bf16/fp16 weights, but a parameter of shape {tuple(p.shape)} is "
            f"{p.dtype}: it needs no rounding help.",
            "for fp32 weights use the optimizer as it is; for a half model with fp32 master weights use "
            "mixprec.MasterWeights(optimizer); to keep BatchNorm fp32 in a half model, give its parameters a "
            "separate plain optimizer.",
        )
    if p.dtype not in spec.dtypes:
        raise UnsupportedParameterError(
            f"mode={mode.value!r} cannot update a {p.dtype} parameter (shape {tuple(p.shape)}).", spec.fix
        )


def _check_grad(p: Tensor) -> None:
    grad = p.grad
    if grad is not None and (grad.is_sparse or grad.layout != torch.strided):
        raise UnsupportedParameterError(
            f"A parameter of shape {tuple(p.shape)} has a sparse gradient; LowPrecisionOptimizer steps dense "
            "fp32 copies.",
            "use dense gradients (e.g. nn.Embedding(..., sparse=False)), or update that parameter with its "
            "own optimizer (torch.optim.SparseAdam on fp32 weights).",
        )
    if grad is not None and grad.dtype != p.dtype:
        raise UnsupportedParameterError(
            f"A {p.dtype} parameter has a {grad.dtype} gradient.",
            "let autograd make the gradients (they take the parameter's dtype).",
        )


# ----------------------------------------------------------------------------------- memory
@dataclass(frozen=True)
class Footprint:
    """Bytes held for training, by role, counted from live tensors (each storage once)."""

    numel: int  # parameter elements the model computes with
    weights: int  # the weights the forward uses
    grads: int  # their gradients
    extra: int  # fp32 masters and their grads, compensations, low halves
    state: int  # the optimizer's state tensors shaped like parameters (momentum, Adam's moments)
    scalars: int  # 0-dim state (step counts): a few bytes per parameter *tensor*, not per element

    @property
    def total(self) -> int:
        """Every byte counted, scalars included."""
        return self.weights + self.grads + self.extra + self.state + self.scalars

    @property
    def per_param(self) -> float:
        """Bytes per parameter element of what grows with the model (all but the scalars)."""
        return (self.total - self.scalars) / self.numel if self.numel else 0.0


def footprint(optimizer: torch.optim.Optimizer) -> Footprint:
    """What training with ``optimizer`` holds per parameter: weights, their grads, extra buffers, optimizer
    state. Works for a plain optimizer, :class:`LowPrecisionOptimizer` and ``MasterWeights`` (its model
    parameters are the weights; its masters and their grads the extra). Read it after a step, before
    ``zero_grad``, so grads and state exist."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    model_params = getattr(optimizer, "model_params", None)
    fp32_params = getattr(optimizer, "fp32_params", None)
    weights = params
    if model_params is not None and fp32_params is not None:
        # A MasterWeights' groups hold its masters and, as themselves, the model parameters kept in fp32
        # (BatchNorm under O2): weights the model computes with, so they count in numel as their bytes do
        # (left out, bytes that include them were divided by an element count without them).
        weights = [*model_params(), *fp32_params()]
    extra_owned = getattr(optimizer, "extra_tensors", None)
    extra = [t for p in params for t in (p, p.grad)] + (extra_owned() if extra_owned is not None else [])
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
    scalars = [v for v in state if v.dim() == 0]
    seen: set[int] = set()

    def nbytes(tensors: list[Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if t is not None and (ptr := t.untyped_storage().data_ptr()) not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
        return total

    w, g = nbytes(list(weights)), nbytes([p.grad for p in weights])
    x, sc = nbytes(extra), nbytes(scalars)
    return Footprint(sum(p.numel() for p in weights), w, g, x, nbytes(state), sc)
