"""A real client: a nanoGPT-shaped model in plain PyTorch (weight tying, decay/no-decay AdamW split, fused
AdamW, gradient clipping, the loss inside forward) trained through every interface, each against fp32."""

from __future__ import annotations

import statistics

import pytest
from conftest import example

STEPS = 40
# The mean loss of the last 10 of 40 steps: fp16 GEMMs with fp32 accumulation track fp32 within ~0.001
# (autocast, O1); a half model (O2) rounds its weights and activations too, ~0.02 measured. bf16 has 8
# significant bits to fp16's 11, but O2-bf16 keeps fp32 masters: measured within 0.01.
TOLERANCE = {"autocast": 0.01, "O1": 0.01, "O2": 0.05, "O2-bf16": 0.05}


def _tail(losses: list[float]) -> float:
    return statistics.fmean(losses[-10:])


@pytest.fixture(scope="module")
def fp32_tail() -> float:
    return _tail(example("gpt_interfaces").run("fp32", STEPS))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("interface", list(TOLERANCE))
def test_each_interface_trains_the_gpt_like_fp32(interface: str, fp32_tail: float) -> None:
    losses = example("gpt_interfaces").run(interface, STEPS)
    assert losses[-1] < losses[0] - 1.0  # it learned (3.5 -> ~1.9 nats)
    assert abs(_tail(losses) - fp32_tail) < TOLERANCE[interface]


@pytest.mark.usefixtures("one_thread")
def test_the_learner_trains_the_gpt_like_fp32() -> None:
    recipe = example("gpt_learner")
    half, ref = recipe.train("fp16", STEPS), recipe.train("fp32", STEPS)
    assert abs(_tail(half.recorder.losses) - _tail(ref.recorder.losses)) < 0.05  # as O2: a half model


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("interface", ["autocast", "O1", "O2"])
def test_activation_checkpointing_changes_nothing(interface: str) -> None:
    """Recomputing each block in backward (mixprec.checkpoint_context re-enters the region) gives the same
    losses as storing the activations; before the recompute's casts were dropped, the next step's region
    reused them after fused AdamW had changed the weights (no version bump) and the runs diverged by 0.2."""
    gpt = example("gpt_interfaces")
    assert gpt.run(interface, 8, checkpoint=True) == gpt.run(interface, 8)


@pytest.mark.usefixtures("one_thread")
def test_o2_compiled_with_checkpointing_trains_like_eager() -> None:
    """torch.compile of the O2 model (one graph), activation checkpointing inside: within the rounding
    Inductor's fused pointwise ops do once where eager rounds each op (measured 1e-4 over 20 steps)."""
    gpt = example("gpt_interfaces")
    one_block = gpt.GPTConfig(n_layer=1)  # every compiled block costs compile time; one shows the point
    compiled = gpt.run("O2", 10, compile=True, checkpoint=True, cfg=one_block)
    eager = gpt.run("O2", 10, cfg=one_block)
    assert max(abs(a - b) for a, b in zip(compiled, eager, strict=True)) < 5e-3


@pytest.mark.usefixtures("one_thread")
def test_o1_compiled_with_the_loss_inside_forward_trains_like_eager() -> None:
    """O1 compiled, with the GPT's cross-entropy (an fp32 op under O1) inside forward: AOTAutograd refused
    the graph while the region was entered in a pre-hook; as a with-block around forward it traces."""
    gpt = example("gpt_interfaces")
    one_block = gpt.GPTConfig(n_layer=1)  # as above
    compiled, eager = gpt.run("O1", 6, compile=True, cfg=one_block), gpt.run("O1", 6, cfg=one_block)
    assert max(abs(a - b) for a, b in zip(compiled, eager, strict=True)) < 5e-3
