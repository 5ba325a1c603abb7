"""Checkpoints: a save/load round trip restores every piece of state (checked by continuing training and
comparing bit for bit with a run that never stopped), a crash mid-write leaves the previous checkpoint
whole, the data order resumes mid-epoch, and a run killed with SIGKILL and resumed ends with the same bits
as an uninterrupted run."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec
from mixprec.checkpoint import CheckpointError, ResumableLoader, load_checkpoint, save_checkpoint
from mixprec.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


ROOT = Path(__file__).resolve().parents[1]


class Run:
    """A small fp16 run with every kind of state: fp32 masters and AdamW moments, a dynamic scaler whose
    scale moves, an LR schedule, dropout (global RNG) and a shuffled loader (its own generator)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3)).half()
        self.opt = mixprec.MasterWeights(torch.optim.AdamW(self.model.parameters(), lr=1e-2))
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.5)
        self.scaler = mixprec.GradScaler("cpu", init_scale=2.0**20, growth_interval=2)
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(40, 8, generator=g), torch.randint(0, 3, (40,), generator=g))
        shuffle = torch.Generator().manual_seed(2)
        self.loader = ResumableLoader(DataLoader(data, batch_size=8, shuffle=True, generator=shuffle))
        self.batches = self._batches()

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield from self.loader

    def step(self) -> float:
        x, y = next(self.batches)
        self.opt.zero_grad()
        with mixprec.half_compute("cpu", torch.float16):
            loss = F.cross_entropy(self.model(x.half()), y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.sched.step()
        return loss.item()

    def save(self, path: Path, step: int, **extra: Any) -> None:
        save_checkpoint(path, model=self.model, optimizer=self.opt, scaler=self.scaler, scheduler=self.sched,
                        step=step, extra=extra, loader=self.loader)  # fmt: skip

    def load(self, path: Path) -> Any:
        return load_checkpoint(path, model=self.model, optimizer=self.opt, scaler=self.scaler,
                               scheduler=self.sched, loader=self.loader)  # fmt: skip

    def state(self) -> list[torch.Tensor]:
        return [*self.model.state_dict().values(), *self.opt.master_views()]


def test_round_trip_continues_bit_identically(tmp_path: Path) -> None:
    """Save mid-epoch, load into fresh objects (after the global RNGs moved on), train on: every loss and
    every bit of the weights, masters and scale equal those of the run that never stopped."""
    a = Run()
    for _ in range(7):  # 7 of the 5 batches per epoch: mid-epoch 2; the scale has moved
        a.step()
    a.save(tmp_path / "ck.pt", step=7, note="hello")
    rng_after_save = (torch.rand(3), np.random.rand(), random.random())
    losses_a = [a.step() for _ in range(6)]

    b = Run()
    torch.manual_seed(123)  # scramble the global RNGs: load must restore them
    resumed = b.load(tmp_path / "ck.pt")
    assert (resumed.step, resumed.extra) == (7, {"note": "hello"})
    rng_after_load = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(rng_after_load[0], rng_after_save[0]) and rng_after_load[1:] == rng_after_save[1:]
    # the RNG draws above moved both runs' generators alike; continue both
    losses_b = [b.step() for _ in range(6)]
    assert losses_b == losses_a
    assert all(torch.equal(x, y) for x, y in zip(a.state(), b.state(), strict=True))
    assert a.scaler.state_dict() == b.scaler.state_dict()
    assert b.sched.get_last_lr() == a.sched.get_last_lr()


def test_lr_schedule_reaches_the_wrapped_optimizer_after_load(tmp_path: Path) -> None:
    """torch's Optimizer.load_state_dict replaces param_groups; the scheduler must still drive the lr the
    wrapped optimizer uses (it did not, before load_checkpoint re-aliased MasterWeights' groups)."""
    a = Run()
    a.step()
    a.save(tmp_path / "ck.pt", step=1)
    b = Run()
    b.load(tmp_path / "ck.pt")
    for _ in range(4):
        b.step()
    assert b.opt.optimizer.param_groups[0]["lr"] == b.sched.get_last_lr()[0] < 1e-2


def test_crash_mid_write_leaves_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = Run()
    run.step()
    path = tmp_path / "last.pt"
    run.save(path, step=1)
    before = path.read_bytes()
    real_save = torch.save

    def torn_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        """Serialise for real, write the first half, then die as a full disk or a kill would."""
        import io

        buf = io.BytesIO()
        real_save(obj, buf, *args, **kwargs)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise OSError(28, "No space left on device")

    run.step()
    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="No space left"):
        run.save(path, step=2)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]  # the temporary file was removed
    assert Run().load(path).step == 1


