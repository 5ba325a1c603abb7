"""examples/gpt_learner.py: a GPT written in plain PyTorch (weight tying, decay/no-decay groups, clipping,
warm-up + cosine, a model that returns (logits, loss)) trained by the Learner; to_fp16 lands where fp32 does.

Tolerance: on these tiny sizes (2 layers, 32 wide, 40 steps) fp16's final valid loss differed from fp32's by
at most 0.0011 and any step's train loss by at most 0.0036 (seeds 0-2, measured with this example); the
bounds below are about 5x that. A recipe mismatch as small as clipping in the fp16 run only moved the final
valid loss by 0.009-0.019 (measured, seeds 0-2), beyond the bound."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import example

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 40


def test_gpt_to_fp16_trains_like_fp32() -> None:
    gpt = example("gpt_learner")
    runs = {precision: gpt.train(precision, STEPS) for precision in ("fp32", "fp16")}
    fp32, fp16 = runs["fp32"], runs["fp16"]
    assert abs(fp16.valid_loss - fp32.valid_loss) <= 0.005
    torch.testing.assert_close(torch.tensor(fp16.recorder.losses), torch.tensor(fp32.recorder.losses),
                               rtol=0, atol=0.02)
    assert fp32.valid_loss < math.log(gpt.GPTConfig().vocab_size) - 0.8  # it learned the chain
    assert fp16.recorder.skipped_steps == 0
    # the tied weight stayed tied through the half cast and back
    assert fp16.model.lm_head.weight is fp16.model.wte.weight
    assert all(p.dtype == torch.float32 for p in fp16.model.parameters())


def test_the_example_runs_as_a_script(capsys: pytest.CaptureFixture[str]) -> None:
    example("gpt_learner").main(["--precision", "fp16", "--steps", "3"])
    assert "fp16: valid loss" in capsys.readouterr().out
