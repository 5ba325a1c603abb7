"""`mixprec train` and `mixprec compare` on tiny settings: the files they write and their user errors."""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

import pytest

from mixprec import cli

pytestmark = pytest.mark.usefixtures("one_thread")


def test_train_writes_metrics_and_a_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    code = cli.main(["train", "--model", "mlp", "--data", "digits", "--size", "8", "--precision", "fp16",
                  "--loss-scale", "dynamic", "--epochs", "2", "--batch-size", "128", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "train_loss" in printed and "valid_loss" in printed and "accuracy" in printed
    payload = json.loads((out / "metrics.json").read_text())
    assert [e["epoch"] for e in payload["epochs"]] == [0, 1]
    n_steps = len(payload["steps"]["loss"])
    assert n_steps == 2 * 12 and payload["steps"]["loss_scale"][0] == 512.0
    with (out / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [float(r["valid_loss"]) for r in rows] == [e["valid_loss"] for e in payload["epochs"]]
    assert (out / "losses.png").read_bytes()[:4] == b"\x89PNG"
    # the closing line names every file written, the checkpoint --resume continues from included
    wrote = printed.rsplit("wrote ", 1)[1].split()  # rich may wrap the line between paths
    assert f"{out / 'checkpoint.pt'}" in wrote and (out / "checkpoint.pt").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--precision", "bf16", "--loss-scale", "512"], "needs no"),
        (["--data", "mnist"], "mnist:PATH"),
        (["--data", "mnist:/nonexistent/mnist"], "MNIST not found"),
        (["--data", "imagenet"], "unknown --data"),
        (["--opt-level", "O2", "--precision", "fp16"], "drop --precision"),
    ],
)
def test_train_user_errors_exit_2_with_the_fix(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["train", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "said"),
    [  # a user trial: both ended with exit 0 and only "skipped steps N" to go by
        (["--precision", "fp16", "--loss-scale", "1e9"], r"(?s)of 12 steps were skipped.*loss-scale dynamic"),
        (["--precision", "fp32", "--opt", "sgd", "--lr", "1e6"], r"(?s)loss became (nan|inf).*lower --lr"),
    ],
)
def test_train_says_when_a_run_did_not_train(
    argv: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["train", "--model", "mlp", "--size", "8", "--epochs", "1", "--batch-size", "128",
                     "--out", str(tmp_path), *argv])
    assert code == 0  # the run finished and wrote its metrics: the warning says what they mean
    assert re.search(said, capsys.readouterr().out.replace("\n", " "))


def test_a_healthy_run_gets_no_warning() -> None:
    from mixprec.commands.train import run_problem

    assert run_problem([2.3, 1.9, 1.4], [True, False, False], None) is None


def test_train_at_an_opt_level(tmp_path: Path) -> None:
    pytest.importorskip("mixprec.amp")
    out = tmp_path / "o2"
    code = cli.main(["train", "--model", "mlp", "--size", "8", "--opt-level", "O2", "--epochs", "1",
                  "--batch-size", "128", "--out", str(out)])
    assert code == 0
    payload = json.loads((out / "metrics.json").read_text())
    assert payload["epochs"][0]["accuracy"] > 0.5


def test_compare_writes_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cmp"
    code = cli.main(["compare", "--size", "8", "--epochs", "1", "--batch-size", "256",
                  "--rungs", "fp32,fp16-naive,fp16-dynamic,bf16", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "fp16 naive" in printed and "wall time" in printed
    # every word of every name whole at the 160-column console (a user trial saw "arithmet…", "O1 (autocas…")
    table = printed.split("what each rung changed")[0]
    assert "…" not in table and "arithmetic" in table and "(O2)" in table
    with (out / "compare.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["rung"] for r in rows] == ["fp32", "fp16 naive", "+ dynamic scale (O2)", "bf16 + master"]
    assert rows[2]["final scale"] == "65536" and rows[0]["final scale"] == "—"
    payload = json.loads((out / "compare.json").read_text())
    assert payload["settings"]["epochs"] == 1 and len(payload["results"]) == 4
    assert (out / "compare.md").read_text().count("\n| ") == 1 + 4  # header + rows
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_rejects_unknown_rungs(capsys: pytest.CaptureFixture[str]) -> None:
    """The unknown names as typed, not a Python list of lowered ones (it said "unknown rung(s) ['o7']")."""
    with pytest.raises(SystemExit):
        cli.main(["compare", "--rungs", "fp32,fp8,O7"])
    error = capsys.readouterr().err.strip().splitlines()[-1]  # after the usage lines
    assert "unknown rungs fp8, O7; choose from fp32," in error and "[" not in error


def test_compare_defaults_are_the_ladder_defaults() -> None:
    from mixprec import ladder
    from mixprec.commands import compare, train

    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    args = parser.parse_args([])
    assert compare.settings_from(args, train.data_spec(args)) == ladder.CompareSettings()
    assert compare.RUNG_KEYS == tuple(ladder.RUNGS)
