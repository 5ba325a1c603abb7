"""mixprec.diagnostics.memory against hand-computed byte counts, the published figures, and itself
(the no-compute estimate against a measured run)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import warnings
from collections.abc import Callable
from pathlib import Path

import matplotlib.image
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec import half_saving_gemms
from mixprec.commands import memory as memory_command
from mixprec.diagnostics.memory import (
    as_recipe,
    memory_breakdown,
    memory_breakdowns,
    memory_table,
)
from mixprec.errors import ConfigError
from mixprec.master import MasterWeights
from mixprec.models import mlp, simple_cnn, vgg16
from mixprec.recipe import Recipe

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HALF_DTYPES = [torch.float16, torch.bfloat16]
DEFAULT_FEW_ACTIVATIONS = half_saving_gemms.FEW_ACTIVATIONS  # (read before the fixture below sets 0)
pytestmark = pytest.mark.usefixtures("half_saving_any_size")  # tiny models whose saved bytes are counted
# The published figures: the 784-8192-10 MLP and torchvision's VGG16 (1000 classes).
MLP_PARAMS = 784 * 8192 + 8192 + 8192 * 10 + 10  # 6,512,650
VGG16_PARAMS = 138_357_544


def _batch(b: int, shape: tuple[int, ...], classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(b, *shape, generator=g), torch.randint(0, classes, (b,), generator=g)


def _mlp_saved_bytes(b: int, n_in: int, hidden: int, n_out: int, elem: int, logits_elem: int) -> int:
    """What autograd saves for Flatten -> Linear -> ReLU -> Linear -> cross_entropy, worked out by hand.

    - Linear 1 (addmm): its input x (b x n_in), for the weight gradient. Not W1^T: x needs no gradient.
    - ReLU: its output (b x hidden), for threshold_backward. Linear 2 saves the same tensor as its input:
      one storage. Linear 2 also saves W2^T, a view of a parameter: not an activation.
    - cross_entropy = log_softmax (saves its output, b x n_out) + nll_loss (saves the int64 target and
      the 0-dim total_weight, in the logits' dtype).
    """
    return b * n_in * elem + b * hidden * elem + b * n_out * logits_elem + b * 8 + logits_elem


@pytest.mark.parametrize("arithmetic", ["native", "emulated"])
@pytest.mark.parametrize("estimate", [False, True], ids=["measured", "estimated"])
@pytest.mark.parametrize("precision", ["fp32", "pure-fp16", "pure-bf16"])
def test_mlp_activations_equal_the_hand_computed_sum(
    precision: str, estimate: bool, arithmetic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mixprec import hardware

    monkeypatch.setenv(hardware.ENV_VAR, arithmetic)
    b, n_in, hidden = 8, 64, 32
    elem = torch.empty((), dtype=as_recipe(precision).model_dtype).element_size()
    # every recipe here computes the loss from fp32 logits (loss_fp32): the half ones were counted in half
    assert as_recipe(precision).loss_fp32
    result = memory_breakdown(mlp(n_in, hidden, 10), None, _batch(b, (n_in,)), precision, estimate=estimate)
    assert result.activations == _mlp_saved_bytes(b, n_in, hidden, 10, elem, logits_elem=4)
    # An emulated half GEMM computes with an fp32 copy of its weight; Linear 2 saves it (its input needs a
    # gradient), Linear 1 does not (x needs none). A native one saves the half weight itself: no copy.
    emulated = arithmetic == "emulated" and precision != "fp32"
    assert result.weight_copies == (hidden * 10 * 4 if emulated else 0)


@pytest.mark.parametrize("estimate", [False, True], ids=["measured", "estimated"])
def test_o1_saves_half_activations_and_the_weight_copy_autocast_made(estimate: bool) -> None:
    b, n_in, hidden = 8, 64, 32
    result = memory_breakdown(mlp(n_in, hidden, 10), None, _batch(b, (n_in,)), "O1", estimate=estimate,
                              autocast="torch")  # torch's kernels: what native half GEMMs save
    # Under fp16 autocast the Linears run in fp16 (x and the ReLU output are saved as fp16) and
    # log_softmax in fp32 (its output and total_weight are fp32). Linear 2 saves its fp16 weight copy.
    assert result.activations == _mlp_saved_bytes(b, n_in, hidden, 10, elem=2, logits_elem=4)
    assert result.weight_copies == hidden * 10 * 2
    assert result.params == (n_in * hidden + hidden + hidden * 10 + 10) * 4


@pytest.mark.parametrize("few", [0, DEFAULT_FEW_ACTIVATIONS])  # half-saving GEMMs; and as by default
@pytest.mark.parametrize("precision", ["fp32", "pure-fp16", "pure-bf16", "O1", "O2", "O3"])
def test_estimate_equals_measurement_on_a_small_cnn(precision: str, few: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(half_saving_gemms, "FEW_ACTIVATIONS", few)
    torch.manual_seed(0)
    model = simple_cnn((1, 8, 16, 10))  # conv + BatchNorm + ReLU blocks: O2 keeps BatchNorm fp32
    batch = _batch(4, (1, 8, 8))
    measured = memory_breakdown(model, torch.optim.Adam, batch, precision)
    estimated = memory_breakdown(model, torch.optim.Adam, batch, precision, estimate=True)
    assert estimated.as_dict() == measured.as_dict()
    assert measured.activations > 0 and measured.optimizer_state > 0


class _Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.out = nn.LSTM(32, 64, batch_first=True), nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lstm(x)[0][:, -1])


def test_an_estimate_says_it_leaves_out_a_recurrent_layers_workspace() -> None:
    """torch's fake kernel sizes oneDNN's LSTM workspace at 0 bytes; the estimate undercounted silently."""
    torch.manual_seed(0)
    model, batch = _Tagger(), (torch.randn(4, 16, 32), torch.zeros(4, dtype=torch.int64))
    measured = memory_breakdown(model, torch.optim.Adam, batch, "fp32")
    estimated = memory_breakdown(model, torch.optim.Adam, batch, "fp32", estimate=True)
    assert measured.activations > estimated.activations  # the gap the note is about (264 KiB here)
    assert measured.notes == () and "workspace of LSTM layers" in estimated.notes[0]
    conv = memory_breakdown(simple_cnn((1, 8, 16, 10)), torch.optim.Adam, _batch(4, (1, 8, 8)), "fp32",
                            estimate=True)
    assert conv.notes == ()


class _Logging(nn.Module):
    """A forward that reads a value for its log, as many do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.last_max = nn.Linear(8, 2), 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_max = float(x.abs().max())
        return self.lin(x)


def test_an_estimate_of_a_forward_that_reads_a_value_is_refused_naming_the_measured_count() -> None:
    """A user trial: `mixprec memory --model` on such a model died with torch's bare
    DataDependentOutputException from its fake kernels. The measured count works, and says the same."""
    batch = (torch.randn(4, 8), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ConfigError, match=r"(?s)fake tensors, which hold no values.*--measure") as raised:
        memory_breakdown(_Logging(), torch.optim.Adam, batch, "O2", estimate=True)
    assert "DataDependentOutputException" in str(raised.value)
    assert memory_breakdown(_Logging(), torch.optim.Adam, batch, "O2").activations > 0


class _Attending(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(64, 192), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 4, 16).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)).mean(1)


