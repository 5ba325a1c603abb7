"""The state dict of a model whose bf16 weights are the high halves of split masters
(``mixprec.initialize(..., "O2", dtype=torch.bfloat16, split_masters=True)``): ``model.state_dict()`` holds
each parameter's exact fp32 master, and ``model.load_state_dict`` makes what it loads the master, both halves.

Why: the split layout keeps each fp32 master as the model's bf16 weight plus an int16 low half in the
optimizer. Before, the state dict held the bf16 weights (as fp32, apex O2's hook) and a load wrote only
them, so every master kept the low half of the weight it had before: within half a bf16 spacing of the
loaded value, not equal to it. Now a checkpoint of the model alone gives back the masters, fp32 weights loaded
after ``initialize`` (pretrained, or a checkpoint's) are the masters exactly, and it does not matter whether
``opt.load_state_dict`` (which holds the same low halves) comes before or after ``model.load_state_dict``.

The rule, element by element: whatever is loaded is the master (fp32; an fp64 value rounds to fp32 first),
but a value that is exactly a bf16 value (a low half of 0) keeps the low half there where the optimizer's
state was just loaded (``opt.load_state_dict`` since the last step, and this weight not loaded since: its
low half awaits it) or where it is the weight the model holds already. So a checkpoint of bf16
values (an older one of this layout) resumes in either order too, and bf16 weights loaded later (pretrained
ones) are the masters exactly, but for elements equal to the weight already there (they keep its low half).
Writes that do not go through ``load_state_dict`` (an in-place edit, ``.data``) leave the low halves as
they are. The hooks look the low halves up when they run, so a param group added to the optimizer after
``initialize`` is covered too.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from mixprec.half_model import share_tied_entries
from mixprec.low_precision import LowPrecisionOptimizer, split_fp32

__all__ = ["hook_split_state_dict"]


def hook_split_state_dict(model: nn.Module, opt: LowPrecisionOptimizer) -> list[RemovableHandle]:
    """Hooks on each module of ``model`` that owns parameters (see the module docstring); those ``opt``
    holds no split master of are left to torch. Register them after apex's fp32 state-dict hook: they run
    after it and replace what it wrote. Returns their handles."""
    handles: list[RemovableHandle] = []
    for module in model.modules():
        own = dict(module.named_parameters(recurse=False))
        if own:
            save, load = partial(_save_masters, own=own, opt=opt), partial(_load_masters, own=own, opt=opt)
            handles.append(module._register_state_dict_hook(save))
            handles.append(module._register_load_state_dict_pre_hook(load))
    handles += share_tied_entries(model)  # after the hooks above: a tied master saved once
    return handles


def _save_masters(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, *,
                  own: dict[str, Tensor], opt: LowPrecisionOptimizer) -> None:
    for name, p in own.items():
        if prefix + name in state_dict and opt.low_half(p) is not None:
            state_dict[prefix + name] = opt.master_values([p])[0]  # the bf16 weight and its low half: fp32


@torch.no_grad()
def _load_masters(state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                  missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str], *,
                  own: dict[str, Tensor], opt: LowPrecisionOptimizer) -> None:
    # `state_dict` is torch's own copy of the caller's mapping (per module): replacing an entry here changes
    # what this load writes, not the caller's dict.
    for name, p in own.items():
        value, low_now = state_dict.get(prefix + name), opt.low_half(p)
        if low_now is None or not (isinstance(value, Tensor) and value.is_floating_point()
                                   and value.shape == p.shape and not value.is_meta):
            continue  # not a split master, absent, holds no values, or torch's load reports what is wrong
        high, low = split_fp32(value.to(p.device))
        # a low half of 0 is a value that is exactly its bf16 weight: it keeps the low half there where that
        # came with the checkpoint (the optimizer's state, loaded first) or the weight is already this one
        same = high.view(torch.int16) == p.view(torch.int16)
        awaited = opt.low_half_awaits_weight(p)
        keep = low == 0 if awaited else (low == 0) & same
        low_now.copy_(torch.where(keep, low_now, low))
        # torch's load copies this into the weight: the high half exactly, where copying the fp32 value
        # would round a tie to even, not away from zero as the split layout does
        state_dict[prefix + name] = high