def test_torn_file_gives_a_checkpoint_error(tmp_path: Path) -> None:
    run = Run()
    path = tmp_path / "ck.pt"
    run.save(path, step=0)
    path.write_bytes(path.read_bytes()[:100])  # as a non-atomic writer could leave it
    with pytest.raises(CheckpointError, match="not a readable mixprec checkpoint"):
        run.load(path)
    with pytest.raises(CheckpointError, match="No checkpoint at"):
        run.load(tmp_path / "missing.pt")


def test_mismatched_objects_are_refused(tmp_path: Path) -> None:
    run = Run()
    run.save(tmp_path / "ck.pt", step=0)
    with pytest.raises(CheckpointError, match="1 model state"):
        load_checkpoint(tmp_path / "ck.pt", model=[run.model, run.model], optimizer=run.opt,
                        scaler=run.scaler, scheduler=run.sched)  # fmt: skip
    with pytest.raises(ConfigError, match="does not exist"):
        run.save(tmp_path / "no" / "such" / "dir.pt", step=0)


def test_resumable_loader_replays_the_rest_of_the_epoch() -> None:
    def loader() -> ResumableLoader:
        data = TensorDataset(torch.arange(50))
        return ResumableLoader(DataLoader(data, batch_size=4, shuffle=True,
                                          generator=torch.Generator().manual_seed(0)))  # fmt: skip

    a = loader()
    seen = [batch[0] for epoch in range(3) for batch in a]  # the reference order, 3 epochs
    b = loader()
    it = (batch for _ in range(3) for batch in b)  # each `for` over a ResumableLoader is one epoch
    for _ in range(20):  # 13 batches per epoch: stop 7 batches into epoch 2
        next(it)
    state = b.state_dict()
    c = loader()
    c.load_state_dict(state)
    rest = [batch[0] for batch in c] + [batch[0] for batch in c]
    assert all(torch.equal(x, y) for x, y in zip(seen[20:], rest, strict=True))


def _augmenting_collate(batch: list[tuple[torch.Tensor]]) -> torch.Tensor:
    # torchvision-style augmentation in the main process: draws from all three global RNGs
    x = torch.stack([b[0] for b in batch]).float()
    return x + torch.rand(len(batch)) + float(np.random.rand()) + random.random()


def _global_rng_loader(kind: str) -> ResumableLoader:
    data = TensorDataset(torch.arange(24))
    if kind == "collate":  # shuffled by the loader's own generator, augmented by the global RNGs
        loader = DataLoader(data, batch_size=4, shuffle=True, collate_fn=_augmenting_collate,
                            generator=torch.Generator().manual_seed(0))  # fmt: skip
    else:  # a sampler with set_epoch and no generator: the loader draws its worker seed from torch's RNG
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        loader = DataLoader(data, batch_size=4, sampler=sampler)
    return ResumableLoader(loader)


def _drawless_model() -> nn.Module:
    model = nn.Module()  # made without a random draw (an nn.Linear's init would move the RNG under test)
    model.weight = nn.Parameter(torch.zeros(1))
    return model


def _global_rng_steps(loader: ResumableLoader, steps: int, stop_at: int | None = None,
                      save: Path | None = None) -> list[float]:  # fmt: skip
    """Batches' sums and a dropout-like global draw per step; saves and returns at ``stop_at``."""
    seen: list[float] = []
    while len(seen) < steps:
        for batch in loader:
            x = batch if isinstance(batch, torch.Tensor) else batch[0]
            seen += [float(x.float().sum()), float(torch.rand(()))]
            if len(seen) // 2 == stop_at and save is not None:
                model = _drawless_model()
                opt = torch.optim.SGD(model.parameters())
                save_checkpoint(save, model=model, optimizer=opt, step=stop_at, loader=loader)
                return seen
            if len(seen) >= steps:
                break
    return seen