@pytest.mark.parametrize("precision", ["O1", "O2"])
def test_an_attentions_estimate_equals_its_measurement(precision: str) -> None:
    """torch's fake kernel picks the math attention for every fake q, k, v, so the estimate counted the
    generic path's fp32 copies where the step runs the flash kernel on half ones (a DiT trial: 3.83 MiB
    estimated against 3.20 measured). The suite's fp16 is emulated: mixprec's own flash-attention path."""
    torch.manual_seed(0)
    batch = (torch.randn(8, 32, 64), torch.zeros(8, dtype=torch.int64))
    measured = memory_breakdown(_Attending(), torch.optim.Adam, batch, precision)
    estimated = memory_breakdown(_Attending(), torch.optim.Adam, batch, precision, estimate=True)
    assert estimated.activations == measured.activations


def _with_a_block(kept: bool) -> nn.Module:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    return nn.Sequential(nn.Linear(4, 8), mixprec.keep_fp32(block) if kept else block, nn.Linear(8, 2))


@pytest.mark.parametrize("estimate", [False, True])
def test_a_module_kept_fp32_is_counted_as_it_computes(estimate: bool) -> None:
    """The breakdown's copy of an O2 model lacked prepare's hooks on a keep_fp32 module: it ran in half
    (counted as half) and warned that it did. It computes in fp32 now, saving fp32 activations."""
    batch = (torch.randn(64, 4), torch.zeros(64, dtype=torch.int64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain, kept = (memory_breakdown(_with_a_block(k), torch.optim.Adam, batch, "O2", estimate=estimate)
                       for k in (False, True))
    assert kept.activations > plain.activations


def test_a_kept_modules_estimate_equals_its_measurement() -> None:
    """The kept output's overflow check ran with autograd on: isfinite's abs saved the module's fp32 output
    for backward, so the measurement counted an fp32 activation a step does not keep (a trial: 1.94 MB
    measured, 1.41 MB estimated, for a 512 x 256 tanh). The checks record nothing now."""
    batch = (torch.randn(64, 4), torch.zeros(64, dtype=torch.int64))

    def model() -> nn.Module:  # the kept Linear's output is saved by no op of the step
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), mixprec.keep_fp32(nn.Linear(8, 8)), nn.Linear(8, 2))

    measured, estimated = (memory_breakdown(model(), torch.optim.Adam, batch, "O2", estimate=e)
                           for e in (False, True))
    assert measured.as_dict() == estimated.as_dict()


