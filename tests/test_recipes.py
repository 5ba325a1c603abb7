"""The recipes in examples/ run, with GradScaler and with initialize/scale_loss, and each fp16 run lands
where the same recipe lands in fp32 (the reference). Tolerances are about 2x the fp16 rounding drift
measured over these short runs; a recipe done wrong (clipping scaled gradients, accumulating without
dividing by N, a penalty on scaled gradients) misses them by 20x to 10000x."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import EXAMPLES, example
from torch import nn

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_amp_state")


APIS = ["scaler", "amp"]


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def assert_weights_close(half: nn.Module, fp32: nn.Module, atol: float) -> None:
    torch.testing.assert_close(weights(half), weights(fp32), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------- clipping
@pytest.mark.parametrize("api", APIS)
def test_clipping_on_unscaled_gradients_matches_fp32(api: str) -> None:
    recipe = example("grad_clipping")
    half, ref = recipe.main(api, "fp16"), recipe.main(api, "fp32")
    # The norms clipped are the true (unscaled) ones: equal to fp32's up to fp16 rounding, step after step.
    torch.testing.assert_close(torch.tensor(half["norms"]), torch.tensor(ref["norms"]), rtol=0.05, atol=0)
    assert sum(n > recipe.MAX_NORM for n in ref["norms"]) >= len(ref["norms"]) // 4  # clipping is active
    assert_weights_close(half["model"], ref["model"], atol=0.05)


# ------------------------------------------------------------------------------------ accumulation
@pytest.mark.parametrize("api", APIS)
def test_accumulation_matches_fp32(api: str) -> None:
    recipe = example("grad_accumulation")
    half, ref = recipe.main(api, "fp16"), recipe.main(api, "fp32")
    assert half["skipped"] == []
    torch.testing.assert_close(half["history"][-1], ref["history"][-1], atol=0.02, rtol=0)


@pytest.mark.parametrize("api", APIS)
def test_accumulation_overflow_skips_whole_effective_step(api: str) -> None:
    recipe = example("grad_accumulation")
    step = 3
    clean = recipe.main(api, "fp16")
    faulty = recipe.main(api, "fp16", fault_micro={recipe.ACCUM * step + 1})  # 2nd micro-batch of step 3
    h = faulty["history"]  # h[i] = weights before effective step i
    assert faulty["skipped"] == [step]  # one skip: the next accumulation did not inherit the inf
    assert all(torch.equal(a, b) for a, b in zip(h[: step + 1], clean["history"][: step + 1], strict=True))
    assert torch.equal(h[step + 1], h[step])  # the whole effective step was skipped
    assert not torch.equal(h[step + 2], h[step + 1])  # the next one stepped...
    assert all(bool(torch.isfinite(w).all()) for w in h)  # ...and nothing non-finite reached the weights
    if api == "scaler":
        scales = faulty["scales"]
        assert scales[step + 1] == scales[step] / 2 and scales[step + 2] == scales[step + 1]


# ----------------------------------------------------------------------------------------- penalty
@pytest.mark.parametrize(("api", "opt_level"), [*((api, "O1") for api in APIS), ("amp", "O2")])
def test_gradient_penalty_matches_fp32(api: str, opt_level: str) -> None:
    recipe = example("grad_penalty")
    half, ref = recipe.main(api, "fp16", opt_level=opt_level), recipe.main(api, "fp32")
    # The penalty is computed from unscaled gradients: the first one (same weights) agrees with fp32's.
    assert half["penalties"][0] == pytest.approx(ref["penalties"][0], rel=1e-2)
    losses, ref_losses = torch.tensor(half["losses"]), torch.tensor(ref["losses"])
    torch.testing.assert_close(losses, ref_losses, atol=0.01, rtol=0.02)
    assert_weights_close(half["model"], ref["model"], atol=0.01)


# ---------------------------------------------------------------------------------- several models
@pytest.mark.parametrize("api", APIS)
def test_multiple_models_match_fp32(api: str) -> None:
    recipe = example("multiple_models")
    half, ref = recipe.main(api, "fp16"), recipe.main(api, "fp32")
    # amp (apex's rule): an overflowing loss skips both optimizers, so while the dynamic scale comes down
    # from 2**16 model 0 also misses the 3 first of its 30 steps (torch.amp's rule skips only model 1's).
    atol = 0.1 if api == "amp" else 0.06
    for m_half, m_ref in zip(half["models"], ref["models"], strict=True):
        assert_weights_close(m_half, m_ref, atol=atol)


@pytest.mark.parametrize("api", APIS)
def test_multiple_models_each_optimizer_skips_on_its_own(api: str) -> None:
    recipe = example("multiple_models")
    k = 5
    run = recipe.main(api, "fp16", steps=k + 3, fault_at={k})  # an inf in model 1's gradient at iteration k
    h = run["history"]  # h[i] = (model 0, model 1) weights before iteration i
    # torch.amp: optimizer 0 steps, its gradients were finite; apex: the loss overflowed, so both skip
    assert torch.equal(h[k + 1][0], h[k][0]) == (api == "amp")
    assert torch.equal(h[k + 1][1], h[k][1])  # optimizer 1 skipped
    assert not torch.equal(h[k + 2][1], h[k + 1][1])  # and steps again at the next iteration
    if api == "scaler":
        scales = run["scales"]
        assert scales[k + 1] == scales[k] / 2  # one update per iteration: backed off once, not per optimizer


# ------------------------------------------------------------------- the scripts as a newcomer runs them
@pytest.mark.parametrize("api", APIS)
def test_multiple_models_fp32_from_the_command_line_matches_the_fault_free_reference(
    api: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 15: `multiple_models.py --precision fp32` printed NaN losses: the default fault was injected
    into a run whose disabled scaler skips nothing. The fp32 run is now the fault-free reference."""
    recipe = example("multiple_models")
    run = recipe.cli(["--api", api, "--precision", "fp32", "--steps", "6"])
    assert run["losses"] == recipe.main(api, "fp32", steps=6, fault_at=())["losses"]
    assert "nan" not in capsys.readouterr().out


@pytest.mark.parametrize("script", ["fsdp2_train", "sharded_grads"])
def test_distributed_examples_print_help_instead_of_running(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import runpy

    import mixprec.distributed

    def ran(*args: object, **kwargs: object) -> None:
        raise AssertionError("--help started the distributed run")

    monkeypatch.setattr(mixprec.distributed, "launch", ran)
    monkeypatch.setattr("sys.argv", [f"{script}.py", "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(EXAMPLES / f"{script}.py"), run_name="__main__")
    assert exit_.value.code == 0
    assert "--steps" in capsys.readouterr().out


def test_resume_training_as_the_recipes_give_it_creates_its_folder(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/recipes.md runs `--ckpt run/last.pt` in a fresh checkout, where run/ does not exist."""
    monkeypatch.chdir(tmp_path)
    recipe = example("resume_training")
    first = recipe.main(["--ckpt", "run/last.pt", "--steps", "4", "--every", "2"])
    assert (tmp_path / "run" / "last.pt").is_file()
    again = recipe.main(["--ckpt", "run/last.pt", "--steps", "4", "--every", "2", "--resume"])
    assert again["losses"] == first["losses"]
