"""Op names as policy tables spell them: torch's operator names without namespace and overload.

:func:`op_name` maps Python callables, ``torch.ops.aten`` overloads and aliases (``Tensor.__matmul__`` ->
``"matmul"``, ``F.cross_entropy`` -> ``"cross_entropy_loss"``) to them.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import torch

from mixprec.errors import PolicyError

__all__ = ["CALLED_INSIDE", "MIXPREC_OP_ATTR", "PY_ALIASES", "is_torch_callable", "op_name", "python_names"]

# Python-level names whose torch operator has another name. Autocast tables use operator names.
PY_ALIASES: Mapping[str, str] = types.MappingProxyType(
    {
        "__matmul__": "matmul",
        "__rmatmul__": "matmul",
        "__pow__": "pow",
        "__rpow__": "pow",
        "__ipow__": "pow",
        "cross_entropy": "cross_entropy_loss",
        "grid_sample": "grid_sampler",
    }
)

# Operators torch's autocast tables list that torch calls from C++ inside another function, so Python code
# (and so mixprec's layer) never calls them: a user rule for one would never act. -> what to name instead.
CALLED_INSIDE: Mapping[str, str] = types.MappingProxyType(
    {
        "mkldnn_rnn_layer": "lstm (and gru, rnn_tanh, rnn_relu: nn.LSTM/GRU/RNN)",
        "_thnn_fused_lstm_cell": "lstm_cell",
        "_thnn_fused_gru_cell": "gru_cell",
        "cudnn_convolution": "conv1d, conv2d or conv3d",
        "cudnn_convolution_transpose": "conv_transpose1d, conv_transpose2d or conv_transpose3d",
        "_scaled_dot_product_flash_attention": "scaled_dot_product_attention",
    }
)

MIXPREC_OP_ATTR = "__mixprec_op__"


def is_torch_callable(fn: object) -> bool:
    module = getattr(fn, "__module__", None)
    if module is None:  # method descriptors of torch.Tensor (Tensor.softmax) have no __module__
        return getattr(fn, "__objclass__", None) is torch._C.TensorBase
    return module == "torch" or module.startswith(("torch.", "torch._C"))


def op_name(op: object) -> str:
    """Normalize ``op`` to the name policy tables use.

    Accepts a name (``"mm"``, ``"aten::mm"``, ``"aten.mm.default"``, ``"__matmul__"``), a
    ``torch.ops.aten`` op or overload, a torch function or Tensor method, or a user function (its
    ``module.qualname``; a function wrapped by a register_* decorator keeps its registered name).
    """
    if isinstance(op, str):
        if op.startswith(("aten::", "aten.")):
            op = op.split("::", 1)[1] if "::" in op else op.split(".", 1)[1]
            op = op.split(".", 1)[0]
        return PY_ALIASES.get(op, op)
    if isinstance(op, torch._ops.OpOverload):
        return op_name(op._schema.name)
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op_name(op._qualified_op_name)
    registered = getattr(op, MIXPREC_OP_ATTR, None)
    if registered is not None:
        return registered
    name = getattr(op, "__name__", None)
    if name is None or not callable(op):
        raise PolicyError(f"cannot name op {op!r}", "pass an op name string, a torch function or a callable")
    if is_torch_callable(op):
        return PY_ALIASES.get(name, name)
    return f"{getattr(op, '__module__', '?')}.{getattr(op, '__qualname__', name)}"



def python_names(op: str) -> list[str]:
    """Every Python-level function name that reaches operator ``op`` (``matmul``: also ``__matmul__``)."""
    return [op] + [alias for alias, target in PY_ALIASES.items() if target == op]
