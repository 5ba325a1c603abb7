"""The ladder's measured story: lost updates against IEEE rounding, the pure bf16 rungs' bytes and accuracy,
the small-gradient experiment where loss scaling matters, and notes that follow what was measured."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mixprec
from mixprec import hardware, ladder
from mixprec.ladder_output import explain, measured_notes
from mixprec.ladder_probes import below_half_spacing

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = ladder.CompareSettings(size=None, epochs=2, lr=0.05, batch_size=128, hidden=64)
PURE_KEYS = ("fp32", "fp16-naive", "pure-bf16", "pure-bf16+stochastic", "pure-bf16+kahan", "pure-bf16+split",
             "bf16")


def _data() -> mixprec.DataBunch:
    return mixprec.digits(batch_size=SETTINGS.batch_size, seed=0)


@pytest.fixture(scope="module")
def results() -> dict[str, ladder.RungResult]:
    model = SETTINGS.build_model(_data())
    rungs = [ladder.ALL_RUNGS[k] for k in PURE_KEYS]
    return {r.key: r for r in ladder.run_ladder(rungs, _data, model, SETTINGS)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_below_half_spacing_is_where_rounding_to_nearest_keeps_the_weight(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(20000, generator=g) * 0.05).to(dtype)
    update = torch.randn(20000, generator=g) * 10.0 ** torch.randint(-8, -2, (20000,), generator=g)
    kept = (weight.float() + update).to(dtype) == weight  # IEEE-754 round to nearest: the reference
    predicted = below_half_spacing(weight, update)
    assert torch.equal(predicted & ~kept, torch.zeros_like(kept))  # predicted lost => lost
    tie = (update.double().abs() * 2 == (torch.nextafter(weight, weight + update.sign().to(dtype))
                                          .double() - weight.double()).abs())
    assert torch.equal((kept & ~predicted) & ~tie, torch.zeros_like(kept))  # lost => predicted, but ties
    # The classic stall: 1.0 - 1e-4 is 1.0 in bf16 (half the spacing below 1.0 is 2**-9 ~ 0.002).
    assert below_half_spacing(torch.ones(1, dtype=torch.bfloat16), torch.full((1,), -1e-4)).all()


def test_half_weights_lose_the_updates_the_theory_predicts(results: dict[str, ladder.RungResult]) -> None:
    for key in ("fp16-naive", "pure-bf16"):
        r = results[key]
        assert r.lost_update_pct is not None and r.predicted_lost_pct is not None
        assert r.lost_update_pct > 1  # at this lr a share of the updates is below half an ulp
        assert abs(r.lost_update_pct - r.predicted_lost_pct) < 1.0


def test_pure_bf16_modes_keep_the_updates_and_the_accuracy(results: dict[str, ladder.RungResult]) -> None:
    naive, masters = results["pure-bf16"], results["bf16"]
    assert masters.valid_accuracy is not None and naive.lost_update_pct is not None
    for key in ("pure-bf16+kahan", "pure-bf16+split"):
        r = results[key]
        assert r.lost_update_pct is not None and r.lost_update_pct < naive.lost_update_pct / 10
        assert r.valid_accuracy is not None and abs(r.valid_accuracy - masters.valid_accuracy) <= 0.01
    stochastic = results["pure-bf16+stochastic"]
    assert stochastic.valid_accuracy is not None
    assert abs(stochastic.valid_accuracy - masters.valid_accuracy) <= 0.01


def test_bytes_per_param_counted_from_first_principles(results: dict[str, ladder.RungResult]) -> None:
    # Plain SGD keeps no state. fp32: weight + grad 4 + 4; pure bf16: 2 + 2; Kahan: + a bf16 compensation;
    # 16+16 split: + the int16 low half; fp32 masters: 2 + 2 + master 4 + its grad 4.
    expected = {"fp32": 8, "fp16-naive": 4, "pure-bf16": 4, "pure-bf16+stochastic": 4, "pure-bf16+kahan": 6,
                "pure-bf16+split": 6, "bf16": 12}
    assert {k: results[k].bytes_per_param for k in expected} == pytest.approx(expected)


def test_explanations_compare_each_rung_with_its_base(results: dict[str, ladder.RungResult]) -> None:
    all_results = list(results.values())
    kahan, stochastic = results["pure-bf16+kahan"], results["pure-bf16+stochastic"]
    line = explain(kahan, all_results)
    assert line.startswith(f"vs {stochastic.label}:")
    assert f"updates lost {stochastic.lost_update_pct:.1f}% -> {kahan.lost_update_pct:.1f}%" in line
    assert "bytes/param 4.0 -> 6.0" in line
    assert explain(results["fp32"], all_results) == ladder.ALL_RUNGS["fp32"].lesson


def test_fp16_naive_says_what_underflowed_beside_what_rounded_away() -> None:
    """In the small-gradient experiment 99% of fp16's gradients flush to 0 and no update is "lost" (only
    nonzero gradients count): the line and the note said 0% lost and nothing of the flush (a user trial)."""
    ran = [ladder.RungResult("fp32", "fp32", "ok", zero_grad_pct=6.7, lost_update_pct=0.0),
           ladder.RungResult("fp16-naive", "fp16 naive", "ok", zero_grad_pct=99.0, lost_update_pct=0.0,
                             predicted_lost_pct=0.0)]
    assert "grads 0 6.7% -> 99.0%" in explain(ran[1], ran)
    note = next(n for n in measured_notes(ran) if n.startswith("fp16 naive:"))
    assert "underflowed to 0 is in grads 0 % (99.0% here)" in note


@pytest.mark.parametrize("arithmetic", ["native", "emulated"])
def test_notes_say_which_arithmetic_ran(arithmetic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hardware.ENV_VAR, arithmetic)
    recipe = ladder.ALL_RUNGS["bf16"].recipe
    assert ladder.arithmetic_of(recipe, torch.device("cpu")) == f"bf16 {arithmetic}"
    ran = [ladder.RungResult("fp32", "fp32", "ok", ms_per_step=10.0),
           ladder.RungResult("bf16", "bf16 + master", "ok", ms_per_step=12.0,
                             arithmetic=f"bf16 {arithmetic}")]
    notes = measured_notes(ran)
    assert any(n.startswith(f"bf16 GEMMs ran {arithmetic}") and "bf16 + master 1.20x" in n for n in notes)
    assert not any("fp16 GEMMs" in n for n in notes)  # no fp16 rung ran: nothing said about fp16


@pytest.mark.parametrize(("ms", "warned"), [(12.0, False), (3.0, True)])
def test_an_emulated_rung_far_faster_than_fp32_is_called_load_noise(
    ms: float, warned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A shared machine slowed the fp32 rung in a real `make demo`: emulated rungs read 0.30x of it.
    monkeypatch.setenv(hardware.ENV_VAR, "emulated")
    ran = [ladder.RungResult("fp32", "fp32", "ok", ms_per_step=10.0),
           ladder.RungResult("bf16", "bf16 + master", "ok", ms_per_step=ms, arithmetic="bf16 emulated")]
    note = next(n for n in measured_notes(ran) if n.startswith("bf16 GEMMs ran emulated"))
    assert ("machine was busy" in note) is warned
    monkeypatch.setenv(hardware.ENV_VAR, "native")  # native half GEMMs may well beat fp32: no warning
    ran[1] = dataclasses.replace(ran[1], arithmetic="bf16 native")
    assert not any("machine was busy" in n for n in measured_notes(ran))


def test_small_gradients_need_loss_scaling() -> None:
    """The underflow experiment: fp32 takes the same steps as without the loss weight; unscaled fp16 with
    masters flushes most gradients to 0 and falls behind; a static scale of 512 gives fp32's run back."""
    base = ladder.CompareSettings(size=8, epochs=1, batch_size=256)
    settings = ladder.EXPERIMENTS["underflow"].derive(base)
    assert settings.loss_weight == 2.0**-16 and settings.lr == base.lr * 2**16
    data = lambda: mixprec.digits(batch_size=256, seed=0, size=8)  # noqa: E731
    model = settings.build_model(data())
    rungs = [ladder.ALL_RUNGS[k] for k in ("fp32", "fp16-master", "fp16-static")]
    fp32, unscaled, static = ladder.run_ladder(rungs, data, model, settings)
    unweighted = dataclasses.replace(settings, loss_weight=1.0, lr=base.lr)
    reference = ladder.run_rung(ladder.ALL_RUNGS["fp32"], data, model, unweighted)
    assert fp32.losses == pytest.approx(reference.losses, rel=1e-6)  # power-of-two weight: same fp32 steps
    assert fp32.flushed_grad_pct is not None and fp32.flushed_grad_pct > 50  # the histogram's verdict
    assert unscaled.zero_grad_pct is not None and unscaled.zero_grad_pct > 50
    assert unscaled.valid_accuracy is not None and fp32.valid_accuracy is not None
    assert unscaled.valid_accuracy < fp32.valid_accuracy - 0.05
    assert static.valid_accuracy == pytest.approx(fp32.valid_accuracy, abs=0.01)
    # The table's line for the static rung says so, in measured values.
    line = explain(static, [fp32, unscaled, static])
    assert f"grads 0 {unscaled.zero_grad_pct:.1f}% -> {static.zero_grad_pct:.1f}%" in line
    assert f"acc {100 * (static.valid_accuracy - unscaled.valid_accuracy):+.2f} pts" in line


def test_the_command_line_knows_every_rung() -> None:
    from mixprec.commands import compare

    assert compare.PURE_BF16_KEYS == tuple(r.key for r in ladder.PURE_BF16)
    assert compare.DEMO_KEYS == ladder.DEMO_RUNGS and set(compare.DEMO_KEYS) == set(ladder.ALL_RUNGS)