def test_published_mlp_figures() -> None:
    with torch.device("meta"):  # 26 MB of parameters that are never allocated
        model = mlp()
    batch = (torch.empty(64, 1, 28, 28, device="meta"), torch.empty(64, dtype=torch.int64, device="meta"))
    fp32, fp16, o2 = memory_breakdowns(model, None, batch, ("fp32", "pure-fp16", "O2"), estimate=True)
    assert fp32.n_params == MLP_PARAMS
    assert fp32.params == MLP_PARAMS * 4 and round(fp32.weights / 1e6, 2) == 26.05
    # fp16 weights plus fp32 masters: 2 + 4 bytes per parameter.
    assert o2.weights == MLP_PARAMS * (2 + 4) and round(o2.weights / 1e6, 2) == 39.08
    assert fp16.params == MLP_PARAMS * 2 and fp16.masters == 0
    assert o2.grads == MLP_PARAMS * 2 and o2.master_grads == MLP_PARAMS * 4


def test_published_vgg16_parameters_and_adam_state_is_twice_the_parameters() -> None:
    with torch.device("meta"):
        model = vgg16()
    batch = (torch.empty(1, 3, 32, 32, device="meta"), torch.zeros(1, dtype=torch.int64, device="meta"))
    result = memory_breakdown(model, torch.optim.Adam, batch, "fp32", estimate=True)
    assert result.n_params == VGG16_PARAMS
    assert result.params == VGG16_PARAMS * 4
    assert math.isclose(result.params / 1e9, 0.553, abs_tol=5e-4)  # "about 0.5 GB"
    # exp_avg + exp_avg_sq, plus Adam's per-parameter step counter (a 0-dim fp32 tensor).
    n_tensors = len(list(model.parameters()))
    assert result.optimizer_state == 2 * result.params + 4 * n_tensors


def test_optimizer_state_follows_the_tensors_it_steps() -> None:
    model = mlp(16, 8, 4)
    batch = _batch(2, (16,), 4)
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    momentum = memory_breakdown(model, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), batch,
                                "pure-fp16")
    assert momentum.optimizer_state == n_params * 2  # one fp16 buffer per fp16 parameter
    assert memory_breakdown(model, torch.optim.SGD(model.parameters(), lr=0.1), batch).optimizer_state == 0
    # O2: Adam steps the fp32 masters, so its state is fp32 whatever the model's dtype.
    o2 = memory_breakdown(model, torch.optim.Adam, batch, "O2")
    assert o2.optimizer_state == 2 * n_params * 4 + 4 * n_tensors
    assert memory_breakdown(model, None, batch).optimizer_state == 0


@pytest.mark.parametrize("wrapped", [False, True])
def test_frozen_parameters_an_optimizer_holds_are_counted_with_the_masters_masterweights_makes(
    wrapped: bool,
) -> None:
    """A LoRA's frozen base passed in the optimizer: MasterWeights makes each frozen weight a master too.
    The breakdown counted masters for the trainable parameters only (65 KB against 3.3 MB in a user's
    trial). Reference: the masters of the MasterWeights itself, over the same cast model."""
    torch.manual_seed(0)
    model = mlp(16, 8, 4)
    model[1].requires_grad_(False)  # type: ignore[index]
    batch = _batch(2, (16,), 4)
    half = copy.deepcopy(model).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="frozen"):
        real = MasterWeights(torch.optim.AdamW(half.parameters()))
    real_masters = sum(m.numel() * m.element_size() for m in real.master_views())
    given = (real, half) if wrapped else (torch.optim.AdamW(model.parameters()), model)
    held_all = memory_breakdown(given[1], given[0], batch, "O2")
    trainable = [p for p in model.parameters() if p.requires_grad]
    trainable_only = memory_breakdown(model, torch.optim.AdamW(trainable), batch, "O2")
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert held_all.masters == real_masters == trainable_only.masters + 4 * frozen
    assert held_all.master_grads == trainable_only.master_grads  # a frozen master never gets a gradient
    assert held_all.optimizer_state == trainable_only.optimizer_state
    assert memory_breakdown(model, torch.optim.AdamW, batch, "O2").masters == trainable_only.masters


