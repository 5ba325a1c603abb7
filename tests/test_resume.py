"""Checkpoint and resume in the Learner (``fit(..., checkpoint=, resume=)``) and ``mixprec train --resume``.

The reference is the same run never interrupted: a resumed run must end with the same bits (half weights,
fp32 masters, optimizer moments, loss scale, recorded losses), which needs the shuffle order, the dropout
RNG and the schedule position restored as well.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import mixprec
from mixprec import cli
from mixprec.callbacks import Callback, CancelTrainException
from mixprec.checkpoint import CheckpointError
from mixprec.errors import ConfigError
from mixprec.learner import Learner

pytestmark = pytest.mark.usefixtures("one_thread")

EPOCHS, STOP_AFTER = 4, 2


def _learner(dtype: torch.dtype | None) -> Learner:
    data = mixprec.digits(batch_size=128, seed=0)
    torch.manual_seed(0)
    # Dropout: the resumed run must draw the same masks, so the global RNG matters too.
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 10))
    learn = Learner(data, model, silent=True)
    set_precision = {torch.float16: learn.to_fp16, torch.bfloat16: learn.to_bf16, None: learn.to_fp32}
    return set_precision[dtype]()


class _StopAfter(Callback):
    """A crash at an epoch end, after the Checkpoint callback (order 200) has saved it."""

    order = 300

    def __init__(self, epochs: int) -> None:
        self.epochs = epochs

    def on_epoch_end(self) -> None:
        if self.epoch + 1 == self.epochs:
            raise CancelTrainException()


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    """Bit-identical nested checkpoint contents (tensors compared with equal(), NaN-free here)."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _payload(path: Path) -> dict[str, Any]:
    payload = torch.load(path, weights_only=False)
    recorder = next(s for s in payload["schedulers"] if "epochs" in s)
    for ep in recorder["epochs"]:  # the Recorder's rows: wall time differs between runs
        object.__setattr__(ep, "seconds", 0.0)
    return {k: payload[k] for k in ("step", "extra", "models", "optimizers", "scalers", "schedulers")}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, None], ids=["fp16", "bf16", "fp32"])
def test_fit_resumed_after_two_epochs_matches_an_uninterrupted_run(dtype: torch.dtype | None,
                                                                    tmp_path: Path) -> None:
    ref, ckpt = tmp_path / "ref.pt", tmp_path / "run.pt"
    whole = _learner(dtype)
    whole.fit(EPOCHS, 1e-2, checkpoint=ref)
    _learner(dtype).fit(STOP_AFTER, 1e-2, checkpoint=ckpt)
    resumed = _learner(dtype)
    resumed.fit(EPOCHS, 1e-2, resume=ckpt)  # keeps saving to ckpt
    _assert_same(_payload(ckpt), _payload(ref))  # half weights, fp32 masters, Adam moments, scale, losses
    for p, q in zip(resumed.model.parameters(), whole.model.parameters(), strict=True):
        assert p.dtype == torch.float32 and torch.equal(p, q)  # back in fp32, holding the masters
    assert [r.epoch for r in resumed.recorder.epochs] == list(range(EPOCHS))
    if dtype is not None:
        masters = torch.load(ref, weights_only=False)["optimizers"][0]["masters"]
        assert masters and all(m.dtype == torch.float32 for m in masters)


class _Batches:
    """A train loader that is not a DataLoader (a CLIP trial's list of prepared batches): no .generator."""

    def __init__(self, loader: Any) -> None:
        self.batches = list(loader)

    def __iter__(self) -> Any:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def test_a_fit_over_batches_of_another_kind_saves_and_resumes(tmp_path: Path) -> None:
    """fit(checkpoint=...) read the train loader's .generator unchecked: a loader of another kind trained,
    then failed at the first epoch end with a bare AttributeError. Its order follows the global RNG, which
    the checkpoint restores: the resumed run matches the whole one."""
    def learner() -> Learner:
        learn = _learner(torch.float16)
        learn.data = dataclasses.replace(learn.data, train=_Batches(learn.data.train))
        return learn

    ref, ckpt = tmp_path / "ref.pt", tmp_path / "run.pt"
    learner().fit(EPOCHS, 1e-2, checkpoint=ref)
    learner().fit(STOP_AFTER, 1e-2, checkpoint=ckpt)
    learner().fit(EPOCHS, 1e-2, resume=ckpt)
    _assert_same(_payload(ckpt), _payload(ref))


