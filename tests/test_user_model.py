"""A user's own model on the command line (``mixprec memory --model file.py:function``, and ``mixprec
grads``): what the function may return, and each mistake named with its fix."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from mixprec.commands import grads as grads_command
from mixprec.commands import memory as memory_command
from mixprec.diagnostics.gradients import grad_exponent_histogram
from mixprec.diagnostics.memory import memory_breakdown

MODELS = '''
import torch
from torch import nn
from neighbour import WIDTH  # a file beside this one: the folder is on the path while it loads

def cnn():
    conv = nn.Conv2d(3, WIDTH, 3, padding=1)
    return nn.Sequential(conv, nn.ReLU(), nn.Flatten(), nn.Linear(WIDTH * 64, 10))

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(100, 32), nn.Linear(32, 100)
    def forward(self, x):
        return self.out(self.emb(x))

def lm_loss(out, y):
    return nn.functional.cross_entropy(out.flatten(0, 1).float(), y.flatten())

def lm():
    x, y = torch.randint(0, 100, (4, 16)), torch.randint(0, 100, (4, 16))
    return LM(), (x, y), lm_loss

def buggy():
    raise ValueError("a mistake deep in my own code")

def not_a_model():
    return {"model": LM()}

value = 3
'''


@pytest.fixture
def models_file(tmp_path: Path) -> Path:
    (tmp_path / "neighbour.py").write_text("WIDTH = 4\n")
    path = tmp_path / "my_models.py"
    path.write_text(MODELS)
    return path


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    memory_command.add_arguments(parser)
    return parser.parse_args(argv)


def test_a_function_returning_model_batch_and_loss_is_counted_as_the_api_counts_it(
        models_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(["--model", f"{models_file}:lm", "--precision", "fp32,O2", "--no-png"])
    model, batch, loss_fn = memory_command._build(args, None)
    assert loss_fn.__name__ == "lm_loss" and batch[0].shape == (4, 16) and batch[0].dtype == torch.int64
    assert memory_command.run(args) == 0
    out = capsys.readouterr().out
    want = memory_breakdown(model, torch.optim.Adam, batch, "O2", loss_fn=loss_fn, estimate=True)
    assert f"({want.n_params:,} parameters), batch 4 x 16" in out


def test_a_model_alone_gets_a_batch_of_the_input_shape(models_file: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(models_file.parent))  # importable by module name too
    args = _parse(["--model", "my_models:cnn", "--input", "3x8x8", "--batch-size", "2", "--precision",
                   "fp32", "--no-png"])
    assert memory_command.run(args) == 0
    assert "(2,682 parameters), batch 2 x 3x8x8" in capsys.readouterr().out  # conv 112 + linear 2,570


@pytest.mark.parametrize(
    ("spec", "extra", "message"),
    [
        ("{file}:cnn", [], "returned no example batch, and no --input was given"),
        ("{file}:not_a_model", [], "not_a_model() returned dict"),
        ("{file}:value", [], "has no function 'value'"),
        ("{file}:missing", [], "has no function 'missing'"),
        ("{dir}/nowhere.py:cnn", [], "nowhere.py: no such file"),
        ("no_such_module_here:cnn", [], "cannot import it"),
        ("{file}:", [], "is not module:function"),
        ("mpl", [], "neither a reference model (cnn, mlp, transformer, vgg16) nor module:function"),
    ],
)
def test_mistakes_name_the_fix(spec: str, extra: list[str], message: str, models_file: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    spec = spec.format(file=models_file, dir=models_file.parent)
    assert memory_command.run(_parse(["--model", spec, "--no-png", *extra])) == 2
    assert message in capsys.readouterr().err


def _parse_grads(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    grads_command.add_arguments(parser)
    return parser.parse_args(argv)


def test_grads_reports_a_users_model_on_its_batch_and_loss(models_file: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``mixprec grads --model file.py:lm`` prints what the Python API reports for the same model, batch and
    loss (the function is called again: it builds the same model from the same seed)."""
    args = _parse_grads(["--model", f"{models_file}:lm", "--no-png"])
    torch.manual_seed(0)
    assert grads_command.run(args) == 0
    out = capsys.readouterr().out
    torch.manual_seed(0)
    model, batch, loss_fn = grads_command._users_model(args)[:3]
    want = grad_exponent_histogram(model, batch, loss_fn=loss_fn)
    assert f"|g| from {want.overall.min_abs:.3g}" in out and f"to {want.overall.max_abs:.3g}" in out
    assert f"{want.overall.nonzero:,} non-zero finite gradients" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "{file}:cnn"], "returned no example batch"),
        (["--model", "{file}:lm", "--train-steps", "3"], "train it first in Python"),
        (["--model", "mpl"], "neither a reference model (mlp, cnn, vgg16, transformer) nor module:function"),
    ],
)
def test_grads_mistakes_name_the_fix(argv: list[str], message: str, models_file: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.format(file=models_file) for a in argv]
    assert grads_command.run(_parse_grads([*argv, "--no-png"])) == 2
    assert message in capsys.readouterr().err


def test_grads_lets_the_users_own_errors_through_with_their_traceback(models_file: Path) -> None:
    """A ValueError of the user's function is theirs, not a usage error: it propagates (mixprec memory's
    rule), where grads printed it as a one-line 'mixprec: error' with exit status 2."""
    with pytest.raises(ValueError, match="deep in my own code"):
        grads_command.run(_parse_grads(["--model", f"{models_file}:buggy", "--no-png"]))
