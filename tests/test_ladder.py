"""The compare ladder: rungs as data, what each rung measures against fp16 arithmetic and an fp32 run,
memory counted from first principles, outputs."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import mixprec
from mixprec import ladder
from mixprec.callbacks import AutocastMixedPrecision, MixedPrecision
from mixprec.errors import ConfigError
from mixprec.low_precision import UpdateMode
from mixprec.recipe import FASTAI_LOSS_SCALE, RECIPES

pytestmark = pytest.mark.usefixtures("one_thread")


N_HIDDEN = 64
SETTINGS = ladder.CompareSettings(size=None, epochs=2, lr=0.002, batch_size=128)


def _data() -> mixprec.DataBunch:
    return mixprec.digits(batch_size=SETTINGS.batch_size, seed=0)


@pytest.fixture(scope="module")
def results() -> dict[str, ladder.RungResult]:
    torch.manual_seed(0)
    model = mixprec.build_model("mlp", _data(), n_hidden=N_HIDDEN)
    return {r.key: r for r in ladder.run_ladder(ladder.LADDER, _data, model, SETTINGS)}


def test_rungs_are_data() -> None:
    assert len(ladder.RUNGS) == len(ladder.LADDER) == 7
    assert [r.key for r in ladder.LADDER][0] == "fp32"
    callbacks = {r.key: next(iter(ladder.callbacks_for(r)), None) for r in ladder.LADDER}
    assert callbacks["fp32"] is None
    naive = callbacks["fp16-naive"]
    assert isinstance(naive, MixedPrecision) and not naive.master_weights and naive.loss_scale is None
    assert isinstance(callbacks["fp16-static"], MixedPrecision) and not callbacks["fp16-static"].dynamic
    assert isinstance(callbacks["o1"], AutocastMixedPrecision)
    assert isinstance(callbacks["bf16"], MixedPrecision) and callbacks["bf16"].dtype == torch.bfloat16
    # An inconsistent rung is refused: a low-precision update mode needs pure half weights (no masters).
    with pytest.raises(ConfigError, match="pure-bf16"):
        ladder.Rung("bad", "bad", "Kahan over fp32 masters", RECIPES["bf16"], UpdateMode.KAHAN)
    with pytest.raises(ConfigError, match="epochs"):
        ladder.CompareSettings(epochs=0)


def test_every_rung_runs(results: dict[str, ladder.RungResult]) -> None:
    for r in results.values():
        assert r.ok, r.status
        assert r.train_loss is not None and math.isfinite(r.train_loss)
        assert len(r.losses) == SETTINGS.epochs * len(_data().train)


def test_masters_track_fp32_and_naive_fp16_loses_updates(results: dict[str, ladder.RungResult]) -> None:
    fp32, naive, master = results["fp32"], results["fp16-naive"], results["fp16-master"]
    assert naive.lost_update_pct is not None and master.lost_update_pct is not None
    # lr * grad is mostly below half the fp16 spacing at the weights: most fp16 updates round away
    assert naive.lost_update_pct > 50 > 1 > master.lost_update_pct
    assert fp32.lost_update_pct is not None and fp32.lost_update_pct < 1
    # with masters the run stays with fp32 (the rounding of the forward is all that differs)
    gap = [abs(a - b) for a, b in zip(master.losses, fp32.losses, strict=True)]
    assert max(gap) < 0.01
    assert naive.train_loss > master.train_loss  # type: ignore[operator]


def test_loss_scaling_lifts_gradients_out_of_the_subnormals(results: dict[str, ladder.RungResult]) -> None:
    unscaled, static = results["fp16-master"], results["fp16-static"]
    assert unscaled.subnormal_grad_pct is not None and static.subnormal_grad_pct is not None
    assert static.subnormal_grad_pct < unscaled.subnormal_grad_pct / 10
    assert results["fp32"].subnormal_grad_pct == 0.0
    assert static.final_scale == FASTAI_LOSS_SCALE
    assert results["fp16-dynamic"].final_scale is not None and unscaled.final_scale is None


def test_state_memory_counts_bytes_per_parameter(results: dict[str, ladder.RungResult]) -> None:
    n = sum(p.numel() for p in mixprec.build_model("mlp", _data(), n_hidden=N_HIDDEN).parameters())
    mib = n / 2**20
    # plain SGD keeps no state: fp32 = weight + grad (4 + 4 bytes); naive fp16 = 2 + 2;
    # with masters = fp16 weight + grad (2 + 2) + fp32 master + its grad (4 + 4)
    assert results["fp32"].state_mib == pytest.approx(8 * mib)
    assert results["fp16-naive"].state_mib == pytest.approx(4 * mib)
    assert results["fp16-master"].state_mib == pytest.approx(12 * mib)
    assert results["bf16"].state_mib == pytest.approx(12 * mib)
    assert results["o1"].state_mib == pytest.approx(8 * mib)
    # Saved for backward in the first step (batch B): the input and the hidden activation in the compute
    # dtype, plus what the fp32 loss keeps: its log-softmax (B x 10), the int64 targets and nll_loss's
    # fp32 scalar total weight.
    b = SETTINGS.batch_size
    loss_part = 4 * b * 10 + 8 * b + 4
    for key, size in (("fp32", 4), ("bf16", 2)):
        assert results[key].saved_mib == pytest.approx((size * b * (64 + N_HIDDEN) + loss_part) / 2**20)


def test_unavailable_autocast_is_a_row_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(device_type: str, dtype: torch.dtype) -> None:
        raise RuntimeError(f"{device_type} autocast does not support {dtype}")  # as on an old GPU

    monkeypatch.setattr(ladder, "autocast", unsupported)
    torch.manual_seed(0)
    model = mixprec.build_model("mlp", _data(), n_hidden=8)
    result = ladder.run_rung(ladder.RUNGS["o1"], _data, model, SETTINGS)
    assert not result.ok and result.status.startswith("not available")
    row = ladder.results_table([result])[0]
    assert row["rung"] == result.label and row["train loss"].startswith("not available")


def test_write_outputs(results: dict[str, ladder.RungResult], tmp_path: Path) -> None:
    paths = ladder.write_outputs(list(results.values()), SETTINGS, tmp_path / "out")
    with paths["csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert [r["rung"] for r in rows] == [r.label for r in ladder.LADDER]
    assert rows[0]["train loss"] == f"{results['fp32'].train_loss:.4f}"
    payload = json.loads(paths["json"].read_text())
    assert len(payload["results"]) == 7 and payload["results"][0]["losses"] == list(results["fp32"].losses)
    assert "| rung |" in paths["md"].read_text()
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"


def test_coinciding_curves_stay_visible(results: dict[str, ladder.RungResult]) -> None:
    """fp16 + master, + static and + dynamic scale trained alike and the later curve hid the earlier ones (a
    user trial): every rung's line differs from every other's in dash pattern or width, later ones thinner."""
    from mixprec.ladder_output import ladder_figure

    same = [dataclasses.replace(r, losses=results["fp32"].losses) for r in results.values()]
    loss_ax = ladder_figure(same, "t").axes[0]
    styles = [(line.get_linestyle(), line.get_linewidth()) for line in loss_ax.get_lines()]
    assert len(styles) == len(same) and len(set(styles)) == len(styles)
    widths = [w for _, w in styles]
    assert widths == sorted(widths, reverse=True) and widths[-1] < widths[0]
