"""`mixprec compare --report DIR` on tiny settings: the page and its PNGs, checked against the ladder's own
outputs (compare.md, compare.json) and against the diagnostics called directly."""

from __future__ import annotations

import base64
import functools
import html
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec import cli
from mixprec.diagnostics import memory_breakdown
from mixprec.ladder import RUNGS, CompareSettings, RungResult
from mixprec.report import memory_for_rungs, report_scale

pytestmark = pytest.mark.usefixtures("one_thread")

PNG = b"\x89PNG\r\n\x1a\n"
RUNG_KEYS = ("fp32", "fp16-dynamic", "bf16")  # fp16-naive is left out: CPU fp16 GEMMs are slow


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the --out folder, the --report folder) of one tiny compare run."""
    root = tmp_path_factory.mktemp("report")
    out, report = root / "cmp", root / "page"
    code = cli.main(["compare", "--size", "8", "--epochs", "1", "--batch-size", "256",
                  "--rungs", ",".join(RUNG_KEYS), "--out", str(out), "--report", str(report)])
    assert code == 0
    return out, report


def test_report_writes_valid_pngs_and_the_markdown_links_them(page: tuple[Path, Path]) -> None:
    _, report = page
    md = (report / "report.md").read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert sorted(links) == ["gradients.png", "loss_curves.png", "memory.png"]
    for link in links:
        assert (report / link).read_bytes()[:8] == PNG


def test_report_has_the_ladder_table_of_compare_md(page: tuple[Path, Path]) -> None:
    out, report = page
    md = (report / "report.md").read_text()
    for key in RUNG_KEYS:
        assert RUNGS[key].label in md
    # The ladder's own writer is the reference: every one of its table rows is on the page.
    rows = [line for line in (out / "compare.md").read_text().splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(RUNG_KEYS)
    for row in rows:
        assert " ".join(row.split()) in " ".join(md.split())


def test_report_gradients_use_the_dynamic_rungs_final_scale(page: tuple[Path, Path]) -> None:
    out, report = page
    results = json.loads((out / "compare.json").read_text())["results"]
    scale = next(r["final_scale"] for r in results if r["key"] == "fp16-dynamic")
    md = (report / "report.md").read_text()
    assert f"g x 2^{int(torch.tensor(scale).log2())} = {scale:g} in fp16" in md


def test_report_html_is_self_contained(page: tuple[Path, Path]) -> None:
    _, report = page
    text = (report / "report.html").read_text()
    sources = re.findall(r'src="([^"]*)"', text)
    assert len(sources) == 3 and "href=" not in text
    embedded = {base64.b64decode(s.removeprefix("data:image/png;base64,")) for s in sources}
    assert all(s.startswith("data:image/png;base64,") for s in sources)
    assert embedded == {(report / f).read_bytes() for f in ("gradients.png", "loss_curves.png", "memory.png")}
    for key in RUNG_KEYS:
        assert html.escape(RUNGS[key].label) in text


def test_memory_for_rungs_gives_one_bar_per_recipe_as_memory_breakdown_does() -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    settings = CompareSettings(momentum=0.9)
    bars = memory_for_rungs(["fp32", "fp16-static", "fp16-dynamic", "bf16"], model, batch, settings)
    # Loss scaling costs no memory: the scaled rungs share the bar of the first rung with their recipe's
    # memory, fp16 + master (the labels were a hand-written table before the Recipe; now the rungs' own).
    assert [b.precision for b in bars] == [RUNGS[k].label for k in ("fp32", "fp16-master", "bf16")]
    sgd = functools.partial(torch.optim.SGD, lr=settings.lr, momentum=0.9)
    for bar, key in zip(bars, ["fp32", "fp16-dynamic", "bf16"], strict=True):
        direct = memory_breakdown(model, sgd, batch, RUNGS[key].recipe, estimate=True)
        assert bar.as_dict() == direct.as_dict()
    assert bars[0].optimizer_state == bars[0].params  # momentum buffers: one fp32 copy of the weights


def test_report_scale_prefers_the_dynamic_rung() -> None:
    def ran(key: str, scale: float | None) -> RungResult:
        return RungResult(key, key, "ok", final_scale=scale)

    assert report_scale([ran("fp32", None), ran("fp16-static", 512.0), ran("fp16-dynamic", 2048.0)]) == 2048.0
    assert report_scale([ran("fp16-static", 512.0)]) == 512.0
    assert report_scale([ran("fp32", None), RungResult("fp16-dynamic", "x", "not available")]) is None