@pytest.mark.parametrize("kind", ["collate", "sampler"])
def test_resumable_loader_replays_without_touching_the_global_rngs(tmp_path: Path, kind: str) -> None:
    """A resume mid-epoch continues with the batches and global random draws of the uninterrupted run:
    the replayed batches' augmentations, and a generator-less loader's seed, draw as at the epoch's
    start, not from the training loop's RNG (a user trial's SimCLR: loss 2.54 resumed vs 2.51)."""
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    whole = _global_rng_steps(_global_rng_loader(kind), steps=2 * 15)
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    first = _global_rng_steps(_global_rng_loader(kind), steps=2 * 15, stop_at=9, save=tmp_path / "ck.pt")
    torch.manual_seed(5), np.random.seed(5), random.seed(5)  # the new process's own state, replaced
    loader = _global_rng_loader(kind)
    model = _drawless_model()
    opt = torch.optim.SGD(model.parameters())
    load_checkpoint(tmp_path / "ck.pt", model=model, optimizer=opt, loader=loader)
    rest = _global_rng_steps(loader, steps=2 * 6)  # 9 of 15 steps done: 6 to go
    assert first == whole[:18]  # 6 batches an epoch: step 9 is mid-epoch 2
    assert rest == whole[18:]


def test_resumable_loader_state_loads_with_torchs_weights_only_default(tmp_path: Path) -> None:
    """A loader's state_dict kept in a user's own checkpoint is read back with torch.load's default
    (weights_only=True since torch 2.6), which refuses NumPy arrays: the global RNG state kept for the
    replay holds NumPy's keys as a tensor."""
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    whole = _global_rng_steps(_global_rng_loader("collate"), steps=2 * 15)
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    loader = _global_rng_loader("collate")
    first = _global_rng_steps(loader, steps=2 * 9)  # stops after 9 steps, mid-epoch 2
    name, keys, *rest = np.random.get_state()  # the user's own RNG state, in types weights_only loads
    rng = {"torch": torch.get_rng_state(), "numpy": (name, keys.tolist(), *rest), "python": random.getstate()}
    torch.save({"loader": loader.state_dict(), "rng": rng}, tmp_path / "own.pt")
    saved = torch.load(tmp_path / "own.pt")  # the default: weights_only
    torch.manual_seed(5), np.random.seed(5), random.seed(5)  # a new process's own state, replaced
    resumed = _global_rng_loader("collate")
    resumed.load_state_dict(saved["loader"])
    torch.set_rng_state(saved["rng"]["torch"]), random.setstate(saved["rng"]["python"])
    name, keys, *rest = saved["rng"]["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    assert first == whole[:18]
    assert _global_rng_steps(resumed, steps=2 * 6) == whole[18:]


def test_resumable_loader_refuses_global_rng_shuffling() -> None:
    with pytest.raises(ConfigError, match="generator"):
        ResumableLoader(DataLoader(TensorDataset(torch.arange(8)), batch_size=2, shuffle=True))


def _train_cmd(ckpt: Path, out: Path, *extra: str) -> list[str]:
    script = ROOT / "examples" / "resume_training.py"
    args = ["--ckpt", str(ckpt), "--out", str(out), "--steps", "60", "--every", "10", *extra]
    return [sys.executable, str(script), *args]


def test_sigkill_then_resume_is_bit_identical(tmp_path: Path) -> None:
    """examples/resume_training.py for real: one run uninterrupted; one killed with SIGKILL between two
    checkpoints, then resumed from its last one. Both end with the same bits."""
    (tmp_path / "ref").mkdir()
    (tmp_path / "cut").mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ref = subprocess.Popen(_train_cmd(tmp_path / "ref" / "ck.pt", tmp_path / "ref" / "final.pt"), env=env,
                           stdout=subprocess.DEVNULL)  # fmt: skip
    ckpt, out = tmp_path / "cut" / "ck.pt", tmp_path / "cut" / "final.pt"
    cmd = _train_cmd(ckpt, out, "--delay", "0.02")
    cut = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    assert cut.stdout is not None
    for line in cut.stdout:
        if line.startswith("checkpoint 30"):
            time.sleep(0.05)  # a few steps past the checkpoint: the kill lands mid-run, between checkpoints
            os.kill(cut.pid, signal.SIGKILL)
            break
    assert cut.wait(timeout=60) == -signal.SIGKILL
    assert not out.exists()
    resumed = subprocess.run(_train_cmd(ckpt, out, "--resume"), env=env, capture_output=True, text=True,
                             timeout=120, check=True)  # fmt: skip
    step = int(resumed.stdout.split("resumed from step ")[1].split()[0])
    assert 30 <= step < 60
    assert ref.wait(timeout=120) == 0
    a = torch.load(tmp_path / "ref" / "final.pt", weights_only=False)
    b = torch.load(out, weights_only=False)
    assert a["skipped_steps"] > 0  # injected overflows happened, so the scaler state mattered
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"], strict=True))
    assert a["losses"] == b["losses"] and a["scales"] == b["scales"]


# ------------------------------------------------------------------------ refusals (issue 14 items 3, 10)
def _snapshot(run: Run) -> list[torch.Tensor]:
    return [t.clone() for t in run.state()]


def test_a_mismatched_optimizer_is_named_and_leaves_everything_untouched(tmp_path: Path) -> None:
    """The model loads first: before, it was overwritten and only then did the optimizer fail, with torch's
    KeyError. Now nothing is written, and the message names both classes."""
    saved = Run()
    saved.step()
    saved.save(tmp_path / "ck.pt", step=1)
    other = Run()
    torch.manual_seed(7)
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(torch.randn_like(p))  # other weights than the checkpoint's, so a write would show
    other.opt = mixprec.MasterWeights(torch.optim.SGD(other.model.parameters(), lr=0.1, momentum=0.9))
    other.sched = torch.optim.lr_scheduler.StepLR(other.opt, step_size=3, gamma=0.5)
    before = _snapshot(other)
    with pytest.raises(CheckpointError, match=r"saved as MasterWeights\(AdamW\).*MasterWeights\(SGD\)"):
        other.load(tmp_path / "ck.pt")
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(other), strict=True))