def test_a_keep_fp32_module_is_counted_fp32_under_o2_as_initialize_keeps_it() -> None:
    """Reference: the model initialize casts, tensor by tensor."""
    import mixprec

    torch.manual_seed(0)
    model = mlp(16, 8, 4)
    mixprec.keep_fp32(model[1])  # type: ignore[index]
    batch = _batch(2, (16,), 4)
    counted = memory_breakdown(model, torch.optim.AdamW, batch, "O2")
    fresh = copy.deepcopy(model)
    cast, _ = mixprec.initialize(fresh, torch.optim.AdamW(fresh.parameters()), "O2", verbosity=0)
    assert counted.params == sum(p.numel() * p.element_size() for p in cast.parameters())
    assert next(cast[1].parameters()).dtype is torch.float32  # type: ignore[index]
    half = sum(p.numel() for p in cast.parameters() if p.dtype is torch.float16)
    assert counted.masters == 4 * half  # the kept module's fp32 parameters are stepped as they are


def test_unique_storages_tied_weights_and_shared_saved_tensors() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 6, bias=False)
            self.b = nn.Linear(6, 6, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return (h * h).view(-1, 2).sum(1)

    result = memory_breakdown(Tied(), None, torch.randn(3, 6), "fp32", loss_fn=lambda out, _: out.sum())
    assert result.params == 6 * 6 * 4 and result.n_params == 36  # the tied weight once
    # Saved: x by the matmul (for W's gradient) and h by the mul -- twice, as both of its inputs, but one
    # storage. view and sum save nothing. 3x6 fp32 each.
    assert result.activations == 2 * (3 * 6 * 4)


def test_user_model_is_left_untouched() -> None:
    model = simple_cnn((1, 4, 10))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    memory_breakdown(model, torch.optim.Adam, _batch(2, (1, 8, 8)), "O2")
    memory_breakdown(model, torch.optim.Adam, _batch(2, (1, 8, 8)), "O2", estimate=True)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_custom_precision_and_mixprec_autocast_agree_with_torch(dtype: torch.dtype) -> None:
    pytest.importorskip("mixprec.autocast")
    recipe = Recipe("mixed", "fp32 params, autocast", torch.float32, autocast_dtype=dtype)
    model, batch = mlp(16, 8, 4), _batch(2, (16,), 4)
    ours = memory_breakdown(model, None, batch, recipe, autocast="mixprec")
    torchs = memory_breakdown(model, None, batch, recipe, autocast="torch")
    if dtype == torch.bfloat16:  # fp16 on CPU is emulated by mixprec.autocast (fp32 upcasts are saved)
        assert ours.as_dict() == torchs.as_dict()
    assert torchs.activations > 0


def test_user_errors_name_the_fix() -> None:
    with pytest.raises(ConfigError, match="use one of: fp32"):
        as_recipe("fp12")
    with torch.device("meta"):
        model = mlp(4, 4, 2)
    with pytest.raises(ConfigError, match="estimate=True"):
        memory_breakdown(model, None, torch.empty(1, 4, device="meta"))
    with pytest.raises(ConfigError, match="optimizer"):
        memory_breakdown(mlp(4, 4, 2), "adam", torch.randn(1, 4))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="pure-bf16"):  # a low-precision update mode over fp32 masters
        memory_breakdown(mlp(4, 4, 2), None, torch.randn(1, 4), "bf16", update="kahan")
    with pytest.raises(ConfigError, match="(?s)unknown update mode 'foo'.*kahan"):  # was a bare ValueError
        memory_breakdown(mlp(4, 4, 2), None, torch.randn(1, 4), "pure-bf16", update="foo")


def test_table_and_png(tmp_path: object) -> None:
    from rich.console import Console

    from mixprec.diagnostics.plots import plot_memory

    results = memory_breakdowns(mlp(16, 8, 4), torch.optim.Adam, _batch(2, (16,), 4), ("fp32", "O2"))
    console = Console(width=200, record=True)
    console.print(memory_table(results))
    text = console.export_text()
    assert "optimizer state" in text and "O2" in text and "total" in text
    path = plot_memory(results, tmp_path / "memory.png")  # type: ignore[operator]
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


@pytest.mark.parametrize(("total", "unit"), [(100, "KiB"), (2**20 - 1, "KiB"), (2**20, "MiB"),
                                             (5 * 2**30, "GiB")])
def test_the_table_unit_follows_the_largest_total(total: int, unit: str) -> None:
    """A small model's table read 0.00/0.01 MiB everywhere, and the chart was in decimal GB beside a MiB
    table (a user trial): one binary unit, the largest whose 1 fits the largest total."""
    from rich.console import Console

    from mixprec.diagnostics.memory import MemoryBreakdown, memory_unit

    b = MemoryBreakdown("fp32", params=total, masters=0, buffers=0, grads=0, master_grads=0,
                        optimizer_state=0, weight_copies=0, activations=0, n_params=total // 4,
                        estimated=True)
    name, per = memory_unit([b])
    assert name == unit and per == 2 ** {"KiB": 10, "MiB": 20, "GiB": 30}[unit]
    console = Console(width=200, record=True)
    console.print(memory_table([b]))
    text = console.export_text()
    assert f"({unit})" in text and f"{total / per:,.2f}" in text


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    memory_command.add_arguments(parser)
    return memory_command.run(parser.parse_args(argv))


