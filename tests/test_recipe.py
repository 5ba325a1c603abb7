"""Recipe: one description of a precision set-up; presets checked against apex's and fastai's documents."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mixprec.errors import ConfigError
from mixprec.recipe import RECIPES, Recipe, ScaleConfig, get_recipe


def test_fastai_to_fp16_defaults_are_fastai_v1s() -> None:
    # fastai 1.0.61: to_fp16(loss_scale=None, max_noskip=1000, dynamic=True, clip=None, flat_master=False,
    # max_scale=2**24, loss_fp32=True); MixedPrecision reads None as 2**16 dynamic, 512 static
    r = Recipe.fastai()
    assert r.model_dtype == torch.float16 and r.master_weights and r.keep_batchnorm_fp32 and r.loss_fp32
    assert r.scale == ScaleConfig(init_scale=2.0**16, dynamic=True, growth_interval=1000, max_scale=2.0**24)
    static = Recipe.fastai(dynamic=False).scale
    assert static is not None and (static.init_scale, static.dynamic) == (512.0, False)


def test_bf16_needs_no_loss_scale() -> None:
    assert Recipe.fastai(torch.bfloat16).scale is None
    o2 = Recipe.from_opt_level("O2", torch.bfloat16)
    assert o2.model_dtype == torch.bfloat16 and o2.scale == ScaleConfig.static(1.0)
    assert "BF16" in o2.description


def test_opt_levels_match_torch_amp_defaults_for_dynamic_scaling() -> None:
    """apex's dynamic LossScaler starts at 2**16 and grows every 2000 clean steps, as torch.amp's."""
    torch_scaler = torch.amp.GradScaler("cpu")
    scale = Recipe.from_opt_level("O2").scale
    assert scale is not None
    assert (scale.init_scale, scale.growth_interval) == (torch_scaler.get_scale(),
                                                         torch_scaler.get_growth_interval())  # fmt: skip


@pytest.mark.parametrize("name", list(RECIPES))
def test_every_preset_makes_a_scaler_that_matches_its_config(name: str) -> None:
    recipe = RECIPES[name]
    scaler = recipe.make_scaler("cpu")
    assert scaler.is_enabled() == (recipe.scale is not None)
    if recipe.scale is not None:
        assert scaler.get_scale() == recipe.scale.init_scale


def test_get_recipe_names_and_the_letter_o() -> None:
    assert get_recipe("o2") is RECIPES["O2"]
    # the experiment ladder's rung name (a user trial: `mixprec memory --precision fp16-naive` was unknown)
    from mixprec.ladder import LADDER

    naive = next(r for r in LADDER if r.key == "fp16-naive")
    assert get_recipe("fp16-naive") is naive.recipe is RECIPES["pure-fp16"]
    with pytest.raises(ConfigError, match="letter O"):
        get_recipe("02")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(model_dtype=torch.int8), "model_dtype"),
        (dict(autocast_dtype=torch.float32), "autocast_dtype"),
        (dict(flat_master=True), "flat_master"),
        (dict(scale=512.0), "ScaleConfig"),
    ],
)
def test_recipe_refuses_what_cannot_work(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Recipe("bad", "", **kwargs)  # type: ignore[arg-type]


def test_scale_config_is_checked_by_the_scaler_in_the_users_words() -> None:
    with pytest.raises(ValueError, match="init_scale"):
        ScaleConfig(init_scale=-1.0)


def test_recipes_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        RECIPES["O2"].master_weights = False  # type: ignore[misc]
