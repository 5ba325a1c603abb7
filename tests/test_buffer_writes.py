"""A half model's forward writing a buffer the cast made half (an EMA codebook) is said once, with the fix
(keep_fp32), which keeps the running average as the fp32 model computes it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec


class _Codebook(nn.Module):
    """A VQ-VAE's EMA statistics: ``cluster_size`` written by every training forward, ``mask`` read only."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("cluster_size", torch.ones(4))
        self.register_buffer("mask", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.cluster_size.mul_(0.99).add_(x.float().abs().mean(0), alpha=0.01)
        return self.lin(x * self.mask)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Codebook(), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _said(model: nn.Module, forwards: int = 2) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(forwards):
            model(torch.randn(3, 4))
    return [str(w.message) for w in caught if "The forward wrote" in str(w.message)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_buffer_the_forward_writes_in_half_is_said_once(dtype: torch.dtype) -> None:
    model = _model()
    model, _ = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                                  dtype=dtype, verbosity=0)
    said = _said(model)
    assert len(said) == 1 and "0.cluster_size" in said[0] and "mask" not in said[0]
    assert "mixprec.keep_fp32(module)" in said[0] and "1.running" not in said[0]  # BatchNorm: fp32 in O2


def test_a_write_through_data_is_said_too() -> None:
    """rosinality's vq-vae-2 writes its EMA through .data, which leaves the version counter as it was."""
    model = _model()
    model[0].forward = lambda x: (model[0].cluster_size.data.mul_(0.9).add_(1.0),  # type: ignore[method-assign]
                                  model[0].lin(x))[1]
    model, _ = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                                  dtype=torch.bfloat16, verbosity=0)
    said = _said(model)
    assert len(said) == 1 and "0.cluster_size" in said[0]


@pytest.mark.parametrize("parametrized", [False, True])
def test_spectral_norms_power_iteration_vectors_say_nothing(parametrized: bool) -> None:
    """Recomputed from the weight at every forward, u and v accumulate nothing (a review: the warning
    told a GAN to keep every spectrally normalised layer fp32)."""
    norm = nn.utils.parametrizations.spectral_norm if parametrized else nn.utils.spectral_norm
    model = nn.Sequential(norm(nn.Linear(4, 8)), nn.ReLU(), norm(nn.Linear(8, 1)))
    model, _ = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                                  dtype=torch.bfloat16, verbosity=0)
    assert _said(model) == []


def test_eval_forwards_running_statistics_and_kept_modules_say_nothing() -> None:
    pure = _model()  # O3: BatchNorm half too, on purpose: its statistics are not named
    pure[0].forward = lambda x: pure[0].lin(x)  # type: ignore[method-assign]  # writes nothing
    pure, _ = mixprec.initialize(pure, torch.optim.SGD(pure.parameters(), lr=0.1), opt_level="O3",
                                 verbosity=0)
    assert _said(pure) == []
    mixprec.amp.reset()
    evaluated = _model()
    evaluated, _ = mixprec.initialize(evaluated, torch.optim.SGD(evaluated.parameters(), lr=0.1),
                                      opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    evaluated.eval()
    assert _said(evaluated) == []


def _codebook_after(keep: bool, xs: list[torch.Tensor]) -> torch.Tensor:
    mixprec.amp.reset()
    model = _model()
    if keep:
        mixprec.keep_fp32(model[0])
    model, _ = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                                  dtype=torch.bfloat16, verbosity=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x in xs:
            model(x)
    return model[0].cluster_size


def test_the_fix_keeps_the_running_average_as_fp32_computes_it() -> None:
    xs = [torch.randn(8, 4) * 5 for _ in range(50)]
    reference = _model()
    with torch.no_grad():
        for x in xs:  # the half model's inputs are rounded to bf16 at its boundary: the same values here
            reference(x.bfloat16().float())
    kept, rounded = _codebook_after(True, xs), _codebook_after(False, xs)
    assert kept.dtype == torch.float32
    torch.testing.assert_close(kept, reference[0].cluster_size, rtol=1e-6, atol=0)
    # what the warning is about: in bf16 the same average drifted by percents
    assert (rounded.float() / reference[0].cluster_size - 1).abs().max() > 0.01