def test_a_split_masters_fit_resumed_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    """The checkpoint holds the model's state dict as the exact fp32 masters (split_state_dict's hooks,
    now on during a fit too) and the optimizer's low halves: resumed, the two loads give back both halves."""
    from mixprec.recipe import Recipe

    split = Recipe.from_opt_level("O2", torch.bfloat16).replace(split_masters=True)
    ref, ckpt = tmp_path / "ref.pt", tmp_path / "run.pt"
    whole = _learner(None).to_recipe(split)
    whole.fit(EPOCHS, 1e-2, checkpoint=ref)
    _learner(None).to_recipe(split).fit(STOP_AFTER, 1e-2, checkpoint=ckpt)
    resumed = _learner(None).to_recipe(split)
    resumed.fit(EPOCHS, 1e-2, resume=ckpt)
    _assert_same(_payload(ckpt), _payload(ref))
    for p, q in zip(resumed.model.parameters(), whole.model.parameters(), strict=True):
        assert p.dtype == torch.float32 and torch.equal(p, q)
    saved = torch.load(ref, weights_only=False)["models"][0]
    assert all(v.dtype == torch.float32 for v in saved.values())
    assert any(not torch.equal(v, v.bfloat16().float()) for v in saved.values())  # masters, not bf16 weights


def test_a_split_masters_checkpoint_of_bf16_weights_still_resumes_bit_for_bit(tmp_path: Path) -> None:
    """Written before the fit hooked the state dict, a split fit's checkpoint holds the model's bf16
    weights (the low halves are in the optimizer's state). The dtype check compared them with the state
    dict's fp32 masters and refused the resume; the weights themselves are bf16, so it loads, exactly."""
    from mixprec.checkpoint_digest import payload_digest
    from mixprec.recipe import Recipe

    split = Recipe.from_opt_level("O2", torch.bfloat16).replace(split_masters=True)
    whole = _learner(None).to_recipe(split)
    whole.fit(EPOCHS, 1e-2)
    ckpt = tmp_path / "run.pt"
    _learner(None).to_recipe(split).fit(STOP_AFTER, 1e-2, checkpoint=ckpt)
    payload = torch.load(ckpt, weights_only=False)
    payload["models"][0] = {k: v.bfloat16() for k, v in payload["models"][0].items()}  # the older format
    del payload["checksum"]
    payload["checksum"] = payload_digest(payload)
    torch.save(payload, ckpt)
    resumed = _learner(None).to_recipe(split)
    resumed.fit(EPOCHS, 1e-2, resume=ckpt)
    for p, q in zip(resumed.model.parameters(), whole.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_fit_one_cycle_resumes_mid_schedule(tmp_path: Path) -> None:
    ref, ckpt = tmp_path / "ref.pt", tmp_path / "run.pt"
    _learner(torch.float16).fit_one_cycle(EPOCHS, 1e-2, checkpoint=ref)
    crashed = _learner(torch.float16).add_cb(_StopAfter(STOP_AFTER))
    crashed.fit_one_cycle(EPOCHS, 1e-2, checkpoint=ckpt)
    assert torch.load(ckpt, weights_only=False)["extra"]["epoch"] == STOP_AFTER
    resumed = _learner(torch.float16)
    resumed.fit_one_cycle(EPOCHS, 1e-2, resume=ckpt)
    _assert_same(_payload(ckpt), _payload(ref))
    lrs = resumed.recorder.lrs
    assert len(lrs) == EPOCHS * len(resumed.data.train) and lrs[-1] < lrs[0] / 1e3  # the whole schedule


def test_resume_from_a_missing_file_names_the_path_and_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pt"
    with pytest.raises(CheckpointError, match="no checkpoint at .*nope.pt") as err:
        _learner(torch.float16).fit(1, resume=missing)
    assert err.value.fix is not None and "checkpoint=" in err.value.fix


def test_resume_past_the_requested_epochs_is_a_config_error(tmp_path: Path) -> None:
    ckpt = tmp_path / "run.pt"
    _learner(torch.bfloat16).fit(2, checkpoint=ckpt)
    learn = _learner(torch.bfloat16)
    with pytest.raises(ConfigError, match="epochs >= 2"):
        learn.fit(1, resume=ckpt)
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())  # on_train_end still ran


def _train(out: Path, epochs: int, *extra: str) -> int:
    return cli.main(["train", "--model", "mlp", "--size", "8", "--precision", "fp16", "--epochs", str(epochs),
                     "--batch-size", "256", "--schedule", "constant", "--out", str(out), *extra])


def test_cli_train_resume_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    whole, run = tmp_path / "whole", tmp_path / "run"
    assert _train(whole, 3) == 0
    assert _train(run, 1) == 0
    assert (run / "checkpoint.pt").is_file()
    assert _train(run, 3, "--resume") == 0
    _assert_same(_payload(run / "checkpoint.pt"), _payload(whole / "checkpoint.pt"))
    steps = [json.loads((d / "metrics.json").read_text())["steps"] for d in (run, whole)]
    assert steps[0] == steps[1]  # the resumed run's metrics cover all epochs


def test_cli_train_resume_without_a_checkpoint_starts_afresh(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 14 item 8: so that a job restarted automatically in its first epoch runs (it exited 2)."""
    assert _train(tmp_path / "empty", 1, "--resume") == 0
    out = capsys.readouterr().out
    assert f"no checkpoint at {tmp_path / 'empty' / 'checkpoint.pt'} yet; starting afresh" in out
    assert (tmp_path / "empty" / "checkpoint.pt").is_file()
