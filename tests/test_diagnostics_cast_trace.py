"""mixprec.diagnostics.cast_trace: the dtypes it records must be the dtypes torch produced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.autocast import autocast
from mixprec.diagnostics.cast_trace import CastTrace, dtype_label

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]
HALF_DTYPES = [torch.float16, torch.bfloat16]


def _setup(device: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    return model, torch.randn(4, 8, device=device), torch.randint(0, 4, (4,), device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_autocast_op_dtypes_match_torch(device: str, dtype: torch.dtype) -> None:
    model, x, y = _setup(device)
    with torch.autocast(device, dtype=dtype):  # the reference: what torch.autocast itself returns
        ref_logits = model(x)
        ref_log_probs = F.log_softmax(ref_logits, dim=1)
    with torch.autocast(device, dtype=dtype), CastTrace() as trace:
        F.log_softmax(model(x), dim=1)
    assert trace.dtypes_of("addmm") == {dtype_label(ref_logits.dtype)} == {dtype_label(dtype)}
    # log_softmax is on CUDA's fp32 list but not on CPU's: whatever torch did, the trace must say the same.
    assert trace.dtypes_of("_log_softmax") == {dtype_label(ref_log_probs.dtype)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_casts_are_counted_with_their_bytes(device: str, dtype: torch.dtype) -> None:
    model, x, _ = _setup(device)
    with torch.autocast(device, dtype=dtype), CastTrace() as trace:
        logits = model(x).float()
    casts = {(c.source, c.target): c for c in trace.casts}
    assert set(casts) == {("fp32", dtype_label(dtype)), (dtype_label(dtype), "fp32")}
    # x, both weights and both biases go fp32 -> half once each: their elements at 2 bytes.
    down = casts[("fp32", dtype_label(dtype))]
    assert down.count == 5 and down.bytes == 2 * (x.numel() + sum(p.numel() for p in model.parameters()))
    up = casts[(dtype_label(dtype), "fp32")]
    assert up.count == 1 and up.bytes == logits.numel() * 4
    assert "_to_copy" not in {r.op for r in trace.ops}


def test_no_autocast_means_fp32_and_no_casts() -> None:
    model, x, y = _setup("cpu")
    with CastTrace() as trace:
        F.cross_entropy(model(x), y)
    assert trace.casts == []
    assert set(trace.output_dtypes()) == {"fp32"}


def test_backward_ops_are_marked_and_views_left_out_by_default() -> None:
    model, x, y = _setup("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16), CastTrace() as trace:
        loss = F.cross_entropy(model(x), y)
    with trace:  # re-entering starts a fresh record
        loss.backward()
    # Everything the engine ran is "backward"; only backward()'s seed gradient is made before it starts.
    assert {r.op for r in trace.ops if r.phase == "forward"} == {"ones_like"}
    assert "mm" in {r.op for r in trace.ops}
    assert "t" not in {r.op for r in trace.ops}
    with CastTrace(include_views=True) as with_views:
        model(x)
    assert "t" in {r.op for r in with_views.ops}


def test_copy_between_dtypes_counts_as_a_cast() -> None:
    master, half = torch.randn(10), torch.empty(10, dtype=torch.float16)
    with CastTrace() as trace:
        half.copy_(master)  # master weights copied back to the model
        half.copy_(half.clone())  # same dtype: an ordinary op
    assert [(c.source, c.target, c.count, c.bytes) for c in trace.casts] == [("fp32", "fp16", 1, 20)]
    assert "copy_" in {r.op for r in trace.ops}


def test_mixprec_autocast_bf16_matches_torch() -> None:
    autocast = pytest.importorskip("mixprec.autocast").autocast
    model, x, y = _setup("cpu")
    with autocast("cpu", dtype=torch.bfloat16), CastTrace() as ours:
        F.cross_entropy(model(x), y)
    with torch.autocast("cpu", dtype=torch.bfloat16), CastTrace() as torchs:
        F.cross_entropy(model(x), y)
    assert ours.dtypes_of("addmm") == torchs.dtypes_of("addmm") == {"bf16"}


def test_report_is_plain_text_with_both_tables() -> None:
    model, x, y = _setup("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16), CastTrace() as trace:
        F.cross_entropy(model(x), y)
    text = trace.report()
    assert "addmm" in text and "Casts" in text and "bf16" in text and "\x1b[" not in text
    assert str(trace) == text


def test_cast_bytes_are_shown_in_the_memory_tables_binary_units() -> None:
    """The casts table said decimal kB/MB beside `mixprec memory`'s KiB/MiB (a user trial)."""
    model, x = nn.Linear(64, 64), torch.randn(16, 64)  # a 64x64 weight: 8 KiB in bf16
    with torch.autocast("cpu", dtype=torch.bfloat16), CastTrace() as trace:
        model(x)
    down = max((c for c in trace.casts if c.target == "bf16"), key=lambda c: c.bytes)
    unit, size = next((u, s) for u, s in (("MiB", 2**20), ("KiB", 2**10), ("B", 1)) if down.bytes >= s)
    shown = f"{down.bytes} B" if size == 1 else f"{down.bytes / size:.2f} {unit}"
    assert size > 1 and shown in trace.report()


def test_emulated_fp16_gemms_are_reported_as_emulated_fp16() -> None:
    # issue 15: mixprec computes CPU fp16 GEMMs with fp32 kernels on fp16-rounded inputs; the trace must
    # say fp16 arithmetic ran (emulated), where torch.autocast's own fp16 kernels say plain fp16.
    model, x, _ = _setup("cpu")
    with CastTrace() as ours:
        with autocast("cpu", dtype=torch.float16):
            out = model(x)
        out.float().sum().backward()  # backward outside the region, as torch recommends
    with CastTrace() as torchs:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        out.float().sum().backward()
    assert torchs.dtypes_of("addmm") == {"fp16"}
    assert ours.dtypes_of("addmm") == {"fp16 (emulated)"}
    assert ours.dtypes_of("mm", phase="backward") == {"fp16 (emulated)"}
    assert "fp32" not in {label for r in ours.ops if r.op in ("addmm", "mm") for label in r.inputs}
    with autocast("cpu", dtype=torch.bfloat16), CastTrace() as bf16:  # not emulated: plain bf16
        model(x)
    assert bf16.dtypes_of("addmm") == {"bf16"}


def test_ops_without_a_float_tensor_are_left_out() -> None:
    """A loss scaler's int counters and bool flags filled the trace's summary (a user trial): an op with
    no floating tensor in or out has no dtype story to tell."""
    import mixprec

    model, x, y = _setup("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**20)
    with CastTrace() as trace:
        with autocast("cpu", torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        torch.zeros(3, dtype=torch.int64).add_(1)  # an int-only op of the user's: left out too
    floats = {dtype_label(d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
    # labels may carry a note ("fp16 (emulated)"): the dtype is the first word
    dtypes_seen = [{label.split()[0] for label in (*r.inputs, *r.outputs)} for r in trace.ops]
    assert dtypes_seen and all(floats & seen for seen in dtypes_seen), trace.ops
    assert not {"int32", "int64"} & set(trace.output_dtypes())  # bool stays: isfinite of a float tensor
