"""Issues 14 (item 8, 4) and 15: a user's mistake on the `mixprec` command line ends in `mixprec: error: ...`
and exit status 2 (argparse's convention), never a traceback; a bug still raises."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from mixprec import cli
from mixprec.commands import formats
from mixprec.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--model", "mlp", "--size", "8", "--batch-size", "256", "--schedule", "constant"]


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lr", "-1"], "--lr must be a positive number, got -1"),  # it said "Invalid learning rate: -0.04"
        (["--lr", "nan"], "--lr must be a positive number"),
        (["--precision", "fp32", "--opt-level", "O2"], "--precision fp32 would be ignored"),  # it ran O2
        (["--precision", "bf16", "--opt-level", "O1"], "drop --precision"),
        # these three said "fp32 has fp32's exponent range", "half precision master weights" (a user trial)
        (["--loss-scale", "512"], "fp32 needs no scaling (its gradients are fp32)"),
        (["--precision", "bf16", "--loss-scale", "512"], "bf16 needs no scaling (bf16 has fp32's exponent"),
        (["--flat-master"], "the fp32 master weights of a half model, and fp32 training keeps none"),
    ],
)
def test_train_refuses_arguments_that_cannot_work(argv: list[str], message: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", *TINY, "--out", str(tmp_path / "run"), *argv]) == 2
    assert message in _error(capsys)
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_train_refuses_an_out_folder_it_cannot_create(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """As `--out /proc/nope`: a folder whose parent cannot hold it (here a file), checked before training."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli.main(["train", *TINY, "--out", str(blocker / "run")]) == 2
    assert f"--out {blocker / 'run'}: cannot create this folder" in _error(capsys)


def test_formats_hints_the_double_dash_for_a_negative_expression(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["formats", "-2**-24"])
    assert exit_.value.code == 2
    assert "mixprec formats -- -2**-24" in _error(capsys)
    assert cli.main(["formats", "--", "-2**-24"]) == 0  # the hint works: -2^-24 is fp16's smallest subnormal
    assert "-5.960464477539063e-08" in capsys.readouterr().out


