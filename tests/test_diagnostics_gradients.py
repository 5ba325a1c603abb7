"""mixprec.diagnostics.gradients against hand-computed exponents and IEEE-754 fp16 rounding."""

from __future__ import annotations

import argparse
import copy
import re
from pathlib import Path

import matplotlib.image
import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

from mixprec.commands import grads as grads_command
from mixprec.diagnostics.gradients import (
    EXPONENTS,
    GradientMonitor,
    analyze_grads,
    grad_exponent_histogram,
    suggest_loss_scale,
)
from mixprec.errors import ConfigError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
INF, NAN = float("inf"), float("nan")

# Planted gradients, each with its floor(log2|g|) and its fate in fp16 at scale 1 and at scale 2, worked out
# from IEEE-754 binary16 (min subnormal 2^-24, min normal 2^-14, max 65504) and round-to-nearest-even.
PLANTED: list[tuple[float, int, str, str]] = [
    (2.0**-30, -30, "underflow", "underflow"),  # x2: 2^-29, still below 2^-25
    (-(2.0**-30), -30, "underflow", "underflow"),  # the sign does not matter
    (2.0**-25, -25, "underflow", "subnormal"),  # tie 0 | 2^-24 -> 0 (even); x2 = 2^-24 exactly
    (2.0**-25 * (1 + 2.0**-20), -25, "subnormal", "subnormal"),  # just above the tie: rounds to 2^-24
    (2.0**-14 - 2.0**-24, -15, "subnormal", "normal"),  # the largest subnormal; x2 = 2^-13 - 2^-23
    (2.0**-14 - 2.0**-25, -15, "normal", "normal"),  # tie largest subnormal | 2^-14 -> 2^-14 (even)
    (2.0**-10, -10, "normal", "normal"),
    (65519.0, 15, "normal", "overflow"),  # below the 65520 midpoint: 65504; x2 = 131038: inf
    (65520.0, 15, "overflow", "overflow"),  # tie 65504 | 2^16 -> 2^16 (even) = inf
]
N_ZEROS, N_NONFINITE = 3, 2


def _planted() -> torch.Tensor:
    values = [v for v, *_ in PLANTED] + [0.0] * N_ZEROS + [INF, NAN]
    return torch.tensor(values, dtype=torch.float32)


def test_thresholds_in_the_docstring_are_what_torch_does() -> None:
    # The reference for the classification: torch's own fp32 -> fp16 cast (IEEE round to nearest even).
    half = torch.tensor([2.0**-25, 2.0**-25 * (1 + 2.0**-20), 2.0**-14 - 2.0**-25, 65519.0, 65520.0]).half()
    assert half.tolist() == [0.0, 2.0**-24, 2.0**-14, 65504.0, INF]


def test_planted_exponents_and_fp16_outcomes() -> None:
    report = analyze_grads({"w": _planted()}, scales=(2.0,))
    stats = report.layers[0]
    expected_counts = {e: sum(1 for _, x, *_ in PLANTED if x == e) for e in EXPONENTS}
    assert dict(zip(EXPONENTS, stats.counts, strict=True)) == expected_counts
    assert (stats.zeros, stats.nonfinite, stats.nonzero) == (N_ZEROS, N_NONFINITE, len(PLANTED))
    for scale, column in ((1.0, 2), (2.0, 3)):
        outcome = stats.outcome(scale)
        assert outcome is not None
        for kind in ("underflow", "subnormal", "overflow"):
            n = sum(1 for row in PLANTED if row[column] == kind)
            assert getattr(outcome, kind) == n, (scale, kind)
            assert outcome.fraction(kind) == n / len(PLANTED)
    assert stats.max_abs == 65520.0 and stats.min_abs == 2.0**-30


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gradient_dtype_does_not_change_the_report(dtype: torch.dtype) -> None:
    # Powers of two in fp16's normal range are exact in every dtype: same histogram, same outcomes.
    values = torch.tensor([2.0**-14, -(2.0**-3), 2.0**0, 2.0**7, 0.0, 2.0**-14])
    ref = analyze_grads({"w": values}, scales=(2.0**10,))
    got = analyze_grads({"w": values.to(dtype)}, scales=(2.0**10,))
    assert got.overall.counts == ref.overall.counts and got.overall.outcomes == ref.overall.outcomes