def test_cli_memory(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "m.png"  # type: ignore[operator]
    code = _cli(["--model", "cnn", "--input", "1x16x16", "--batch-size", "4", "--precision",
                 "fp32,pure-fp16,O2", "--png", str(png)])
    out = capsys.readouterr().out
    assert code == 0
    assert "FakeTensorMode" in out and "O2" in out and png.read_bytes()[:8] == PNG_SIGNATURE
    assert _cli(["--precision", "fp32,O7", "--no-png"]) == 2
    assert "O7" in capsys.readouterr().err  # a user error: `mixprec: error: ...` on stderr
    assert _cli(["--model", "vgg16", "--input", "3x16x16", "--no-png"]) == 2


# ------------------------------------------------------------------------------------------ opt levels
def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)}
    return sum(storages.values())


@pytest.mark.usefixtures("fresh_amp_state")
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_opt_level_recipes_match_what_initialize_does(level: str) -> None:
    """The reference: a real step under mixprec.initialize at that level (the recipes are read from
    amp.OPT_LEVELS, so this checks that reading)."""
    import mixprec

    torch.manual_seed(0)
    model, batch = simple_cnn((1, 4, 8, 10)), _batch(2, (1, 8, 8))
    result = memory_breakdown(model, torch.optim.Adam, batch, level)
    real = copy.deepcopy(model)
    real, opt = mixprec.initialize(real, torch.optim.Adam(real.parameters()), level, loss_scale=1.0,
                                   verbosity=0)
    with mixprec.scale_loss(F.cross_entropy(real(batch[0]), batch[1]), opt) as scaled:
        scaled.backward()
    opt.step()
    assert result.params == sum(p.numel() * p.element_size() for p in real.parameters())
    assert result.buffers == sum(b.numel() * b.element_size() for b in real.buffers())
    assert result.optimizer_state == _state_bytes(opt)
    masters = list(opt.master_params()) if isinstance(opt, MasterWeights) else []
    assert result.masters == sum(m.numel() * m.element_size() for m in masters if m.dtype == torch.float32
                                 and all(m is not p for p in real.parameters()))


