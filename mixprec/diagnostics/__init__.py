"""Tools that show what mixed precision does: memory, gradient exponents, overflows, casts.

Importing this package loads torch but not matplotlib or rich; plots and tables import them when made.
"""

# memory: bytes of one training step by component and precision
# gradients: exponent histograms of gradients against the fp16/bf16 ranges, suggested loss scale
# overflow: which gradients went inf/NaN, which module's forward made the first one
# cast trace: which aten ops ran in which dtype under autocast
from mixprec.diagnostics.cast_trace import CastRecord, CastTrace, OpRecord
from mixprec.diagnostics.gradients import (
    CastOutcome,
    GradientMonitor,
    GradientReport,
    GradStats,
    analyze_grads,
    grad_exponent_histogram,
    model_grads,
    suggest_loss_scale,
)
from mixprec.diagnostics.memory import (
    PRECISIONS,
    MemoryBreakdown,
    as_recipe,
    get_precision,
    memory_breakdown,
    memory_breakdowns,
    memory_table,
)
from mixprec.diagnostics.overflow import (
    BackwardEvent,
    NonfiniteEvent,
    NonfiniteGrad,
    NonfiniteTracer,
    TensorRange,
    nonfinite_grads,
    nonfinite_report,
    trace_nonfinite,
)

__all__ = [
    # memory
    "memory_breakdown",
    "memory_breakdowns",
    "memory_table",
    "MemoryBreakdown",
    "as_recipe",
    "PRECISIONS",
    "get_precision",
    # gradients
    "grad_exponent_histogram",
    "analyze_grads",
    "model_grads",
    "suggest_loss_scale",
    "GradientReport",
    "GradStats",
    "CastOutcome",
    "GradientMonitor",
    # overflow
    "nonfinite_grads",
    "nonfinite_report",
    "NonfiniteGrad",
    "trace_nonfinite",
    "NonfiniteTracer",
    "NonfiniteEvent",
    "BackwardEvent",
    "TensorRange",
    # cast trace
    "CastTrace",
    "OpRecord",
    "CastRecord",
]