def test_a_complex_gradient_is_read_as_its_real_and_imaginary_parts() -> None:
    """A purely imaginary gradient of ~1e-6 (an FNO's complex weight) was reported as all zeros: .float()
    of a complex tensor keeps the real part only (a trial). Both parts are values the format must hold."""
    grad = torch.complex(torch.zeros(4), torch.tensor([1.7e-6, -7.4e-7, 2.0**-3, 65504.0 * 2]))
    got = analyze_grads({"w": grad}, scales=(2.0**10,))
    ref = analyze_grads({"w": torch.view_as_real(grad)}, scales=(2.0**10,))
    assert got.overall == ref.overall
    assert got.overall.max_abs == 65504.0 * 2 and got.overall.zeros == 4


def test_half_gradients_zeros_are_said_to_hide_underflow() -> None:
    """A user trial: an fp16 model's gradients, 89% of them zeros lost in its backward, were reported as
    "0% underflow to 0" with no word that the zeros were excluded values of a half format."""
    values = torch.tensor([2.0**-10, 0.0, 0.0, 0.0])
    half = analyze_grads({"w": values.to(torch.float16)}).summary()
    assert "float16: 75% of them are zero" in half and "fp32 copy" in half
    assert "fp32 copy" not in analyze_grads({"w": values}).summary()


def test_a_report_prints_in_a_line_and_names_its_views() -> None:
    """A user trial: print(report) dumped every histogram bin of every parameter."""
    report = analyze_grads({"w": _planted(), "b": torch.zeros(3)})
    text = repr(report)
    assert len(text) < 200 and "2 parameters" in text and ".summary()" in text
    assert "non-zero gradients," in repr(analyze_grads({"w": torch.zeros(3)}))  # no range of nothing


def test_overall_is_the_sum_of_layers() -> None:
    a, b = _planted(), torch.tensor([2.0**-40, 1.0, 0.0])
    report = analyze_grads([("a", a), ("b", b)], scales=(8.0,))
    overall = report.overall
    assert overall.name == "all"
    assert overall.counts == tuple(x + y for x, y in zip(report.layers[0].counts, report.layers[1].counts,
                                                         strict=True))
    assert overall.zeros == N_ZEROS + 1 and overall.numel == a.numel() + b.numel()
    assert overall.outcome(8.0).underflow == report.layers[0].outcome(8.0).underflow + 1  # 2^-37


def test_suggested_scale_is_the_largest_power_of_two_under_the_margin() -> None:
    # max|g| = 2^-3, margin 8: S * 2^-3 * 8 <= 65504 -> S <= 65504 -> 2^15.
    assert suggest_loss_scale(2.0**-3, margin=8.0) == 2.0**15
    # An exact boundary: max|g| * margin * 1024 == 65504 is allowed, 2048 is not.
    assert suggest_loss_scale(65504.0 / 8 / 1024, margin=8.0) == 1024.0
    assert suggest_loss_scale(65504.0 / 8 / 1024 * (1 + 2.0**-20), margin=8.0) == 512.0
    assert suggest_loss_scale(0.0) is None and suggest_loss_scale(INF) is None
    report = analyze_grads({"w": torch.tensor([2.0**-3, 2.0**-40, 2.0**-27])})
    assert report.suggested_scale == 2.0**15 and 2.0**15 in report.scales
    at = report.overall.outcome(2.0**15)
    # x 2^15: 2^-40 -> 2^-25 (still underflows, the tie), 2^-27 -> 2^-12 (normal).
    assert at is not None and (at.underflow, at.subnormal, at.overflow) == (1, 0, 0)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))