def _live_saved_bytes(model: nn.Module, loss: Callable[[], torch.Tensor]) -> int:
    """Bytes of the storages autograd saves for backward while ``loss()`` runs, the model's own parameters
    and buffers left out (counted with torch's hooks, not mixprec's)."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    storages: dict[int, int] = {}
    kept: list[torch.Tensor] = []  # alive until counted, so no address is reused by another storage

    def pack(t: torch.Tensor) -> torch.Tensor:
        if (ptr := t.untyped_storage().data_ptr()) not in own:
            storages[ptr] = t.untyped_storage().nbytes()
            kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss()
    return sum(storages.values())


@pytest.mark.usefixtures("fresh_amp_state")
@pytest.mark.parametrize("arithmetic", ["native", "emulated"])
@pytest.mark.parametrize("estimate", [False, True], ids=["measured", "estimated"])
@pytest.mark.parametrize("build", ["mlp", "cnn"])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_saved_activations_equal_what_the_initialized_model_saves(
    level: str, build: str, estimate: bool, arithmetic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """O2 and O3 cast the model's outputs to fp32 before the loss; the breakdown computed the loss in half
    (13,794 B for the MLP here, against 13,956 B of live saved tensors). And it ran a half model's forward
    outside mixprec's half_compute region, so an *emulated* fp16 GEMM's saved fp32 weight copy was missed
    (13,956 B against 16,516 B live: Linear 2's 10x64 weight in fp32)."""
    import mixprec
    from mixprec import hardware

    monkeypatch.setenv(hardware.ENV_VAR, arithmetic)
    torch.manual_seed(0)
    model = mlp(784, 64, 10) if build == "mlp" else simple_cnn((1, 4, 8, 10))
    x, y = _batch(8, (1, 28, 28) if build == "mlp" else (1, 8, 8))
    # O1's real model runs under mixprec.autocast, which emulates as the half models do
    result = memory_breakdown(model, None, (x, y), level, estimate=estimate, autocast="mixprec")
    real = mixprec.initialize(copy.deepcopy(model), opt_level=level, verbosity=0)
    real.train()
    live = _live_saved_bytes(real, lambda: F.cross_entropy(real(x), y))
    assert result.activations + result.weight_copies == live
    assert result.arithmetic == ("" if level == "O0" else arithmetic)
    if build == "mlp" and level == "O2":
        assert live == {"native": 13_956, "emulated": 13_956 + 10 * 64 * 4}[arithmetic]
        assert result.weight_copies == {"native": 0, "emulated": 10 * 64 * 4}[arithmetic]


def test_table_says_how_the_half_gemms_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    from mixprec import hardware

    monkeypatch.setenv(hardware.ENV_VAR, "fp16=emulated,bf16=native")
    # O1 by default as initialize's O1 runs it (mixprec.autocast: emulated here; a user trial found the
    # default was torch.autocast's, 45% fewer activation bytes than initialize's O1 keeps on such a CPU)
    results = memory_breakdowns(mlp(16, 8, 4), None, _batch(2, (16,), 4), ("fp32", "O1", "O2", "pure-bf16"))
    assert [b.arithmetic for b in results] == ["", "emulated", "emulated", "native"]
    results[1] = memory_breakdown(mlp(16, 8, 4), None, _batch(2, (16,), 4), "O1", autocast="torch")
    console = Console(width=300, record=True)
    console.print(memory_table(results))
    row = next(line for line in console.export_text().splitlines() if "half GEMMs" in line)
    cells = [cell.strip() for cell in row.split("│")[1:-1]]
    assert cells[:5] == ["half GEMMs", "-", "native (torch.autocast)", "emulated", "native"]


@pytest.mark.usefixtures("fresh_amp_state")
@pytest.mark.parametrize("master_grads", [True, False])
def test_master_gradients_are_counted_as_initialize_keeps_them(master_grads: bool) -> None:
    """The reference: the fp32 gradients alive after a real O2 bf16 step, with and without master_grads."""
    import mixprec

    torch.manual_seed(0)
    model, batch = simple_cnn((1, 4, 8, 10)), _batch(2, (1, 8, 8))
    recipe = Recipe.from_opt_level("O2", torch.bfloat16).replace(master_grads=master_grads)
    result = memory_breakdown(model, torch.optim.Adam, batch, recipe)
    real = copy.deepcopy(model)
    real, opt = mixprec.initialize(real, torch.optim.Adam(real.parameters()), "O2", dtype=torch.bfloat16,
                                   master_grads=master_grads, verbosity=0)
    with mixprec.scale_loss(F.cross_entropy(real(batch[0]), batch[1]), opt) as scaled:
        scaled.backward()
    masters = set(map(id, opt.master_views()))
    fp32_grads = [m.grad for m in opt.master_params() if id(m) in masters and m.grad is not None]
    assert result.master_grads == sum(g.numel() * g.element_size() for g in fp32_grads)
    assert (result.master_grads > 0) is master_grads


@pytest.mark.usefixtures("fresh_amp_state")
@pytest.mark.parametrize("estimate", [False, True], ids=["measured", "estimated"])
@pytest.mark.parametrize("precision", ["O2", "pure-fp16"])
def test_the_master_weights_optimizer_initialize_returns_is_unwrapped(precision: str, estimate: bool) -> None:
    import mixprec

    torch.manual_seed(0)
    model, batch = simple_cnn((1, 4, 8, 10)), _batch(2, (1, 8, 8))
    half = copy.deepcopy(model)
    _, opt = mixprec.initialize(half, torch.optim.Adam(half.parameters(), lr=1e-3), "O2", verbosity=0)
    assert isinstance(opt, MasterWeights)
    wrapped = memory_breakdown(model, opt, batch, precision, estimate=estimate)
    plain = memory_breakdown(model, torch.optim.Adam, batch, precision, estimate=estimate)
    assert wrapped.as_dict() == plain.as_dict() and wrapped.optimizer_state > 0


def test_get_precision_accepts_amp_properties() -> None:
    from mixprec.amp import OPT_LEVELS

    bf16_o2 = as_recipe(OPT_LEVELS["O2"].with_dtype(torch.bfloat16))
    by_hand = Recipe("O2", "", torch.bfloat16, keep_batchnorm_fp32=True, master_weights=True)
    assert (bf16_o2.model_dtype, bf16_o2.keep_batchnorm_fp32, bf16_o2.uses_masters) == (
        by_hand.model_dtype, by_hand.keep_batchnorm_fp32, by_hand.uses_masters)
    assert as_recipe(OPT_LEVELS["O1"].with_dtype(torch.bfloat16)).autocast_dtype == torch.bfloat16
    assert as_recipe(OPT_LEVELS["O3"]) == as_recipe("O3")
    # Masters only for half parameters, as MasterWeights: a recipe for fp64 parameters is refused.
    with pytest.raises(ConfigError, match="model_dtype"):
        Recipe("fp64 + master", "", torch.float64, master_weights=True)


# ------------------------------------------------------------------------------- low-precision modes, names
@pytest.mark.parametrize("mode", ["naive", "stochastic", "kahan", "split"])
def test_low_precision_modes_match_the_live_optimizer(mode: str) -> None:
    """The reference: footprint() of a real LowPrecisionOptimizer after one step (its live tensors)."""
    from mixprec.low_precision import LowPrecisionOptimizer, footprint

    torch.manual_seed(0)
    model, batch = mlp(16, 8, 4), _batch(2, (16,), 4)
    estimate = memory_breakdown(model, torch.optim.Adam, batch, f"pure-bf16+{mode}", estimate=True)
    real = copy.deepcopy(model).to(torch.bfloat16)
    opt = LowPrecisionOptimizer(torch.optim.Adam(real.parameters()), mode)
    F.cross_entropy(real(batch[0].bfloat16()).float(), batch[1]).backward()
    opt.step()
    held = footprint(opt)
    assert (estimate.params, estimate.grads, estimate.extras) == (held.weights, held.grads, held.extra)
    assert estimate.optimizer_state == held.state + held.scalars  # the wrapped Adam's fp32 state
    assert estimate.extras == {"naive": 0, "stochastic": 0, "kahan": 2, "split": 2}[mode] * held.numel


def test_recipe_names_are_the_vocabulary(capsys: pytest.CaptureFixture[str]) -> None:
    from mixprec import cli

    model, batch = mlp(16, 8, 4), _batch(2, (16,), 4)
    fastai, pure = memory_breakdowns(model, None, batch, ("fp16", "pure-fp16"))
    assert fastai.masters == 4 * fastai.n_params and pure.masters == 0  # "fp16" is to_fp16: fp32 masters
    assert cli.main(["memory", "--precision", "fp32,O5", "--no-png"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mixprec: error:") and "'O5'" in err and "pure-fp16" in err and "Python" not in err
    assert cli.main(["memory", "--precision", "bf16+kahan", "--no-png"]) == 2
    assert "pure-bf16" in capsys.readouterr().err


def test_an_adamw_instance_and_split_masters_are_counted_as_training_holds_them() -> None:
    """An AdamW instance could not be rebuilt (torch 2.13 keeps `decoupled_weight_decay` among its defaults
    but refuses it as an argument); a recipe with split_masters was counted as O2's fp32 masters. The
    reference: what initialize(..., split_masters=True) holds after a step (LowPrecisionOptimizer's
    footprint)."""
    import warnings

    import mixprec
    from mixprec.low_precision import footprint

    torch.manual_seed(0)
    model = mlp(64, 128, 10)
    batch = _batch(8, (64,))
    split = Recipe.from_opt_level("O2", torch.bfloat16).replace(split_masters=True)
    o2 = memory_breakdown(model, torch.optim.AdamW(model.parameters()), batch, "O2")
    ours = memory_breakdown(model, torch.optim.AdamW(model.parameters()), batch, split)
    assert (o2.masters, o2.extras) == (4 * o2.n_params, 0)
    assert (ours.masters, ours.master_grads, ours.extras) == (0, 0, 2 * ours.n_params)  # the low halves
    held = ours.params + ours.grads + ours.extras + ours.optimizer_state
    trained = copy.deepcopy(model)
    opt = torch.optim.AdamW(trained.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trained, opt = mixprec.initialize(trained, opt, "O2", dtype=torch.bfloat16, split_masters=True,
                                          verbosity=0)
    x, y = batch
    with mixprec.scale_loss(F.cross_entropy(trained(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert held == footprint(opt).total
    mixprec.amp.reset()


def test_cli_memory_titles_the_unit_its_numbers_are_in(capsys: pytest.CaptureFixture[str]) -> None:
    """A user trial: the title said (MiB) whatever unit the table chose (vgg16's 0.52 "MiB" of parameters
    were GiB)."""
    assert _cli(["--model", "cnn", "--input", "1x16x16", "--batch-size", "4", "--precision", "fp32",
                 "--no-png"]) == 0
    out = capsys.readouterr().out
    title = next(line for line in out.splitlines() if "Memory of one training step" in line)
    total = next(line for line in out.splitlines() if line.strip("│ ").startswith("total"))
    value = float(total.split("│")[2])
    unit = title.rstrip().rsplit("(", 1)[1].rstrip(")")
    # 7,738 parameters and a 4x1x16x16 batch: well under a MiB, so the table is in KiB
    assert unit == "KiB" and 1 <= value < 1024


class _Masked(nn.Module):
    """Two inputs: features and a mask (a Perceiver's, a Swin's), as its loader yields them."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)) * mask[:, :, None]).mean(1)


class _OneInput(nn.Module):
    """The same model behind one input: the reference the breakdown of two inputs must equal."""

    def __init__(self, inner: _Masked, mask: torch.Tensor) -> None:
        super().__init__()
        self.inner, self.mask = inner, mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x, self.mask.to(x.dtype))


@pytest.mark.parametrize("precision", ["fp32", "O1", "O2"])
@pytest.mark.parametrize("estimate", [True, False])
def test_a_model_of_several_inputs_takes_them_as_its_loader_yields_them(precision: str,
                                                                        estimate: bool) -> None:
    """The breakdown called model(x) only: a two-input model had to be wrapped by hand (two user trials).
    ((x, mask), y) calls model(x, mask), and {"x": x, "mask": mask} model(**x), counted as the same model
    behind one input is."""
    torch.manual_seed(0)
    model, x, mask, y = _Masked(), torch.randn(8, 5, 16), torch.ones(8, 5), torch.randint(0, 4, (8,))
    opt = torch.optim.Adam(model.parameters())
    reference = memory_breakdown(_OneInput(model, mask), opt, (x, y), precision, estimate=estimate)
    for batch in (((x, mask), y), ([x, mask], y), ({"x": x, "mask": mask}, y)):
        got = memory_breakdown(model, opt, batch, precision, estimate=estimate)
        # the mask itself: the reference's is a plain attribute, cast inside forward; ours the model's input
        assert dataclasses.replace(got, activations=0) == dataclasses.replace(reference, activations=0)
        assert 0 <= got.activations - reference.activations <= mask.numel() * 4


def test_the_cli_takes_a_user_model_of_several_inputs(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """An ODE field's forward(t, y): the table's title read the batch size off the first input, a 0-d t,
    and raised IndexError after the breakdowns were computed (a review)."""
    factory = tmp_path / "field.py"
    factory.write_text(
        "import torch\nfrom torch import nn\n\n\nclass Field(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.lin = nn.Linear(16, 16)\n\n    def forward(self, t, y):\n"
        "        return self.lin(y) * t\n\n\ndef make():\n"
        "    return Field(), ((torch.tensor(0.5), torch.randn(32, 16)),), lambda out, y: out.sum()\n"
    )
    assert _cli(["--model", f"{factory}:make", "--precision", "fp32,O2", "--no-png"]) == 0
    assert "batch 32 x 16" in capsys.readouterr().out


def test_a_batch_whose_x_holds_no_tensor_is_named() -> None:
    from mixprec.diagnostics.memory import split_batch
    from mixprec.errors import ConfigError

    x = torch.randn(2, 4)
    with pytest.raises(ConfigError, match=r"(?s)its x is str.*\(\(tokens, mask\), targets\)"):
        split_batch(("tokens", x))
    assert split_batch((x, x))[0] is x and split_batch(((x, x), x))[0] == (x, x)
    # a bare dict (a Hugging Face collator's batch) is the inputs, called as model(**x): its keys were read
    # as the batch's items ("its x is str")
    assert split_batch({"input_ids": x}) == ({"input_ids": x}, None)


@pytest.mark.parametrize("estimate", [True, False])
def test_o2_counts_a_sparse_gradient_table_as_fp32_without_a_master(estimate: bool) -> None:
    """initialize keeps embeddings built with sparse=True fp32 (their own masters); the breakdown counted
    them half with an fp32 master, as the model it describes no longer has them."""
    model = nn.Sequential(nn.EmbeddingBag(1000, 16, mode="sum", sparse=True), nn.Linear(16, 1))
    ids = torch.randint(0, 1000, (8, 3))
    got = memory_breakdown(model, None, ids, "O2", loss_fn=lambda out, *_: out.sum(), estimate=estimate)
    assert got.params == 1000 * 16 * 4 + (16 + 1) * 2
    assert got.masters == (16 + 1) * 4


def test_a_breakdown_of_an_initialized_half_model_copies_it_without_the_ema_warning() -> None:
    """The breakdown copies the model: a half one warned of EMAs made by deepcopy (a review)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = mixprec.initialize(model, opt, "O2", verbosity=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        memory_breakdown(model, opt, (torch.randn(8, 4), torch.zeros(8, dtype=torch.int64)), "O2")
    mixprec.amp.reset()


def test_a_prepared_model_and_a_dict_output_are_refused_naming_the_fix() -> None:
    """A trial: the breakdown of a model initialize had prepared failed with 'call mixprec.amp.restore'
    (which would have undone the training run), and the default loss on a Hugging Face-style dict output
    with torch's TypeError."""
    from mixprec.errors import ConfigError

    model, x, y = nn.Linear(4, 3), torch.randn(2, 4), torch.tensor([0, 2])
    with pytest.raises(ConfigError, match=r"(?s)dict \(keys: logits\).*out\['loss'\]"):
        memory_breakdown(_DictOut(model), None, (x, y), "fp32")
    prepared, _ = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", verbosity=0)
    with pytest.raises(ConfigError, match=r"(?s)prepared by mixprec for fp16 weights.*before initialize"):
        memory_breakdown(prepared, None, (x, y), "fp32")
    assert memory_breakdown(prepared, None, (x, y), "O2").masters == (4 * 3 + 3) * 4  # what it was made for
    mixprec.amp.restore(prepared)
    assert memory_breakdown(prepared, None, (x, y), "fp32").params == (4 * 3 + 3) * 4  # restored: plain


class _DictOut(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.inner(x)}