def test_a_model_at_another_precision_is_named(tmp_path: Path) -> None:
    saved = Run()
    saved.save(tmp_path / "ck.pt", step=0)
    fp32 = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
    before = [p.clone() for p in fp32.parameters()]
    with pytest.raises(CheckpointError, match=r"are torch.float16 in the checkpoint, torch.float32 here"):
        load_checkpoint(tmp_path / "ck.pt", model=fp32, optimizer=torch.optim.AdamW(fp32.parameters()))
    assert all(torch.equal(x, y) for x, y in zip(before, fp32.parameters(), strict=True))


def _flip_bit_in(path: Path, value: torch.Tensor) -> None:
    """Flip one bit inside the stored bytes of ``value`` (found in the file by content)."""
    data = bytearray(path.read_bytes())
    raw = value.detach().contiguous().view(torch.uint8).numpy().tobytes()
    at = data.find(raw)
    assert at >= 0, "the tensor's bytes are stored verbatim in torch's zip archive"
    data[at + len(raw) // 2] ^= 0x04
    path.write_bytes(bytes(data))


def test_a_flipped_bit_in_a_weight_is_refused(tmp_path: Path) -> None:
    run = Run()
    run.step()
    path = tmp_path / "ck.pt"
    run.save(path, step=1)
    assert Run().load(path).step == 1  # intact: loads
    _flip_bit_in(path, run.model[0].weight)
    with pytest.raises(CheckpointError, match="damaged"):
        Run().load(path)


def test_saving_between_step_and_update_is_refused(tmp_path: Path) -> None:
    run = Run()
    x, y = next(run.batches)
    run.scaler.scale(F.cross_entropy(run.model(x.half()).float(), y)).backward()
    run.scaler.step(run.opt)
    with pytest.raises(CheckpointError, match=r"after scaler.update\(\)"):
        run.save(tmp_path / "ck.pt", step=1)
    run.scaler.update()
    run.save(tmp_path / "ck.pt", step=1)  # at the end of the iteration: fine


def test_saving_the_optimizer_inside_master_weights_is_refused(tmp_path: Path) -> None:
    run = Run()
    run.step()
    with pytest.raises(CheckpointError, match="pass the MasterWeights wrapper"):
        save_checkpoint(tmp_path / "ck.pt", model=run.model, optimizer=run.opt.optimizer, scaler=run.scaler)
    assert not (tmp_path / "ck.pt").exists()


def test_saving_a_wrapped_model_is_refused(tmp_path: Path) -> None:
    """A DDP (here DataParallel, which needs no process group) model's state dict is 'module.'-prefixed:
    the saved file failed to load into the model later, with a message about architecture (a user trial)."""
    run = Run()
    run.step()
    with pytest.raises(CheckpointError, match=r"(?s)wrapped in DataParallel.*model=ddp.module"):
        save_checkpoint(tmp_path / "ck.pt", model=nn.DataParallel(run.model), optimizer=run.opt)
    assert not (tmp_path / "ck.pt").exists()


def test_a_killed_saves_temp_file_is_removed_at_the_next_save(tmp_path: Path) -> None:
    run = Run()
    path = tmp_path / "ck.pt"
    leftover = tmp_path / ".ck.pt.x7k2_q9a.tmp"  # the name mkstemp gave a save that was SIGKILLed
    leftover.write_bytes(b"half a checkpoint")
    unrelated = tmp_path / ".other.pt.x7k2_q9a.tmp"  # another checkpoint's save may be running
    unrelated.write_bytes(b"")
    run.save(path, step=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.pt.x7k2_q9a.tmp", "ck.pt"]


def test_a_checkpoint_gets_the_umask_file_mode(tmp_path: Path) -> None:
    """As torch.save(path) or open() would create it: 0o666 less the umask (mkstemp alone gives 0o600)."""
    reference = tmp_path / "reference"
    old = os.umask(0o022)
    try:
        reference.touch()
        Run().save(tmp_path / "ck.pt", step=0)
    finally:
        os.umask(old)
    assert (tmp_path / "ck.pt").stat().st_mode & 0o777 == reference.stat().st_mode & 0o777 == 0o644


def test_a_checkpoint_of_format_1_loads_with_a_warning_that_it_is_unverified(tmp_path: Path) -> None:
    """Files written before the checksum existed still resume: unverified, and said so."""
    run = Run()
    run.step()
    path = tmp_path / "ck.pt"
    run.save(path, step=1)
    payload = torch.load(path, weights_only=False)
    for key in ("checksum", "classes"):  # what format 1 did not have
        del payload[key]
    torch.save({**payload, "format": 1}, path)
    other = Run()
    with pytest.warns(UserWarning, match="without a checksum: loaded unverified"):
        assert other.load(path).step == 1
    assert all(torch.equal(x, y) for x, y in zip(run.state(), other.state(), strict=True))


def test_a_split_masters_checkpoint_records_the_optimizer_it_wraps(tmp_path: Path) -> None:
    """A LowPrecisionOptimizer was recorded by its class alone (it holds its optimizer as ``.inner``): an
    AdamW run resumed into SGD failed inside the first step with a KeyError instead of being refused. A
    checkpoint written before, with the bare name, still loads into the same class."""
    from mixprec.checkpoint_checks import check_classes, describe
    from mixprec.low_precision import LowPrecisionOptimizer

    def split(cls: type) -> LowPrecisionOptimizer:
        torch.manual_seed(0)
        model = nn.Linear(4, 2).bfloat16()
        return LowPrecisionOptimizer(cls(model.parameters(), lr=0.1), "split")

    adamw = split(torch.optim.AdamW)
    assert describe(adamw) == "LowPrecisionOptimizer(AdamW)"
    model = nn.Linear(4, 2).bfloat16()
    opt = LowPrecisionOptimizer(torch.optim.AdamW(model.parameters()), "split")
    save_checkpoint(tmp_path / "ck.pt", model=model, optimizer=opt, step=0)
    with pytest.raises(CheckpointError, match=r"saved as LowPrecisionOptimizer\(AdamW\).*SGD"):
        load_checkpoint(tmp_path / "ck.pt", model=model, optimizer=split(torch.optim.SGD))
    check_classes("optimizer", [adamw], ["LowPrecisionOptimizer"])  # the old record: accepted


class ApexRun:
    """An O2 run through mixprec.initialize / scale_loss: its loss scale lives with the optimizer."""

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        mixprec.amp.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.model, self.opt = mixprec.initialize(model, opt, opt_level="O2", dtype=dtype, verbosity=0)
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)

    def step(self, overflow: bool = False) -> float:
        loss = F.cross_entropy(self.model(self.x), self.y) * (float("inf") if overflow else 1.0)
        with mixprec.scale_loss(loss, self.opt) as scaled:
            scaled.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()

    def state(self) -> list[torch.Tensor]:
        return [*self.model.state_dict().values(), *mixprec.master_params(self.opt)]


@pytest.mark.usefixtures("fresh_amp_state")
def test_an_initialize_run_keeps_its_loss_scale_without_being_given_the_scaler(tmp_path: Path) -> None:
    a = ApexRun()
    a.step(overflow=True)  # 65536 -> 32768
    a.step()
    scale = mixprec.amp.loss_scaler().get_scale()
    assert scale == 2.0**15
    save_checkpoint(tmp_path / "ck.pt", model=a.model, optimizer=a.opt, step=2)
    losses_a = [a.step() for _ in range(3)]

    b = ApexRun()  # a fresh initialize: its scaler starts at 65536
    load_checkpoint(tmp_path / "ck.pt", model=b.model, optimizer=b.opt)
    assert mixprec.amp.loss_scaler().get_scale() == scale
    losses_b = [b.step() for _ in range(3)]
    assert losses_b == losses_a
    assert all(torch.equal(x, y) for x, y in zip(a.state(), b.state(), strict=True))


@pytest.mark.usefixtures("fresh_amp_state")
def test_an_initialize_checkpoint_saved_without_its_scale_loads_and_says_so(tmp_path: Path) -> None:
    a = ApexRun()
    a.step(overflow=True)
    path = tmp_path / "ck.pt"
    save_checkpoint(path, model=a.model, optimizer=a.opt, scaler=[], step=1)  # as mixprec did before
    b = ApexRun()
    with pytest.warns(UserWarning, match="holds no loss scale.*restarts at 65536"):
        load_checkpoint(path, model=b.model, optimizer=b.opt)
    assert all(torch.equal(x, y) for x, y in zip(a.state(), b.state(), strict=True))


@pytest.mark.usefixtures("fresh_amp_state")
@pytest.mark.parametrize(("saved", "loaded"), [(torch.bfloat16, torch.float16),
                                               (torch.float16, torch.bfloat16)])
def test_an_initialize_checkpoint_of_the_other_half_precision_is_refused(
    saved: torch.dtype, loaded: torch.dtype, tmp_path: Path
) -> None:
    """A user trial: a bf16 O2 checkpoint loaded into an fp16 O2 run silently gave it bf16's static scale
    of 1 (fp16 gradients then underflow); an O2 model's state dict is fp32 at either precision, so only the
    scaler tells them apart."""
    a = ApexRun(saved)
    a.step()
    save_checkpoint(tmp_path / "ck.pt", model=a.model, optimizer=a.opt, step=1)
    b = ApexRun(loaded)
    before = [t.clone() for t in b.state()]
    with pytest.raises(CheckpointError, match=r"(?s)scaler 0: the checkpoint's loss scale is .*resume at "):
        load_checkpoint(tmp_path / "ck.pt", model=b.model, optimizer=b.opt)
    assert all(torch.equal(x, y) for x, y in zip(before, b.state(), strict=True))  # all or nothing


@pytest.mark.usefixtures("fresh_amp_state")
def test_a_compiled_models_checkpoint_loads_into_the_plain_model_and_back(tmp_path: Path) -> None:
    """A user trial: save_checkpoint(model=torch.compile(m)) wrote '_orig_mod.'-prefixed names, which the
    plain model (a resume that compiles after loading) refused as an architecture mismatch."""
    a = ApexRun()
    a.step()
    save_checkpoint(tmp_path / "compiled.pt", model=torch.compile(a.model), optimizer=a.opt, step=1)
    b = ApexRun()
    load_checkpoint(tmp_path / "compiled.pt", model=b.model, optimizer=b.opt)
    assert all(torch.equal(x, y) for x, y in zip(a.state(), b.state(), strict=True))
    save_checkpoint(tmp_path / "plain.pt", model=a.model, optimizer=a.opt, step=1)
    c = ApexRun()
    load_checkpoint(tmp_path / "plain.pt", model=torch.compile(c.model), optimizer=c.opt)
    assert all(torch.equal(x, y) for x, y in zip(a.state(), c.state(), strict=True))


@pytest.mark.usefixtures("fresh_amp_state")
def test_a_compiled_models_checkpoint_from_before_the_unwrapping_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review: files written with the wrapper (class OptimizedModule, '_orig_mod.' names) loaded into a
    compiled model before; unwrapping at load refused them."""
    import mixprec.checkpoint as checkpoint_module

    a = ApexRun()
    a.step()
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint_module, "_uncompiled", lambda model: model)  # what mixprec wrote before
        save_checkpoint(tmp_path / "old.pt", model=torch.compile(a.model), optimizer=a.opt, step=1)
    saved = torch.load(tmp_path / "old.pt", weights_only=False)["models"][0]
    assert all(k.startswith("_orig_mod.") for k in saved)
    for model_of in (lambda run: torch.compile(run.model), lambda run: run.model):
        b = ApexRun()
        load_checkpoint(tmp_path / "old.pt", model=model_of(b), optimizer=b.opt)
        assert all(torch.equal(x, y) for x, y in zip(a.state(), b.state(), strict=True))