def test_model_and_batch_match_autograd_and_leave_grad_alone() -> None:
    model = _model()
    x, y = torch.randn(8, 12), torch.randint(0, 3, (8,))
    report = grad_exponent_histogram(model, (x, y), loss_scale=1024.0)
    assert all(p.grad is None for p in model.parameters())
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y).backward()
    expected = analyze_grads({n: p.grad for n, p in reference.named_parameters()}, scales=(1024.0,))
    assert [s.name for s in report.layers] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert report.layers == expected.layers


def test_existing_grads_are_unscaled_by_grad_scale() -> None:
    model = _model()
    x, y = torch.randn(8, 12), torch.randint(0, 3, (8,))
    (F.cross_entropy(model(x), y) * 2.0**10).backward()
    scaled = grad_exponent_histogram(model, grad_scale=2.0**10)
    plain = grad_exponent_histogram(_model(), (x, y))
    assert scaled.overall.counts == plain.overall.counts


def test_monitor_analyses_every_nth_step_at_the_current_scale() -> None:
    model = _model()
    scale = [4.0]
    monitor = GradientMonitor(model, every=2, loss_scale=lambda: scale[0])
    for _ in range(3):
        model.zero_grad()
        (F.cross_entropy(model(torch.randn(4, 12)), torch.randint(0, 3, (4,))) * scale[0]).backward()
        monitor.after_backward()
        scale[0] *= 2
    assert [call for call, _ in monitor.reports] == [1, 3]
    assert monitor.latest is not None and 16.0 in monitor.latest.scales
    with pytest.raises(ConfigError, match="every"):
        GradientMonitor(model, every=0)


def test_user_errors() -> None:
    with pytest.raises(ConfigError, match="backward"):
        analyze_grads({})
    with pytest.raises(ConfigError, match="positive"):
        analyze_grads({"w": torch.ones(2)}, scales=(0.0,))
    report = analyze_grads({"w": torch.ones(2)}, scales=(4.0,))
    with pytest.raises(ConfigError, match="not evaluated"):
        report.table(8.0)


