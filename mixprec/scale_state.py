"""The loss scale's settings and state, and the rule that moves the scale: one record each.

``ScaleConfig`` holds what the user chose (growth/backoff factors, interval, bounds, hysteresis), validated
in ``__post_init__`` so every way a value enters (constructor, ``set_*``, ``load_state_dict``) is checked by
the same code. ``ScaleState`` holds what changes while training (the scale, growth tracker, hysteresis
allowance, skip counters, the history ring): as Python values until the first scaled tensor names a device,
then as 0-dim device tensors, and back to Python values (one sync) for ``state_dict`` and pickling.
``update_dynamic`` moves a device state by one iteration without a host sync.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mixprec.errors import ConfigError
from mixprec.func_transforms import outside_transforms

__all__ = [
    "ScaleConfig",
    "ScaleState",
    "DeviceCounters",
    "HysteresisRule",
    "check_scale",
    "check_count",
    "update_dynamic",
    "DEFAULT_SCALE_FLOOR",
    "LOWEST_SCALE",
]

# Defaults, each with its reason (they equal torch.amp.GradScaler's, on purpose: drop-in).
DEFAULT_INIT_SCALE = 2.0**16  # large on purpose: a few overflowing first steps find the right scale fast
DEFAULT_GROWTH_FACTOR = 2.0  # powers of two: scaling by them is exact in binary floating point
DEFAULT_BACKOFF_FACTOR = 0.5  # halve on overflow, the mirror of doubling
DEFAULT_GROWTH_INTERVAL = 2000  # overflows are rare once tuned; probing upward too often wastes steps
DEFAULT_HISTORY_SIZE = 1024  # scales kept for plotting: a ring buffer, 4 KiB on the device

# The dynamic scale never backs off below this unless ``min_scale`` says otherwise. Why 1: below 1,
# unscaling multiplies every gradient by 1/scale > 1, and the unscale kernel checks for inf/NaN *before*
# it multiplies, so a large finite gradient can become inf after the check and reach the weights; fp16
# gradients gain nothing from a scale below 1 either (it only pushes them toward underflow). A run that
# still overflows at scale 1 has inf/NaN for another reason (see ``skip_limit``). DeepSpeed and Megatron-LM
# use the same minimum (``min_loss_scale=1``). torch.amp has no floor: ~146 consecutive overflows from 2**16
# take its scale below 2**-126, 1/scale becomes inf and the next clean step writes inf/NaN into the model.
DEFAULT_SCALE_FLOOR = 1.0
# No scale may be below this, even by an explicit ``min_scale``: 1/scale <= 2**100 stays finite in fp32,
# and an fp16 gradient (|g| <= 65504 < 2**16) unscaled stays below 2**116, finite in fp32.
LOWEST_SCALE = 2.0**-100
# The scale lives in an fp32 tensor: a Python float above this would become inf there.
FP32_MAX = float(torch.finfo(torch.float32).max)
# Counts live in int32 device tensors (torch's growth tracker is int32): larger values would wrap.
MAX_COUNT = 2**31 - 1

HysteresisRule = Literal["deepspeed", "consecutive"]
HYSTERESIS_RULES: tuple[str, ...] = ("deepspeed", "consecutive")


# ---------------------------------------------------------------------------------------------- validation
def _as_real(name: str, value: Any) -> float:
    """A float from what torch accepts as a number: Python and numpy reals, 1-element tensors; not bools."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        return float(value.item())  # a user-given tensor, read once where it enters (not per step)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(
        f"{name} must be a number, got {value!r} ({type(value).__name__}).",
        f"pass a float, e.g. {name}=2.0.",
    )


def check_scale(name: str, value: Any, floor: float = LOWEST_SCALE) -> float:
    """``value`` as a float if it is a usable loss scale: finite in fp32 and at least ``floor``."""
    scale = _as_real(name, value)
    if not (math.isfinite(scale) and 0 < scale <= FP32_MAX):
        raise ConfigError(
            f"{name} must be a positive number that is finite in fp32, got {value!r}.",
            f"pass e.g. {name}=2.**16 (dynamic scaling) or a fixed power of two such as 512. (static).",
        )
    if scale < floor:
        raise ConfigError(
            f"{name} {scale:g} is below the scale floor {floor:g}: unscaling would multiply the gradients "
            f"by {1 / scale:g}, which can turn a finite gradient into inf after the inf/NaN check.",
            f"use {name} >= {floor:g}, or lower the floor with min_scale (not below {LOWEST_SCALE:g}).",
        )
    return scale


