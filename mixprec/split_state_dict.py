"""The state dict of a model whose bf16 weights are the high halves of split masters
(``mixprec.initialize(..., "O2", dtype=torch.bfloat16, split_masters=True)``): ``model.state_dict()`` holds
each parameter's exact fp32 master, and ``model.load_state_dict`` makes what it loads the master, both halves.

Why: the split layout keeps each fp32 master as the model's bf16 weight plus an int16 low half in the
optimizer. Before, the state dict held the bf16 weights (as fp32, apex O2's hook) and a load wrote only
them, so every master kept the low half of the weight it had before: within half a bf16 spacing of the
loaded value, not equal to it. Now a checkpoint of the model alone gives back the masters, fp32 weights loaded
after ``initialize`` (pretrained, or a checkpoint's) are the masters exactly, and it does not matter whether
``opt.load_state_dict`` (which holds the same low halves) comes before or after ``model.load_state_dict``.

The rule is one per load: whatever is loaded is the master (fp32; an fp64 value rounds to fp32 first). A
checkpoint of bf16 values (an older one, or one of plain O2) therefore sets low halves of 0. Writes that do
not go through ``load_state_dict`` (an in-place edit, ``.data``) leave the low halves as they are.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from mixprec.low_precision import LowPrecisionOptimizer, split_fp32

__all__ = ["hook_split_state_dict"]


def hook_split_state_dict(model: nn.Module, opt: LowPrecisionOptimizer) -> list[RemovableHandle]:
    """Hooks on each module of ``model`` that owns a parameter ``opt`` holds split masters of (see the module
    docstring). Register them after apex's fp32 state-dict hook: they run after it and replace what it
    wrote. Returns their handles (none when ``opt`` holds none of the model's parameters)."""
    lows = opt.low_halves()
    handles: list[RemovableHandle] = []
    for module in model.modules():
        own = {name: p for name, p in module.named_parameters(recurse=False) if p in lows}
        if own:
            save, load = partial(_save_masters, own=own, opt=opt), partial(_load_masters, own=own, lows=lows)
            handles.append(module._register_state_dict_hook(save))
            handles.append(module._register_load_state_dict_pre_hook(load))
    return handles


def _save_masters(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, *,
                  own: dict[str, Tensor], opt: LowPrecisionOptimizer) -> None:
    for name, p in own.items():
        if prefix + name in state_dict:
            state_dict[prefix + name] = opt.master_values([p])[0]  # the bf16 weight and its low half: fp32


def _load_masters(state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                  missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str], *,
                  own: dict[str, Tensor], lows: dict[Tensor, Tensor]) -> None:
    # `state_dict` is torch's own copy of the caller's mapping (per module): replacing an entry here changes
    # what this load writes, not the caller's dict.
    for name, p in own.items():
        value = state_dict.get(prefix + name)
        if not (isinstance(value, Tensor) and value.is_floating_point() and value.shape == p.shape
                and not value.is_meta):
            continue  # absent, holds no values, or torch's load reports what is wrong with it
        high, low = split_fp32(value.to(p.device))
        with torch.no_grad():
            lows[p].copy_(low)
        # torch's load copies this into the weight: the high half exactly, where copying the fp32 value
        # would round a tie to even, not away from zero as the split layout does
        state_dict[prefix + name] = high