def _png_ok(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and min(image.shape[:2]) > 100


def test_table_summary_and_png(tmp_path: Path) -> None:
    from rich.console import Console

    report = analyze_grads([("a", _planted()), ("b", torch.tensor([1e-3, 2e-5]))], scales=(1024.0,))
    console = Console(width=200, record=True)
    console.print(report.table())
    text = console.export_text()
    assert "underflow x1024" in text and "all" in text
    summary = report.summary()
    assert "exact zeros" in summary and "Suggested loss scale" in summary
    _png_ok(report.plot(tmp_path / "grads.png"))


def test_cli_grads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    grads_command.add_arguments(parser)
    png = tmp_path / "g.png"
    args = parser.parse_args(["--model", "mlp", "--data", "synthetic", "--batch-size", "16", "--loss-scale",
                              "1024", "--png", str(png)])
    assert grads_command.run(args) == 0
    out = capsys.readouterr().out
    assert "Suggested loss scale" in out and "x1024" in out
    _png_ok(png)
    assert grads_command.run(parser.parse_args(["--loss-scale", "-1", "--no-png"])) == 2


def test_a_gradient_without_finite_non_zero_values() -> None:
    g = torch.tensor([0.0, INF, -INF, NAN, 0.0])
    report = analyze_grads([("dead", g), ("live", torch.tensor([2.0**-3]))])
    dead = report.layers[0]
    # Reference: torch's own counts on the same tensor.
    assert (dead.zeros, dead.nonfinite) == (int((g == 0).sum()), int((~g.isfinite()).sum()))
    assert dead.nonzero == 0 and sum(dead.counts) == 0 and (dead.max_abs, dead.min_abs) == (0.0, INF)
    assert all(o.nonzero == 0 and o.fraction("underflow") == 0.0 for o in dead.outcomes)
    assert report.suggested_scale == suggest_loss_scale(2.0**-3)


@pytest.mark.parametrize(("values", "said"), [
    ([INF, NAN, -INF, 1.0 * INF], "Every non-zero gradient is inf/NaN (4 of 4)"),
    ([0.0, 0.0], "Every gradient is exactly zero"),
])
def test_a_report_with_nothing_finite_says_so_instead_of_a_range(values: list[float], said: str) -> None:
    """All inf/NaN is what an overflowing step's gradients look like; the summary printed "|g| from inf to
    0" and "0% overflow" there (a user trial)."""
    report = analyze_grads([("w", torch.tensor(values))])
    summary = report.summary()
    assert said in summary
    assert "|g| from" not in summary and "%" not in summary
    console = Console(width=200, record=True)
    console.print(report.table())
    row = next(line for line in console.export_text().splitlines() if line.startswith("│ w "))
    assert "%" not in row  # no fraction of an empty set
    assert row.split("│")[4].strip() == f"{sum(not torch.tensor(v).isfinite() for v in values):,}"  # inf/NaN


def test_summary_states_the_fp16_thresholds_torch_casts_by() -> None:
    """The limits quoted in the summary are derived from mixprec.formats; torch's cast is the reference."""
    text = analyze_grads({"w": torch.tensor([1.0, 2.0**-20])}).summary()
    match = re.search(r"keeps \|x\| > 2\^(-?\d+) .* below 2\^(-?\d+), inf from ([\d.]+)", text)
    assert match is not None, text
    zero_below, normal_from, inf_from = 2.0 ** int(match[1]), 2.0 ** int(match[2]), float(match[3])
    # Neighbours in fp32, the dtype the gradients are analysed in.
    at = torch.tensor([zero_below, normal_from, inf_from])
    up, down = torch.nextafter(at, torch.full_like(at, INF)), torch.nextafter(at, torch.zeros_like(at))
    cast = torch.stack([at[0], up[0], at[1], down[1], at[2], down[2]]).half()
    assert cast[0] == 0 and cast[1] > 0
    assert cast[2] == torch.finfo(torch.float16).smallest_normal
    assert cast[3] == torch.finfo(torch.float16).smallest_normal  # rounds up: the subnormal range ends below
    assert cast[4].isinf() and cast[5].isfinite()
    assert f"<= {torch.finfo(torch.float16).max:g}" in text


@pytest.mark.parametrize("returned", [None, "vector"])
def test_a_loss_fn_that_returns_no_loss_is_named(returned: str | None) -> None:
    """A user trial (an HF-style model returning (logits, None) without labels): `None * 1.0` TypeError."""
    model = nn.Linear(4, 3)
    batch = (torch.randn(5, 4), torch.zeros(5, dtype=torch.long))
    loss_fn = (lambda out, y: None) if returned is None else (lambda out, y: out.sum(1))
    with pytest.raises(ConfigError, match="loss_fn returned .*one-element tensor"):
        grad_exponent_histogram(model, batch, loss_fn=loss_fn)


def test_model_grads_of_a_model_of_several_inputs() -> None:
    """A trial's CapsNet (whose forward takes the labels too) was refused: x may be the model's inputs."""
    from mixprec.diagnostics.gradients import model_grads

    torch.manual_seed(0)
    body, head = nn.Linear(6, 4), nn.Linear(4, 3)
    model = nn.ModuleDict({"body": body, "head": head})
    model.forward = lambda x, scale: head(body(x) * scale)  # type: ignore[method-assign]
    x, scale, y = torch.randn(5, 6), torch.rand(5, 1), torch.randint(0, 3, (5,))
    got = model_grads(model, ((x, scale), y))
    want = torch.autograd.grad(F.cross_entropy(head(body(x) * scale), y), list(model.parameters()))
    assert list(got) == [n for n, _ in model.named_parameters()]
    for g, w in zip(got.values(), want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)



def test_the_histogram_of_a_batch_leaves_the_model_and_its_randomness_as_they_were() -> None:
    """A trial: grad_exponent_histogram(model, batch) moved BatchNorm's running statistics (and fired a
    Glow's data-dependent init); dropout drew from the global generator, so the run after it changed."""
    from mixprec.diagnostics.gradients import grad_exponent_histogram

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = (torch.randn(5, 6), torch.randint(0, 3, (5,)))
    state = torch.get_rng_state()
    grad_exponent_histogram(model, batch)
    assert torch.equal(torch.get_rng_state(), state)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