def check_count(name: str, value: Any, low: int = 1, *, optional: bool = False) -> int | None:
    """``value`` if it is an int (not a bool) in [low, 2**31 - 1]; None passes when ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and low <= value <= MAX_COUNT:
        return int(value)
    raise ConfigError(
        f"{name} must be an int from {low} to {MAX_COUNT} (it is counted in an int32), got {value!r}.",
        f"pass e.g. {name}={max(low, 2)}" + (" or None." if optional else "."),
    )


def _check_growth(value: Any) -> float:
    factor = _as_real("growth_factor", value)
    if not (math.isfinite(factor) and factor > 1.0):
        raise ConfigError(
            f"The growth factor must be > 1.0 and finite, got {value!r}: a factor <= 1 never grows the scale "
            "(below 1 it shrinks it on every clean interval).",
            "use e.g. growth_factor=2.0.",
        )
    return factor


def _check_backoff(value: Any) -> float:
    factor = _as_real("backoff_factor", value)
    if not 0.0 < factor < 1.0:
        raise ConfigError(
            f"The backoff factor must be < 1.0 (and > 0), got {value!r}: a factor >= 1 grows the scale on "
            "every overflow instead of backing off.",
            "use e.g. backoff_factor=0.5.",
        )
    return factor


# ---------------------------------------------------------------------------------------------- settings
_RUN_SETTINGS = ("init_scale", "skip_limit")

@dataclass(frozen=True)
class ScaleConfig:
    """What the user chose. Frozen and validated in ``__post_init__``: change it with ``replace``."""

    growth_factor: float = DEFAULT_GROWTH_FACTOR
    backoff_factor: float = DEFAULT_BACKOFF_FACTOR
    growth_interval: int = DEFAULT_GROWTH_INTERVAL
    dynamic: bool = True  # False: static scaling, the scale never moves (steps still skip on inf/NaN)
    min_scale: float | None = None  # None: DEFAULT_SCALE_FLOOR (see there why a floor at all)
    max_scale: float | None = None  # None: unbounded, as torch (growth still stops short of fp32 inf)
    hysteresis: int = 1  # 1: back off on every overflow, as torch
    hysteresis_rule: HysteresisRule = "deepspeed"
    # Where the scale starts, and when a run that keeps skipping stops: settings of a run, not of the
    # scale's rule, so they are not part of state_dict (the scale itself and the skip counter are).
    init_scale: float = DEFAULT_INIT_SCALE
    skip_limit: int | None = None  # None: never stop (see GradScaler's docstring)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise the validated values once, here
        set_(self, "growth_factor", _check_growth(self.growth_factor))
        set_(self, "backoff_factor", _check_backoff(self.backoff_factor))
        set_(self, "growth_interval", check_count("growth_interval", self.growth_interval))
        set_(self, "hysteresis", check_count("hysteresis", self.hysteresis))
        if not isinstance(self.dynamic, bool):
            raise ConfigError(f"dynamic must be True or False, got {self.dynamic!r}.", "dynamic=False.")
        if self.hysteresis_rule not in HYSTERESIS_RULES:
            raise ConfigError(
                f"hysteresis_rule must be one of {HYSTERESIS_RULES}, got {self.hysteresis_rule!r}.",
                "use 'deepspeed' (the default) unless you need mixprec 0.x's 'consecutive' rule.",
            )
        for name in ("min_scale", "max_scale"):
            if getattr(self, name) is not None:
                set_(self, name, check_scale(name, getattr(self, name)))
        set_(self, "init_scale", check_scale("init_scale", self.init_scale, self.floor))
        set_(self, "skip_limit", check_count("skip_limit", self.skip_limit, optional=True))
        if self.max_scale is not None and self.max_scale < self.floor:
            raise ConfigError(
                f"min_scale {self.floor:g} is larger than max_scale {self.max_scale:g}.",
                "swap them, or leave one of them None.",
            )

    @property
    def floor(self) -> float:
        """The lowest scale this scaler accepts or backs off to."""
        return DEFAULT_SCALE_FLOOR if self.min_scale is None else self.min_scale

    @classmethod
    def static(cls, scale: float) -> ScaleConfig:
        """A fixed scale (overflowing steps are still skipped)."""
        return cls(dynamic=False, init_scale=scale, min_scale=min(scale, DEFAULT_SCALE_FLOOR))

    def replace(self, **changes: Any) -> ScaleConfig:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """The rule's settings as state_dict carries them (not the run's ``init_scale``/``skip_limit``).
        ``min_scale`` is the floor in force: None there read as "no floor" to a user printing the dict."""
        saved = {k: v for k, v in dataclasses.asdict(self).items() if k not in _RUN_SETTINGS}
        return saved | {"min_scale": self.floor}

    def from_dict(self, saved: dict[str, Any]) -> ScaleConfig:
        """This config with the entries ``saved`` has (torch's dict lacks mixprec's extras)."""
        names = {f.name for f in dataclasses.fields(self)}
        return self.replace(**{k: v for k, v in saved.items() if k in names})


# ---------------------------------------------------------------------------------------------- state
# The counters kept on the device: name -> (dtype, state_dict key). Why these dtypes: the scale is fp32 as
# in torch (it multiplies fp32 losses); torch's _amp_update_scale_ kernel wants an int32 growth tracker;
# the skip counters are int64 so a long run never wraps; the skip flag is a bool.
_COUNTERS: dict[str, tuple[torch.dtype, str]] = {
    "scale": (torch.float32, "scale"),
    "growth_tracker": (torch.int32, "_growth_tracker"),
    "hysteresis_left": (torch.int32, "_hysteresis_left"),
    "skipped": (torch.int64, "skipped_steps"),
    "last_skipped": (torch.bool, "last_step_skipped"),
    "consecutive": (torch.int64, "_consecutive_skips"),
}


@dataclass
class DeviceCounters:
    """The counters as 0-dim device tensors (updated in place, never read on the host while training)."""

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_left: torch.Tensor
    skipped: torch.Tensor
    last_skipped: torch.Tensor
    consecutive: torch.Tensor
    history: torch.Tensor  # ring buffer: the scale iteration i used is at i % history_size


@dataclass
class ScaleState:
    """The scaler's changing state, one record: Python values (``scale`` ... ``history``, the shadow) and,
    once a device is known, the same counters as device tensors (``device``), which then are the truth."""

    scale: float
    growth_tracker: int = 0
    hysteresis_left: int = 1
    skipped: int = 0
    last_skipped: bool = False
    consecutive: int = 0
    history: list[float] = field(default_factory=list)  # oldest first
    updates: int = 0  # iterations completed: counted on the host, so it never needs a sync
    history_size: int = DEFAULT_HISTORY_SIZE
    device: DeviceCounters | None = None

    def to_device(self, dev: torch.device) -> DeviceCounters:
        """Make the device tensors from the Python values (no sync: host-to-device copies only)."""
        # Plain tensors even when the first scale(loss) runs inside torch.func's vmap/grad (a per-sample
        # loss): made there, they were that transform's wrapped tensors, and update() after it failed
        # ("Cannot access data pointer of Tensor that doesn't have storage"); torch's scaler has no such
        # state to lose.
        with outside_transforms():
            return self._make_device_counters(dev)

    def _make_device_counters(self, dev: torch.device) -> DeviceCounters:
        made = {
            name: torch.full((), getattr(self, name), dtype=dt, device=dev)
            for name, (dt, _) in _COUNTERS.items()
        }
        ring = torch.zeros(self.history_size, dtype=torch.float32, device=dev)
        kept = self.history[-self.history_size :]
        slots = [i % self.history_size for i in range(self.updates - len(kept), self.updates)]
        if kept:
            ring[slots] = torch.tensor(kept, dtype=torch.float32)
        self.device = DeviceCounters(**made, history=ring)
        return self.device

    def to_python(self) -> ScaleState:
        """Read the device tensors back into the Python values (one sync) and return ``self``."""
        dev = self.device
        if dev is None:
            return self
        values = torch.stack([getattr(dev, name).double() for name in _COUNTERS]).tolist()
        for (name, (dtype, _)), value in zip(_COUNTERS.items(), values, strict=True):
            # float64 holds every int32/int64 count below 2**53 exactly
            setattr(self, name, float(value) if dtype.is_floating_point else type(getattr(self, name))(value))
        n = min(self.updates, self.history_size)
        order = [(self.updates - n + i) % self.history_size for i in range(n)]
        self.history = dev.history[order].tolist()
        return self

    def host_copy(self) -> ScaleState:
        """A copy with Python values only (for pickling); this record keeps its device tensors."""
        return dataclasses.replace(self.to_python(), history=list(self.history), device=None)

    def as_dict(self) -> dict[str, Any]:
        """The ``state_dict`` entries of the counters (torch's ``scale`` and ``_growth_tracker`` too)."""
        self.to_python()
        out: dict[str, Any] = {key: getattr(self, name) for name, (_, key) in _COUNTERS.items()}
        return {**out, "_updates": self.updates, "scale_history": list(self.history)}

    def record(self, found: torch.Tensor | None) -> None:
        """Sync-free bookkeeping of one iteration: the scale it used and, when its inf checks are known
        (``found``), whether it skipped, how many skipped in all and in a row."""
        dev = self.device
        assert dev is not None, "record() needs the device tensors"
        dev.history[self.updates % self.history_size].copy_(dev.scale)
        self.updates += 1
        if found is not None:
            skipped = found > 0
            dev.last_skipped.copy_(skipped)
            dev.skipped.add_(skipped)
            dev.consecutive.copy_(torch.where(skipped, dev.consecutive + 1, 0))

    def read(self, name: str) -> Any:
        """One counter's current value (a sync when it lives on the device)."""
        dev = self.device
        return getattr(self, name) if dev is None else getattr(dev, name).item()

    def load(self, saved: dict[str, Any], hysteresis: int) -> None:
        """Take the counters from a ``state_dict`` (torch's has only ``scale`` and ``_growth_tracker``:
        the rest start fresh), re-creating the device tensors on the same device if there are any."""
        fresh = ScaleState(scale=saved["scale"], hysteresis_left=hysteresis, history_size=self.history_size)
        for name, (_, key) in _COUNTERS.items():
            setattr(self, name, saved.get(key, getattr(fresh, name)))
        self.updates = saved.get("_updates", 0)
        self.history = list(saved.get("scale_history", []))
        if self.device is not None:
            self.to_device(self.device.scale.device)


# ---------------------------------------------------------------------------------------------- the rule
def update_dynamic(config: ScaleConfig, dev: DeviceCounters, found: torch.Tensor) -> None:
    """One iteration of dynamic scaling on the device: back off on overflow (after the hysteresis
    allowance), grow after ``growth_interval`` clean iterations, stay within [floor, max_scale]. No sync."""
    if config.hysteresis == 1:
        # torch's fused kernel: exactly torch.amp.GradScaler's rule.
        torch._amp_update_scale_(
            dev.scale, dev.growth_tracker, found, config.growth_factor, config.backoff_factor,
            config.growth_interval,
        )  # fmt: skip
    else:
        _update_with_hysteresis(config, dev, found > 0)
    dev.scale.clamp_(min=config.floor, max=config.max_scale)


def count_clean(dev: DeviceCounters, found: torch.Tensor) -> None:
    """A static scale's bookkeeping: the growth tracker counts the clean iterations since the last overflow
    (apex's ``unskipped``, which apex counts at a static scale too), the scale stays. torch's fused update
    with both factors 1 is exactly that, in one kernel and without a sync (scale * 1.0 is exact)."""
    torch._amp_update_scale_(dev.scale, dev.growth_tracker, found, 1.0, 1.0, MAX_COUNT)


def _spend_deepspeed(left: torch.Tensor, overflow: torch.Tensor, hysteresis: int) -> torch.Tensor:
    """DeepSpeed's DynamicLossScaler / Megatron's rule: the first ``hysteresis - 1`` overflows spend the
    allowance; once it is spent every further overflow backs off, until a growth restores it."""
    back_off = overflow & (left <= 1)
    left.sub_((overflow & ~back_off).to(left.dtype))
    return back_off


def _spend_consecutive(left: torch.Tensor, overflow: torch.Tensor, hysteresis: int) -> torch.Tensor:
    """mixprec 0.x's rule: back off once per ``hysteresis`` consecutive overflowing iterations; a clean
    iteration (or a back-off) restores the allowance."""
    left.copy_(torch.where(overflow, left - 1, hysteresis))
    back_off = overflow & (left <= 0)
    left.masked_fill_(back_off, hysteresis)
    return back_off


_SPEND = {"deepspeed": _spend_deepspeed, "consecutive": _spend_consecutive}


def _update_with_hysteresis(config: ScaleConfig, dev: DeviceCounters, overflow: torch.Tensor) -> None:
    """Like torch's rule with an overflow allowance. Every overflow resets the growth tracker; a growth
    restores the allowance. Written as tensor ops: no sync."""
    back_off = _SPEND[config.hysteresis_rule](dev.hysteresis_left, overflow, config.hysteresis)
    tracker = dev.growth_tracker
    tracker.copy_(torch.where(overflow, 0, tracker + 1))
    due = tracker >= config.growth_interval
    grown = dev.scale * config.growth_factor
    grow = due & torch.isfinite(grown)  # grow only to a finite scale, as torch's kernel does
    tracker.masked_fill_(due, 0)
    dev.hysteresis_left.masked_fill_(due, config.hysteresis)
    dev.scale.copy_(
        torch.where(back_off, dev.scale * config.backoff_factor, torch.where(grow, grown, dev.scale))
    )