def test_the_guard_prints_user_errors_and_lets_bugs_raise(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    def user_error(args: object) -> int:
        raise ConfigError("that value cannot work", "pass another one")

    monkeypatch.setattr(formats, "run", user_error)
    assert cli.main(["formats"]) == 2
    assert _error(capsys) == "mixprec: error: that value cannot work\n  - fix: pass another one\n"

    def bug(args: object) -> int:
        raise ZeroDivisionError("a real bug")

    monkeypatch.setattr(formats, "run", bug)
    with pytest.raises(ZeroDivisionError):
        cli.main(["formats"])


# ----------------------------------------------------------------------------------------- --resume
@pytest.fixture(scope="module")
def finished_fp16_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One epoch of fp16 with dynamic scaling and AdamW, finished (shared: the tests below copy it)."""
    out = tmp_path_factory.mktemp("fp16") / "run"
    assert cli.main(["train", *TINY, "--precision", "fp16", "--epochs", "1", "--out", str(out)]) == 0
    return out


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_resume_of_a_finished_run_says_so_and_writes_nothing(
    finished_fp16_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = shutil.copytree(finished_fp16_run, tmp_path / "run")
    before = _contents(run)
    capsys.readouterr()
    argv = ["train", *TINY, "--precision", "fp16", "--epochs", "1", "--out", str(run), "--resume"]
    assert cli.main(argv) == 0
    assert "is finished: it has trained its 1 epoch(s)" in capsys.readouterr().out
    assert _contents(run) == before  # it rewrote metrics.json with an empty table


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--precision", "bf16"], "--precision bf16 here, fp16 in the saved run"),  # it trained on in bf16
        (["--precision", "fp16", "--loss-scale", "1024"], "--loss-scale 1024 here, dynamic in the saved run"),
        (["--precision", "fp16", "--opt", "sgd"], "--opt sgd here, adamw in the saved run"),  # KeyError
        (["--opt-level", "O2"], "--opt-level O2 here, not given in the saved run"),  # KeyError 'param_groups'
        (["--precision", "fp32"], "--precision fp32 here, fp16 in the saved run"),
        (["--precision", "fp16", "--model", "cnn"], "--model cnn here, mlp in the saved run"),
    ],
)
def test_resume_with_other_settings_names_the_difference_and_the_fix(
    argv: list[str], named: str, finished_fp16_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = shutil.copytree(finished_fp16_run, tmp_path / "run")
    before = _contents(run)
    capsys.readouterr()
    assert cli.main(["train", *TINY, "--epochs", "2", "--out", str(run), "--resume", *argv]) == 2
    err = _error(capsys)
    assert err.startswith("mixprec: error: --resume: these settings differ") and named in err
    assert "fix: resume with the saved settings" in err
    assert _contents(run) == before


def test_resume_with_the_same_settings_continues(finished_fp16_run: Path, tmp_path: Path) -> None:
    """The reference the refusals above are measured against: `--loss-scale dynamic` is the default spelt
    out, so it is the same setting."""
    run = shutil.copytree(finished_fp16_run, tmp_path / "run")
    argv = ["train", *TINY, "--precision", "fp16", "--loss-scale", "dynamic", "--epochs", "2"]
    assert cli.main([*argv, "--out", str(run), "--resume"]) == 0
    assert [e["epoch"] for e in json.loads((run / "metrics.json").read_text())["epochs"]] == [0, 1]


def test_resume_of_a_one_cycle_run_with_more_epochs_is_refused(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The one-cycle schedule spans --epochs: resumed with another count it silently continued another
    schedule (a learning rate jump at the resumed step)."""
    argv = ["train", "--model", "mlp", "--size", "8", "--batch-size", "256", "--out", str(tmp_path / "run")]
    assert cli.main([*argv, "--epochs", "1"]) == 0
    capsys.readouterr()
    assert cli.main([*argv, "--epochs", "2", "--resume"]) == 2
    assert "--epochs 2 here, 1 in the saved run: the one-cycle schedule spans all epochs" in _error(capsys)


def test_resume_from_a_damaged_checkpoint_is_refused(finished_fp16_run: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    run = shutil.copytree(finished_fp16_run, tmp_path / "run")
    payload = torch.load(run / "checkpoint.pt", weights_only=False)
    weight = payload["models"][0]["1.weight"]
    weight.view(torch.int16).view(-1)[0] ^= 1  # one bit of one weight, as the disk could flip it
    torch.save(payload, run / "checkpoint.pt")
    argv = ["train", *TINY, "--precision", "fp16", "--epochs", "2", "--out", str(run), "--resume"]
    assert cli.main(argv) == 2
    assert "is damaged: its contents do not match the checksum" in _error(capsys)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["grads", "--model", "mlp", "--loss-scale", "-5", "--no-png"], "--loss-scale must be positive"),
        (["memory", "--model", "mlp", "--input", "3x"], "cannot read input shape '3x'"),
    ],
)
def test_other_commands_report_user_errors_the_same_way(argv: list[str], message: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's own refusal of a --input it cannot read
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "error:" in err and "Traceback" not in err


# ------------------------------------------------------------------ output paths, checked before any work
def _no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """compare trained every rung and only then found that it could not write its files."""
    from mixprec import ladder

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the ladder ran although its output path was unusable")

    monkeypatch.setattr(ladder, "run_ladder", refuse)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare", "--rungs", "fp32", "--out", "{file}"], "--out {file}: cannot create this folder"),
        (["compare", "--rungs", "fp32", "--out", "{dir}/o", "--report", "{file}"],
         "--report {file}: cannot create this folder"),
        (["memory", "--precision", "fp32", "--png", "{dir}"], "--png {dir}: this is a folder"),
        (["memory", "--precision", "fp32", "--png", "{file}/x.png"],
         "--png {file}/x.png: {file}: cannot create this folder"),
        (["grads", "--png", "{dir}"], "--png {dir}: this is a folder"),  # it was IsADirectoryError
    ],
)
def test_unusable_output_paths_are_refused_before_any_work(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _no_training(monkeypatch)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    names = {"file": str(blocker), "dir": str(tmp_path)}
    assert cli.main([a.format(**names) for a in argv]) == 2
    err = _error(capsys)
    assert message.format(**names) in err and "fix: pass a" in err
    assert blocker.read_text() == ""


def test_a_corrupt_gzip_mnist_file_is_a_user_error(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (tmp_path / f"{name}.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    assert cli.main(["grads", "--data", f"mnist:{tmp_path}", "--no-png"]) == 2
    assert f"{tmp_path / 'train-images-idx3-ubyte.gz'} is not a valid gzip file" in _error(capsys)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["memory", "--precision", ",,", "--no-png"], "--precision ',,' names no recipe"),  # IndexError
        (["memory", "--precision", " , ", "--no-png"], "--precision ' , ' names no recipe"),
        (["memory", "--classes", "-4", "--no-png"], "--classes must be >= 2, got -4"),  # negative dimension
        (["memory", "--classes", "0", "--no-png"], "--classes must be >= 2, got 0"),  # it printed a table
        (["memory", "--classes", "1", "--no-png"], "--classes must be >= 2, got 1"),
        # the fix named build()'s arguments (flatten=, input_shape=), not the command line's
        (["memory", "--model", "cnn", "--input", "28x28", "--no-png"],
         "2 dimension(s): e.g. --input 1x28x28"),
        (["memory", "--model", "vgg16", "--input", "3x4x4x4", "--no-png"], "e.g. --input 3x224x224"),
        (["compare", "--momentum", "-1"], "momentum must be a finite number >= 0, got -1.0"),  # SGD raised
        (["compare", "--momentum", "nan"], "momentum must be a finite number >= 0, got nan"),  # NaN, rc 0
        (["compare", "--lr", "inf"], "lr must be a finite number > 0, got inf"),
    ],
)
def test_memory_and_compare_settings_are_checked(argv: list[str], message: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    _no_training(monkeypatch)
    out = ["--out", str(tmp_path / "run")] if argv[0] == "compare" else []
    assert cli.main([*argv, *out]) == 2
    assert message in _error(capsys)


def test_compare_names_only_the_setting_that_is_wrong(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`--lr 0` said "epochs (6) and batch_size (64) must be >= 1, lr (0.0) > 0"."""
    assert cli.main(["compare", "--lr", "0", "--epochs", "0", "--out", str(tmp_path / "run")]) == 2
    err = _error(capsys)
    assert "epochs must be >= 1, got 0; lr must be a finite number > 0, got 0.0" in err
    assert "fix: e.g. --epochs 6 --lr 0.01." in err and "batch_size" not in err
    assert not (tmp_path / "run").exists()  # refused before it created the output folder


@pytest.mark.parametrize("command", ["train", "compare", "grads"])
@pytest.mark.parametrize("size", ["-3", "0"])
def test_a_bad_size_names_the_flag_and_a_value_to_type(command: str, size: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """It said "size must be a positive number of pixels or None (keep the original)": no flag, and a
    None that cannot be typed."""
    _no_training(monkeypatch)
    out = {"train": ["--out", str(tmp_path / "run")], "compare": ["--out", str(tmp_path / "run")],
           "grads": ["--no-png"]}[command]
    assert cli.main([command, "--size", size, *out]) == 2
    err = _error(capsys)
    assert f"--size must be a positive number of pixels, got {size}" in err
    assert "fix: e.g. --size 28, or leave --size out" in err and "None" not in err


def test_mnist_at_a_file_says_it_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It said "MNIST not found in FILE ... missing" all four files, as for an empty folder."""
    file = tmp_path / "train-images-idx3-ubyte"
    file.write_bytes(b"")
    assert cli.main(["grads", "--data", f"mnist:{file}", "--no-png"]) == 2
    err = _error(capsys)
    assert f"{file} is a file; mnist needs the folder" in err
    assert f"--data mnist:{tmp_path.resolve()}\n" in err  # absolute, and no full stop to misread


def test_opt_levels_are_spelled_either_way_on_the_command_line() -> None:
    """compare took only o1 and train only O1 (a user trial tried each with the other's spelling)."""
    from mixprec.commands import compare, train

    assert compare._rungs_arg("FP32,O1, bf16") == ["fp32", "o1", "bf16"]
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    assert [parser.parse_args(["--opt-level", level]).opt_level for level in ("o2", "O2")] == ["O2", "O2"]


@pytest.mark.parametrize("rungs", ["", " , "])
def test_rungs_that_name_no_rung_say_so(rungs: str, capsys: pytest.CaptureFixture[str]) -> None:
    """It said "unknown rung(s) []"."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["compare", "--rungs", rungs])
    assert exit_.value.code == 2
    err = _error(capsys)
    assert f"argument --rungs: {rungs!r} names no rung; choose from fp32," in err and "[]" not in err


@pytest.mark.parametrize(
    ("argv", "values"),
    [
        (["-2**-24", "--", "3"], {"-2**-24": -(2.0**-24), "3": 3.0}),  # the hint said what had been done
        (["-d", "fp16", "-2**-24", "--", "-2**-14"], {"-2**-24": -(2.0**-24), "-2**-14": -(2.0**-14)}),
        (["1", "--dtype=bf16", "-2**-24", "--", "5"], {"1": 1.0, "-2**-24": -(2.0**-24), "5": 5.0}),
        (["-2**-24"], {"-2**-24": -(2.0**-24)}),
    ],
)
def test_formats_hint_is_a_command_that_works(argv: list[str], values: dict[str, float],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """With -- already used for one VALUE and a negative one before it, the hint still said "goes after
    --: mixprec formats -- -2**-24", what the user had done."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["formats", *argv])
    assert exit_.value.code == 2
    hint = _error(capsys).split("mixprec formats ", 1)[1].strip()
    fixed = hint.split()
    assert fixed.count("--") == 1 and all(v in fixed[fixed.index("--"):] for v in values)
    assert cli.main(["formats", *fixed]) == 0  # the hint, typed as shown, shows every VALUE
    out = capsys.readouterr().out
    assert all(f"{text} = {value!r}" in out for text, value in values.items())


@pytest.mark.parametrize("scale", ["inf", "nan", "1e-30", "0.5", "-4"])
def test_a_loss_scale_below_the_floor_is_refused_in_command_line_words(
    scale: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """inf reached the scaler, whose message named loss_scale= and min_scale (Python), not the flag."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--precision", "fp16", "--loss-scale", scale])
    assert exit_.value.code == 2
    err = _error(capsys)
    assert "a loss scale must be a finite number >= 1" in err and "--loss-scale 512" in err
    assert "min_scale" not in err and "init_scale" not in err


def test_train_into_a_folder_that_holds_a_run_asks_before_replacing_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second `train --out DIR` replaced DIR/checkpoint.pt without a word (a user trial)."""
    out = tmp_path / "run"
    assert cli.main(["train", *TINY, "--out", str(out)]) == 0
    saved = (out / "checkpoint.pt").read_bytes()
    capsys.readouterr()
    assert cli.main(["train", *TINY, "--out", str(out), "--lr", "1e-2"]) == 2
    assert "holds a run already" in _error(capsys) and (out / "checkpoint.pt").read_bytes() == saved
    assert cli.main(["train", *TINY, "--out", str(out), "--lr", "1e-2", "--overwrite"]) == 0
    assert (out / "checkpoint.pt").read_bytes() != saved


def test_a_value_error_in_the_users_own_model_code_keeps_its_traceback(tmp_path: Path) -> None:
    """`mixprec memory --model file.py:make` caught every ValueError around building the model: a bug in
    the user's factory (int("64x")) printed as a one-line usage error, no file, no line (a trial)."""
    factory = tmp_path / "factory.py"
    factory.write_text("def make():\n    return int('64x')\n")
    with pytest.raises(ValueError, match="invalid literal for int"):
        cli.main(["memory", "--model", f"{factory}:make", "--input", "8", "--no-png"])
