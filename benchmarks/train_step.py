"""Full training steps (forward, loss, backward, AdamW) in every precision mixprec and torch.amp offer.

Workloads: a GPT-style decoder (d 512, 4 layers, 8 heads, T 128, vocab 4096, batch 16, tied embedding),
the 784-8192-10 MLP of ``mixprec.models.mlp`` (batch 512), and a laptop-sized GPT (``gpt-small``: d 128,
2 layers, 4 heads, T 64, vocab 512, batch 8), where per-op costs (casts, dispatch) weigh most. On request
(``--workload``): ``gpt-large`` (d 1024, 6 layers, 16 heads, T 512, vocab 8192, batch 32: a size a GPU's
arithmetic limits, not the host), and models user trials brought: ``transformer-lm`` and ``lstm-lm``
(pytorch/examples' word_language_model: ``nn.TransformerEncoder``, ``nn.LSTM``) and ``vit`` (a small ViT,
attention by ``F.scaled_dot_product_attention``) and ``ode`` (a neural ODE: an MLP field integrated by
hand-written RK4, hundreds of tiny GEMMs a step).
Configurations: fp32; torch.autocast bf16; torch.autocast fp16 + torch's GradScaler; mixprec O1 (fp16,
bf16), O2 fp16 and O2 bf16 (``mixprec.initialize`` + ``scale_loss``; O2 bf16 also at 16 bytes per
parameter), and fastai's ``Learner(...).to_bf16()``; each eager and ``torch.compile``-d (a configuration
that fails to compile shows the reason in its row; the run goes on).

Configurations are timed round-robin in one process (one step of each in turn), so load drift on a shared
machine hits them alike. Reported: median ms/step, ratio to fp32 and to torch.autocast of the same dtype,
tokens (samples) per second, MFU (the FLOPs a step must compute, against the best GEMM rate measured
throughout the same run in the dtype the step computes in: a native half dtype's own, else fp32's),
bytes per parameter held by parameters, gradients, master weights and optimizer state after a step,
the MiB autograd saves for backward in one eager forward, and the minor page faults per timed step (a row
that faults pays for fresh pages, not for its arithmetic: with many configurations in one process the heap
cannot always reuse freed blocks for a large tensor).

Where :mod:`mixprec.hardware` says a half dtype has no fast kernels here (an AVX2-only CPU: torch's bf16
GEMMs ~90x slower than fp32), torch.autocast of that dtype is timed with fewer steps and, for the GPT, on a
smaller batch scaled up linearly (GEMM time is linear in the tokens); the table marks those cells.

    python benchmarks/train_step.py                 # default run (< 10 min on 2 cores)
    python benchmarks/train_step.py --quick         # smoke run: MLP, eager, few steps
    python benchmarks/train_step.py --no-compile    # eager only
    python benchmarks/train_step.py --workload mlp --batch 2048   # another batch size
    python benchmarks/train_step.py --default-malloc   # without mixprec.host_memory.keep_freed_memory()
    python benchmarks/train_step.py --device cuda --steps 30   # on a GPU (every step synchronised)
    python benchmarks/train_step.py --phases "mixprec O2 bf16" --phases "torch.autocast bf16"   # per phase
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader, TensorDataset

import mixprec
from mixprec import amp, hardware, models
from mixprec.callbacks import Callback
from mixprec.data import DataBunch
from mixprec.diagnostics.memory import SavedTensors
from mixprec.formats import dtype_label
from mixprec.host_memory import MallocTuning, keep_freed_memory
from mixprec.learner import Learner
from mixprec.low_precision import footprint
from mixprec.region import STATE

# ---- the GPT-style decoder: examples/gpt_learner.py's (nanoGPT's shape, attention written with matmuls so
# every GEMM is visible), at the size ------------------------------------------------------------

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt_learner import GPT, GPTConfig  # noqa: E402  (the examples folder is not a package)

try:
    import resource  # Unix only: page-fault counts
except ImportError:
    resource = None  # type: ignore[assignment]
HAS_RUSAGE = resource is not None

T = TypeVar("T")  # what a measurement of one runner returns (measure_each)

# torch's autocast dtypes outside any region (bf16 on the CPU, fp16 on CUDA), put back after a failed step
_TOP_LEVEL_AUTOCAST_DTYPE = {device: torch.get_autocast_dtype(device) for device in ("cpu", "cuda")}

GPT_SIZE = GPTConfig(vocab_size=4096, block_size=128, n_layer=4, n_head=8, n_embd=512)
# A user trial's size: GEMMs small enough that each cast and dispatched op shows (emulated bf16, eager)
GPT_SMALL = GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=128)
# A GPU's size (84M parameters, 16k tokens a step at batch 32): GEMMs large enough that an H100/H200 waits
# on its own arithmetic, not on the host's launches, as it does for the 19M-parameter GPT above
GPT_LARGE = GPTConfig(vocab_size=8192, block_size=512, n_layer=6, n_head=16, n_embd=1024)


class GPTLogits(GPT):
    """The example's GPT returning its logits only: the benchmark computes every configuration's loss."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(idx)[0]


def gpt_flops_per_token(c: GPTConfig) -> float:
    # PaLM's estimate (as nanoGPT's estimate_mfu): 6 FLOPs per GEMM weight per token (forward 2, backward
    # 4) plus the attention score and value GEMMs, 12 * layers * d * T per token.
    gemm_weights = c.n_layer * 12 * c.n_embd * c.n_embd + c.vocab_size * c.n_embd
    return 6.0 * gemm_weights + 12.0 * c.n_layer * c.n_embd * c.block_size


# ---- pytorch/examples' word_language_model, built from torch's own layers (a user trial's): its inner GEMMs
# are nn.MultiheadAttention's (one composite torch function) and a fused LSTM kernel ---------------------

WLM_VOCAB, WLM_D, WLM_LAYERS, WLM_HEADS, WLM_T = 4096, 256, 2, 4, 35  # its defaults, but emsize 256


class TransformerLM(nn.Module):
    """word_language_model's TransformerModel: nn.TransformerEncoder with a causal mask (batch first)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(WLM_VOCAB, WLM_D)
        layer = nn.TransformerEncoderLayer(WLM_D, WLM_HEADS, WLM_D, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, WLM_LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(WLM_D, WLM_VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(WLM_T), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(idx), mask=self.mask, is_causal=True))


class LSTMLM(nn.Module):
    """word_language_model's RNNModel("LSTM"), the hidden state starting at zero each batch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(WLM_VOCAB, WLM_D)
        self.rnn = nn.LSTM(WLM_D, WLM_D, WLM_LAYERS, batch_first=True)
        self.head = nn.Linear(WLM_D, WLM_VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(idx))[0])


def _wlm_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, WLM_VOCAB, (n, WLM_T + 1), generator=gen)
    return idx[:, :-1], idx[:, 1:]


# ---- a small ViT in timm's block layout (a user trial's): attention by F.scaled_dot_product_attention ------

VIT_D, VIT_HEADS, VIT_DEPTH, VIT_PATCH, VIT_IMAGE, VIT_CLASSES = 192, 3, 4, 4, 32, 10
VIT_TOKENS = (VIT_IMAGE // VIT_PATCH) ** 2


class ViTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(VIT_D), nn.LayerNorm(VIT_D)
        self.qkv, self.proj = nn.Linear(VIT_D, 3 * VIT_D), nn.Linear(VIT_D, VIT_D)
        self.fc1, self.fc2 = nn.Linear(VIT_D, 4 * VIT_D), nn.Linear(4 * VIT_D, VIT_D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, t, 3, VIT_HEADS, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, VIT_D)
        x = x + self.proj(attended)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, VIT_D, VIT_PATCH, VIT_PATCH)
        self.pos = nn.Parameter(torch.zeros(1, VIT_TOKENS, VIT_D))
        self.blocks = nn.Sequential(*[ViTBlock() for _ in range(VIT_DEPTH)])
        self.head = nn.Linear(VIT_D, VIT_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.blocks(x).mean(1))


def _vit_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(n, 3, VIT_IMAGE, VIT_IMAGE, generator=gen)
    return images, torch.randint(0, VIT_CLASSES, (n,), generator=gen)


# per patch token: the blocks' GEMM weights and the patch embedding at 6 FLOPs each, attention's 12 * d * T
# per layer (the head's per-image GEMM is left out: 0.1%)
VIT_FLOPS = (6.0 * (VIT_DEPTH * 12 * VIT_D * VIT_D + 3 * VIT_PATCH * VIT_PATCH * VIT_D)
             + 12.0 * VIT_DEPTH * VIT_D * VIT_TOKENS)


# 6 FLOPs per GEMM weight per token (as the GPT's); attention adds 12 * layers * d * T; an LSTM layer's GEMM
# weights are its four gates' input and hidden matrices.
TRANSFORMER_LM_FLOPS = (6.0 * (WLM_LAYERS * 6 * WLM_D * WLM_D + WLM_VOCAB * WLM_D)
                        + 12.0 * WLM_LAYERS * WLM_D * WLM_T)
LSTM_LM_FLOPS = 6.0 * (WLM_LAYERS * 8 * WLM_D * WLM_D + WLM_VOCAB * WLM_D)


ODE_D, ODE_HIDDEN, ODE_STEPS, ODE_CLASSES = 16, 64, 10, 10


class NeuralODE(nn.Module):
    """A neural ODE classifier (a user trial's shape): an MLP vector field of (state, t) integrated by a
    hand-written RK4 loop, then a linear head. Hundreds of tiny GEMMs a step: per-op costs, not
    arithmetic, set its speed."""

    def __init__(self) -> None:
        super().__init__()
        self.field = nn.Sequential(nn.Linear(ODE_D + 1, ODE_HIDDEN), nn.Tanh(), nn.Linear(ODE_HIDDEN, ODE_D))
        self.head = nn.Linear(ODE_D, ODE_CLASSES)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        h = 1.0 / ODE_STEPS
        for i in range(ODE_STEPS):
            t = torch.full_like(y[:, :1], i * h)
            k1 = self.field(torch.cat([y, t], 1))
            k2 = self.field(torch.cat([y + h / 2 * k1, t + h / 2], 1))
            k3 = self.field(torch.cat([y + h / 2 * k2, t + h / 2], 1))
            k4 = self.field(torch.cat([y + h * k3, t + h], 1))
            y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return self.head(y)


def _ode_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, ODE_D, generator=gen), torch.randint(0, ODE_CLASSES, (n,), generator=gen)


# 4 field evaluations per RK4 step, each two linears (6 FLOPs per weight: forward, input and weight
# gradients), and the head
ODE_FLOPS = 6.0 * (4 * ODE_STEPS * (ODE_D + 1 + ODE_D) * ODE_HIDDEN + ODE_D * ODE_CLASSES)


def mlp_flops_per_sample(n_in: int, hidden: int, n_out: int) -> float:
    # The FLOPs a step must compute, not PaLM's 6 per weight: the input needs no gradient, so the first
    # layer runs its forward and weight-gradient GEMMs only (4 per weight). Counting it at 6 overstated this
    # MLP's FLOPs 1.49x and gave MFUs above 100% on a machine measured at 109 GFLOP/s.
    return 4.0 * n_in * hidden + 6.0 * hidden * n_out


@dataclass(frozen=True)
class Workload:
    name: str
    make: Callable[[], nn.Module]
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # batch size -> (input, target)
    batch_size: int
    tokens_per_sample: int
    flops_per_token: float
    slow_batch_size: int  # batch for the torch configurations that have no fast kernels here


def with_batch(workload: Workload, batch: int) -> Workload:
    """The workload at another batch size (its name says which). A batch below the slow configurations' own
    batch lowers that as well; each is timed at its own batch and scaled, as the table marks."""
    if batch < 1:
        raise SystemExit(f"--batch must be at least 1, got {batch}.")
    name = re.sub(r", b\d+$", f", b{batch}", workload.name)
    slow = min(workload.slow_batch_size, batch)
    return replace(workload, name=name, batch_size=batch, slow_batch_size=slow)


def _gpt_batch(n: int, size: GPTConfig = GPT_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, size.vocab_size, (n, size.block_size + 1), generator=gen)
    return idx[:, :-1], idx[:, 1:]


def _mlp_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 784, generator=gen), torch.randint(0, 10, (n,), generator=gen)


WORKLOADS = {
    "gpt": Workload("GPT d512 L4 H8 T128 V4096, b16", lambda: GPTLogits(GPT_SIZE), _gpt_batch, 16, 128,
                    gpt_flops_per_token(GPT_SIZE), slow_batch_size=1),
    "mlp": Workload("MLP 784-8192-10, b512", lambda: models.mlp(784, 8192, 10), _mlp_batch, 512, 1,
                    mlp_flops_per_sample(784, 8192, 10), slow_batch_size=512),
    "transformer-lm": Workload(f"nn.Transformer LM d{WLM_D} L{WLM_LAYERS} T{WLM_T} V{WLM_VOCAB}, b20",
                               TransformerLM, _wlm_batch, 20, WLM_T, TRANSFORMER_LM_FLOPS,
                               slow_batch_size=20),
    "lstm-lm": Workload(f"LSTM LM d{WLM_D} L{WLM_LAYERS} T{WLM_T} V{WLM_VOCAB}, b20", LSTMLM, _wlm_batch, 20,
                        WLM_T, LSTM_LM_FLOPS, slow_batch_size=20),
    "vit": Workload(f"ViT d{VIT_D} L{VIT_DEPTH} H{VIT_HEADS} {VIT_IMAGE}px/{VIT_PATCH}, b32", ViT, _vit_batch,
                    32, VIT_TOKENS, VIT_FLOPS, slow_batch_size=4),
    "gpt-small": Workload("GPT d128 L2 H4 T64 V512, b8", lambda: GPTLogits(GPT_SMALL),
                          lambda n: _gpt_batch(n, GPT_SMALL), 8, 64, gpt_flops_per_token(GPT_SMALL),
                          slow_batch_size=8),
    "ode": Workload(f"neural ODE d{ODE_D} h{ODE_HIDDEN} RK4x{ODE_STEPS}, b32", NeuralODE, _ode_batch, 32, 1,
                    ODE_FLOPS, slow_batch_size=32),
    "gpt-large": Workload("GPT d1024 L6 H16 T512 V8192, b32", lambda: GPTLogits(GPT_LARGE),
                          lambda n: _gpt_batch(n, GPT_LARGE), 32, 512, gpt_flops_per_token(GPT_LARGE),
                          slow_batch_size=1),
}

# the default run's (the two and the laptop-sized GPT): the others are asked for by name
DEFAULT_WORKLOADS = ("gpt", "mlp", "gpt-small")


# ---- configurations -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    name: str
    dtype: torch.dtype  # the precision it is compared in (fp32 for the baseline)
    kind: str  # "fp32", "torch" or an opt level
    options: tuple[tuple[str, object], ...] = ()  # extra mixprec.initialize arguments


CONFIGS = (
    Config("fp32", torch.float32, "fp32"),
    Config("torch.autocast bf16", torch.bfloat16, "torch"),
    Config("torch.autocast fp16 + GradScaler", torch.float16, "torch"),
    Config("mixprec O1 bf16", torch.bfloat16, "O1"),
    Config("mixprec O1 fp16", torch.float16, "O1"),
    Config("mixprec O2 bf16", torch.bfloat16, "O2"),
    Config("mixprec O2 fp16", torch.float16, "O2"),
    # 16 bytes per parameter: no fp32 master gradients, the master step one compiled pass (master_kernel.py)
    Config("mixprec O2 bf16, 16 B/param", torch.bfloat16, "O2",
           (("master_grads", False), ("compile_step", True))),
    # fastai's interface: Learner(...).to_bf16() (a bf16 model, fp32 masters, no loss scale: no inf check)
    Config("mixprec Learner.to_bf16()", torch.bfloat16, "learner"),
    # 14 bytes per parameter: O2's bf16 model, its fp32 masters held as the bf16 weights plus int16 low halves
    # (initialize's split_masters: LowPrecisionOptimizer "split"), stepped by one native pass (split_adam.c)
    Config("mixprec O2 bf16, split masters (14 B/param)", torch.bfloat16, "O2", (("split_masters", True),)),
)


@dataclass
class Runner:
    """One model + optimizer + batch for a configuration; ``step()`` runs one training step."""

    config: Config
    compiled: bool
    model: nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor
    step: Callable[..., None] = field(init=False)  # step(mark=...): see Mark
    amp_state: object = None  # mixprec.initialize's process-wide state for this runner (see _swap_in)
    error: str = ""
    bytes_per_param: float | None = None  # counted during the step (the Learner frees its gradients after)

    def __post_init__(self) -> None:
        forward = torch.compile(self.model) if self.compiled else self.model
        self.step = _STEPS[self.config.kind](self, forward)

    @property
    def device_type(self) -> str:
        return self.x.device.type

    def activate(self) -> None:
        """Make this runner's initialize state the process's (the round-robin holds one per runner)."""
        if self.amp_state is not None:
            amp._STATE = self.amp_state  # type: ignore[assignment]

    def timed_step(self) -> float:
        self.activate()
        # On a GPU the step only queues kernels: wait for the queue before and after, so the time is the
        # step's own (the previous configuration's kernels are done) and all of it.
        hardware.synchronize(self.device_type)
        start = time.perf_counter()
        self.step()
        hardware.synchronize(self.device_type)
        return time.perf_counter() - start


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().flatten(0, -2), y.flatten())


# A step calls mark(phase) as each phase ends (PHASES, in order; a Learner step is one "whole step"): timed
# runs pass nothing, --phases a timer that synchronises the device first (phase_times). torch.autocast's
# "step" holds its GradScaler's unscale and inf check (fp16; bf16 has none): splitting them out with an
# explicit unscale_ would change torch's work (its fused AdamW unscales inside its own kernel).
Mark = Callable[[str], None]
PHASES = ("forward", "backward", "unscale", "step")


def _no_mark(phase: str) -> None:
    pass


def _fp32_step(r: Runner, forward: Callable[..., torch.Tensor]) -> Callable[..., None]:
    def step(mark: Mark = _no_mark) -> None:
        r.opt.zero_grad(set_to_none=True)
        loss = _loss(forward(r.x), r.y)
        mark("forward")
        loss.backward()
        mark("backward")
        r.opt.step()
        mark("step")

    return step


def _torch_step(r: Runner, forward: Callable[..., torch.Tensor]) -> Callable[..., None]:
    device_type = r.device_type
    scaler = torch.amp.GradScaler(device_type, enabled=r.config.dtype is torch.float16)  # bf16 needs none

    def step(mark: Mark = _no_mark) -> None:
        r.opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=r.config.dtype):
            loss = _loss(forward(r.x), r.y)
        mark("forward")
        scaler.scale(loss).backward()
        mark("backward")
        scaler.step(r.opt)  # torch's unscale is inside its step
        scaler.update()
        mark("step")

    return step


def _mixprec_step(r: Runner, forward: Callable[..., torch.Tensor]) -> Callable[..., None]:
    def step(mark: Mark = _no_mark) -> None:
        r.opt.zero_grad(set_to_none=True)
        loss = _loss(forward(r.x), r.y)
        mark("forward")
        with mixprec.scale_loss(loss, r.opt) as scaled:
            scaled.backward()
            mark("backward")
        mark("unscale")  # scale_loss's exit: unscale (into the masters under O2), inf check, scale update
        r.opt.step()
        mark("step")

    return step


class _BytesAtStepEnd(Callback):
    """The Learner frees the gradients right after its step (fastai's zero_grad): count the bytes per
    parameter before that, as the other configurations are counted, gradients included."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def on_step_end(self) -> None:
        if self.runner.bytes_per_param is None:  # once: the layout does not change from step to step
            self.runner.bytes_per_param = footprint(self.runner.opt).per_param


def _learner_step(r: Runner, forward: Callable[..., torch.Tensor]) -> Callable[..., None]:
    """One batch of ``Learner.fit`` at a time, callbacks and all, so the Learner joins the round-robin: the
    fit's set-up (on_train_begin: the MixedPrecision callback makes the model bf16 and wraps the optimizer
    in MasterWeights) once, then the loop body ``_train_batch`` per step."""
    loader = DataLoader(TensorDataset(r.x, r.y), batch_size=len(r.x))  # never iterated: one fixed batch
    data = DataBunch(loader, loader, n_classes=2, input_shape=tuple(r.x.shape[1:]), name="benchmark")
    learn = Learner(data, forward, loss_func=_loss, silent=True, callbacks=[_BytesAtStepEnd(r)]).to_bf16()
    learn.opt = r.opt  # what fit's opt_func would build: the runner's fused AdamW, as for every configuration
    learn.n_epochs, learn.n_steps = 1, 2**31
    learn._event("on_train_begin")
    learn.model.train()
    learn.training = True
    r.opt = learn.opt  # now the MasterWeights wrapper: bytes/param counts its masters

    def step(mark: Mark = _no_mark) -> None:
        learn._train_batch(r.x, r.y)  # fit's loop body, callbacks and all: one phase
        mark("whole step")

    return step


_STEPS: dict[str, Callable[[Runner, Callable[..., torch.Tensor]], Callable[..., None]]] = {
    "fp32": _fp32_step,
    "torch": _torch_step,
    "O1": _mixprec_step,
    "O2": _mixprec_step,
    "learner": _learner_step,
}


def make_runner(
    workload: Workload, config: Config, compiled: bool, state: dict, batch: int, device: str = "cpu"
) -> Runner:
    model = workload.make().to(device)
    model.load_state_dict(state)
    # fused: torch's fastest AdamW, for every configuration (MasterWeights picks it for O2's masters anyway)
    opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    amp_state = None
    if config.kind in ("O1", "O2"):
        with warnings.catch_warnings():  # "initialize was called again": one call per configuration
            warnings.simplefilter("ignore", UserWarning)
            model, opt = mixprec.initialize(model, opt, config.kind, dtype=config.dtype, verbosity=0,
                                            **dict(config.options))
        # apex's amp keeps one process-wide state (one initialize per process); the round-robin holds one
        # per configuration and swaps it in before each step.
        amp_state = amp._STATE
    x, y = workload.batch(batch)
    return Runner(config, compiled, model, opt, x.to(device), y.to(device), amp_state=amp_state)


# ---- measurements ---------------------------------------------------------------------------------------


def saved_mib(runner: Runner) -> float | None:
    """MiB autograd saves for backward in one eager forward (each storage once, parameters excluded):
    activations, and the weight copies a precision keeps for backward. None for compiled runners (what
    AOTAutograd saves is not visible to saved-tensor hooks)."""
    if runner.compiled:
        return None
    saved = SavedTensors.beyond(runner.model.parameters())
    if runner.amp_state is not None:
        amp._STATE = runner.amp_state  # type: ignore[assignment]
    context = (torch.autocast(runner.device_type, dtype=runner.config.dtype) if runner.config.kind == "torch"
               else contextlib.nullcontext())
    with saved.counting(), context:
        _loss(runner.model(runner.x), runner.y)
    return saved.total / 2**20


def is_slow(config: Config, device: str = "cpu") -> bool:
    """torch.autocast of a dtype this machine has no fast kernels for (the ~90x case)."""
    return config.kind == "torch" and hardware.half_arithmetic(device, config.dtype).emulated


@dataclass
class Result:
    ms: float | None
    steps: int
    batch: int
    bytes_per_param: float | None
    error: str = ""
    saved_mib: float | None = None
    faults: float | None = None  # median minor page faults per timed step (None: not measurable here)


def time_workload(
    workload: Workload, configs: list[Config], modes: tuple[bool, ...], steps: int, slow_steps: int,
    console: Console, gemm_rates: dict[torch.dtype, list[float]], device: str = "cpu",
) -> dict[tuple[str, bool], Result]:
    """Median step times, round-robin; each round also times one reference GEMM per MFU dtype of
    ``configs`` (:func:`mfu_dtype`) into ``gemm_rates``."""
    torch.manual_seed(0)
    state = workload.make().state_dict()
    runners: dict[tuple[str, bool], Runner] = {}
    results: dict[tuple[str, bool], Result] = {}
    for config in configs:
        for compiled in modes:
            key = (config.name, compiled)
            slow = is_slow(config, device)
            batch = workload.slow_batch_size if slow else workload.batch_size
            if compiled and slow:
                # Inductor calls the same slow half GEMM kernels: minutes of compile and steps to learn that
                results[key] = Result(None, 0, batch, None, "skipped: no fast kernels here (see eager)")
                continue
            try:
                runners[key] = make_runner(workload, config, compiled, state, batch, device)
            except Exception as err:  # noqa: BLE001 - a failing configuration is a result, not a crash
                results[key] = _failed(key, batch, err, console, device)
    times: dict[tuple[str, bool], list[float]] = {key: [] for key in runners}
    faults: dict[tuple[str, bool], list[int]] = {key: [] for key in runners}
    references = reference_dtypes(configs, device)
    for i in range(max(steps, slow_steps) + 2):  # the first steps warm up: allocation, compilation
        for dtype in references:
            gemm_rates.setdefault(dtype, []).append(reference_gemm(dtype, device, repeats=1))
        for key, runner in list(runners.items()):
            warmup = 2 if key[1] else 1
            if i >= warmup + (slow_steps if is_slow(runner.config, device) else steps):
                continue
            try:
                before = page_faults()
                seconds = runner.timed_step()
                faulted = page_faults() - before
            except Exception as err:  # noqa: BLE001
                results[key] = _failed(key, runner.x.shape[0], err, console, device)
                del runners[key]
                continue
            if i >= warmup:
                times[key].append(seconds)
                faults[key].append(faulted)
    for key, runner in runners.items():
        scale = workload.batch_size / runner.x.shape[0]  # slow configs: smaller batch, scaled linearly
        per_param = runner.bytes_per_param or footprint(runner.opt).per_param
        results[key] = Result(statistics.median(times[key]) * 1e3 * scale, len(times[key]),
                              runner.x.shape[0], per_param, saved_mib=saved_mib(runner),
                              faults=statistics.median(faults[key]) if HAS_RUSAGE else None)
    return results


def page_faults() -> int:
    """Minor page faults of this process so far. A step that faults (fresh pages for a large tensor: the
    heap could not reuse freed memory, e.g. fragmented by the other configurations' tensors) pays ~1 us
    per 4 KiB page: the column shows which rows carry that cost."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if HAS_RUSAGE else 0


MODE_NAMES = {False: "eager", True: "compiled"}  # a table's "mode" column


def _failed(
    key: tuple[str, bool], batch: int, err: Exception, console: Console, device: str = "cpu"
) -> Result:
    # A step that raised inside a region left it entered: leave it, so the next configuration runs clean.
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()
    torch.set_autocast_enabled(device, False)
    torch.set_autocast_dtype(device, _TOP_LEVEL_AUTOCAST_DTYPE[device])
    # torch clears its autocast cache when the last region leaves (nesting back to 0): a region left
    # entered kept it for good, and a later configuration's torch.autocast then reused weight casts made
    # before the optimizer changed the weights. Back to the top level's nesting of 0 (torch has no getter).
    level = torch.autocast_decrement_nesting()
    while level > 0:
        level = torch.autocast_decrement_nesting()
    if level < 0:  # it was 0 already
        torch.autocast_increment_nesting()
    torch.clear_autocast_cache()
    STATE.regions.clear()
    reason = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:80]}"
    console.print(f"  {key[0]}{' compiled' if key[1] else ''}: failed ({reason})")
    return Result(None, 0, batch, None, reason)


# ---- the table ------------------------------------------------------------------------------------------


def report(
    workload: Workload, results: dict[tuple[str, bool], Result], gemm_gflops: Mapping[torch.dtype, float],
    device: str = "cpu",
) -> Table:
    """The table; ``gemm_gflops`` holds the MFU reference rate of each dtype in :func:`mfu_dtype`."""
    table = Table(title=workload.name)
    for header in ("configuration", "mode", "ms/step", "vs fp32", "vs torch.autocast",
                   "tokens/s" if workload.tokens_per_sample > 1 else "samples/s",
                   "MFU", "MFU of", "bytes/param", "saved MiB", "faults/step", "steps", "note"):
        table.add_column(header, justify="left" if header in ("configuration", "mode", "note") else "right")
    torch_of = {c.dtype: c.name for c in CONFIGS if c.kind == "torch"}
    tokens = workload.batch_size * workload.tokens_per_sample
    order = {c.name: i for i, c in enumerate(CONFIGS)}
    for (name, compiled), r in sorted(results.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        mode = MODE_NAMES[compiled]
        if r.ms is None:
            outcome = "skipped" if r.error.startswith("skipped") else "failed"
            table.add_row(name, mode, outcome, *[""] * 9, r.error.removeprefix("skipped: "))
            continue
        config = next(c for c in CONFIGS if c.name == name)
        base = results.get(("fp32", compiled))
        ref = results.get((torch_of.get(config.dtype, ""), compiled))
        flops = workload.flops_per_token * tokens
        approx = "≈" if r.batch != workload.batch_size else ""
        reference = mfu_dtype(config, device)
        table.add_row(
            name, mode, f"{approx}{r.ms:.1f}",
            _ratio(r, base), _ratio(r, ref) if config.kind != "fp32" else "",
            f"{tokens / (r.ms / 1e3):,.0f}", f"{flops / (r.ms / 1e3) / (gemm_gflops[reference] * 1e9):.0%}",
            dtype_label(reference),
            f"{r.bytes_per_param:.1f}" if r.bytes_per_param else "",
            f"{r.saved_mib:.0f}" if r.saved_mib and not approx else "",  # weight copies do not scale
            "" if r.faults is None else f"{r.faults:,.0f}",
            str(r.steps),
            f"≈: timed at batch {r.batch}, scaled to {workload.batch_size}" if approx else "",
        )
    return table


def _ratio(r: Result, base: Result | None) -> str:
    return f"{r.ms / base.ms:.2f}x" if base is not None and base.ms and r.ms else "—"


# ---- where a step's time goes: the cast share ----------------------------------------------------------

# Ops that only change a tensor's dtype (self time, so nested calls are counted once): torch's casts, the
# emulation's input rounding, and the master-to-model copies of O2.
CAST_OPS = ("aten::to", "aten::_to_copy", "aten::copy_", "aten::_foreach_copy_")


def cast_share(workload: Workload, config_name: str, steps: int) -> tuple[float, float]:
    """(cast self time / step self time, ms per step) of one eager configuration, under torch.profiler."""
    config = next(c for c in CONFIGS if c.name == config_name)
    torch.manual_seed(0)
    runner = make_runner(workload, config, False, workload.make().state_dict(), workload.batch_size)
    runner.timed_step()  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.timed_step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    casts = sum(e.self_cpu_time_total for e in events if e.key in CAST_OPS)
    return casts / total, total / steps / 1e3


# ---- where a GPU step's time goes: the GEMMs' share ------------------------------------------------------

# cuBLAS / CUTLASS kernel names on Ampere and Hopper (cuBLAS 12-13 names Hopper's "nvjet_*"): the matrix
# multiplies torch.autocast and every mixprec configuration run alike, in bf16, on the tensor cores.
GEMM_KERNEL = re.compile(r"gemm|nvjet|cutlass|xmma|wgmma|matmul|cublas|sm90_|sm80_", re.IGNORECASE)


@dataclass
class KernelShare:
    """One configuration's GPU step: wall time, the GPU's busy time and its GEMMs' share of it."""

    step_ms: float  # synchronised wall time per step
    kernels_ms: float  # every kernel's GPU time per step
    gemm_ms: float  # the GEMM kernels' GPU time per step
    top: list[tuple[str, float]]  # the costliest kernels, (name, ms per step)

    @property
    def bound(self) -> float:
        """How many times faster the step could be if everything but its GEMMs took no time at all."""
        return self.step_ms / self.gemm_ms if self.gemm_ms else float("inf")


def kernel_share(runner: Runner, steps: int, warmup: int = 3) -> KernelShare:
    """The GPU kernels of ``steps`` steps of ``runner`` under torch.profiler (after ``warmup`` steps, which
    compile a compiled runner), summed per kernel name."""
    for _ in range(warmup):
        runner.timed_step()
    cuda = torch.profiler.ProfilerActivity.CUDA
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, cuda]) as prof:
        wall = sum(runner.timed_step() for _ in range(steps))
    per_kernel: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:  # a kernel (or memcpy/memset) on the GPU
            us = getattr(e, "self_device_time_total", None) or e.self_cuda_time_total
            per_kernel[e.key] = per_kernel.get(e.key, 0.0) + us / 1e3 / steps
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:8]
    gemm = sum(ms for name, ms in per_kernel.items() if GEMM_KERNEL.search(name))
    return KernelShare(wall * 1e3 / steps, sum(per_kernel.values()), gemm, top)


def phase_times(runner: Runner, steps: int, warmup: int = 2) -> dict[str, float]:
    """Median ms of each phase of ``runner``'s step (PHASES that its step marks), each timed from the end
    of the one before with the device synchronised at both ends (so on a GPU a phase's time is its own
    queueing plus its kernels, not the host running ahead), and "total". Where a step is host-bound, the
    phases that take longer than torch.autocast's are the host work a configuration adds."""
    times: dict[str, list[float]] = {}
    for i in range(warmup + steps):
        runner.activate()
        ends: list[tuple[str, float]] = []

        def mark(phase: str, ends: list[tuple[str, float]] = ends) -> None:
            hardware.synchronize(runner.device_type)
            ends.append((phase, time.perf_counter()))

        mark("start")
        runner.step(mark)
        if i < warmup:
            continue
        for (_, before), (phase, end) in zip(ends, ends[1:], strict=False):  # consecutive marks
            times.setdefault(phase, []).append(end - before)
        times.setdefault("total", []).append(ends[-1][1] - ends[0][1])
    return {phase: statistics.median(t) * 1e3 for phase, t in times.items()}


def host_syncs(runner: Runner, set_mode: Callable[[str], None] | None = None) -> list[str]:
    """Where one step (after :func:`phase_times`' warm-up) makes the host wait for the GPU: the warnings of
    torch's CUDA sync debug mode, each as "file:line: message". A step that never waits lets the host
    queue the next one while the GPU works; one that waits pays the GPU's time and its own in turn."""
    set_mode = set_mode or torch.cuda.set_sync_debug_mode
    runner.activate()
    hardware.synchronize(runner.device_type)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_mode("warn")
        try:
            runner.step()
        finally:
            set_mode("default")
    return [f"{Path(w.filename).name}:{w.lineno}: {str(w.message).strip().splitlines()[0]}" for w in caught]


def phases_table(workload: Workload, rows: dict[tuple[str, bool], dict[str, float] | str]) -> Table:
    """One row per (configuration, compiled): ms per phase, or the reason it failed."""
    table = Table(title=f"{workload.name}: ms per phase of a step, device synchronised between phases")
    for header in ("configuration", "mode", *PHASES, "total"):
        table.add_column(header, justify="left" if header in ("configuration", "mode") else "right")
    for (name, compiled), ms in rows.items():
        mode = MODE_NAMES[compiled]
        if isinstance(ms, str):  # the reason it failed, under "total"
            table.add_row(name, mode, *[""] * len(PHASES), ms)
            continue
        table.add_row(name, mode, *(f"{ms[p]:.2f}" if p in ms else "" for p in (*PHASES, "total")))
    return table


# ---- the MFU reference: the GEMM rate of the arithmetic a configuration computes in ----------------------


def mfu_dtype(config: Config, device: str = "cpu") -> torch.dtype:
    """The dtype whose GEMM rate a configuration's MFU is measured against: its half dtype where this
    machine runs that natively (bf16 on AMX: ~6x fp32's rate, so against fp32 such a step showed 200%),
    else fp32 (fp32 itself, and emulated half, which computes with fp32 kernels; torch.autocast of a dtype
    without fast kernels is held to what the machine could do, fp32's rate)."""
    if config.dtype in hardware.HALF_DTYPES and not hardware.half_arithmetic(device, config.dtype).emulated:
        return config.dtype
    return torch.float32


# Square GEMMs timed throughout the run. fp32: as large as the MLP's GEMMs, and at full rate at that size.
# Native half: 2048, since AMX bf16 reads ~1500 GFLOP/s at 1024^3 (too little work per call) but ~2500 at
# 2048^3 and at the GPT's and MLP's own shapes; a low reference would inflate every MFU against it.
# A GPU needs 8192^3 to reach its peak (an H100's bf16 tensor cores: ~800 TFLOP/s there, well under at 2048).
REFERENCE_SIZE: dict[str, dict[torch.dtype, int]] = {
    "cpu": {torch.float32: 1024, torch.float16: 2048, torch.bfloat16: 2048},
    "cuda": {torch.float32: 8192, torch.float16: 8192, torch.bfloat16: 8192},
}


def reference_dtypes(configs: list[Config], device: str = "cpu") -> tuple[torch.dtype, ...]:
    """The MFU references ``configs`` need, each once, in the configurations' order (a set's order varied
    from run to run in the printed reference lines)."""
    return tuple(dict.fromkeys(mfu_dtype(c, device) for c in configs))


def reference_gemm(dtype: torch.dtype, device: str = "cpu", repeats: int = 3) -> float:
    return hardware.gemm_gflops(device, dtype, REFERENCE_SIZE[device][dtype], repeats=repeats)


def measure_each(
    workload: Workload, names: list[str], modes: tuple[bool, ...], device: str,
    measure: Callable[[Runner], T],
) -> Iterator[tuple[tuple[str, bool], T | str]]:
    """``measure`` of each named configuration in each mode, one after another from one initial state:
    (key, its result), or (key, why there is none): skipped where it has no fast kernels here, as in the main
    table, or the error it raised, after leaving any region the failed step left entered (:func:`_failed`),
    so the next configuration runs clean."""
    torch.manual_seed(0)
    state = workload.make().state_dict()
    for config in (c for c in CONFIGS if c.name in names):
        for compiled in modes:
            key = (config.name, compiled)
            result: T | str = "skipped: no fast kernels here"
            if not is_slow(config, device):
                try:
                    runner = make_runner(workload, config, compiled, state, workload.batch_size, device)
                    result = measure(runner)
                except Exception as err:  # noqa: BLE001 - a failing configuration is a result, not a crash
                    result = _failed(key, workload.batch_size, err, Console(quiet=True), device).error
            yield key, result


def time_phases(
    workload: Workload, names: list[str], modes: tuple[bool, ...], steps: int, device: str = "cpu",
    syncs: dict[tuple[str, bool], list[str]] | None = None,
) -> dict[tuple[str, bool], dict[str, float] | str]:
    """:func:`phase_times` of each named configuration in each mode (:func:`measure_each`; not round-robin:
    a phase table compares phases within a step; the main table compares steps). With ``syncs`` (a GPU),
    also :func:`host_syncs` of each runner, into it."""
    def measure(runner: Runner) -> tuple[dict[str, float], list[str] | None]:
        return phase_times(runner, steps), (None if syncs is None else host_syncs(runner))

    rows: dict[tuple[str, bool], dict[str, float] | str] = {}
    for key, result in measure_each(workload, names, modes, device, measure):
        if isinstance(result, str):
            rows[key] = result
            continue
        rows[key], waits = result
        if syncs is not None and waits is not None:
            syncs[key] = waits
    return rows


def print_kernel_shares(workload: Workload, names: list[str], modes: tuple[bool, ...], steps: int,
                        device: str, console: Console) -> None:
    """:func:`kernel_share` of each named configuration in each mode (:func:`measure_each`)."""
    for (name, compiled), k in measure_each(workload, names, modes, device,
                                            lambda runner: kernel_share(runner, steps)):
        label = f"{workload.name}, {name} ({MODE_NAMES[compiled]})"
        if isinstance(k, str):
            console.print(f"{label}: {k}")
            continue
        console.print(f"{label}: step {k.step_ms:.2f} ms, GPU kernels {k.kernels_ms:.2f} ms, GEMMs "
                      f"{k.gemm_ms:.2f} ms ({k.gemm_ms / k.step_ms:.0%} of the step): at most "
                      f"{k.bound:.2f}x faster with everything else free")
        for kernel, ms in k.top:
            kind = "GEMM " if GEMM_KERNEL.search(kernel) else "     "
            console.print(f"    {ms:7.3f} ms  {kind}{kernel[:110]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="MLP only, eager, 2 steps: a smoke run")
    parser.add_argument("--no-compile", action="store_true", help="time eager configurations only")
    parser.add_argument("--compiled-only", action="store_true", help="time compiled configurations only")
    parser.add_argument("--config", action="append", default=None, choices=[c.name for c in CONFIGS],
                        help="time only these configurations (repeatable; default: all)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 3)")
    parser.add_argument("--workload", choices=list(WORKLOADS), action="append", default=None)
    parser.add_argument("--batch", type=int, default=None,
                        help="batch size for every workload timed (default: GPT 16, MLP 512). The MLP's "
                        "GEMMs run nearer the reference GEMM's rate at larger batches (RESULTS.md)")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's malloc as it is (default: mixprec.host_memory."
                        "keep_freed_memory(), for every configuration alike: no page faults per step)")
    parser.add_argument("--device", choices=list(REFERENCE_SIZE), default="cpu",
                        help="where the models run (cuda: the first GPU; every step is synchronised)")
    parser.add_argument("--profile", metavar="CONFIG", action="append", default=None,
                        help="instead of timing, print the cast share of a step of CONFIG (eager)")
    parser.add_argument("--sync-check", action="store_true",
                        help="with --phases on a GPU: also list where one step waits for the GPU (torch's "
                        "sync debug mode)")
    parser.add_argument("--kernels", metavar="CONFIG", action="append", default=None,
                        choices=[c.name for c in CONFIGS],
                        help="with --device cuda, instead of the table: CONFIG's GPU kernel time per step, "
                        "its GEMMs' share, and how much faster the step could be if all else were free")
    parser.add_argument("--phases", metavar="CONFIG", action="append", default=None,
                        choices=[c.name for c in CONFIGS],
                        help="instead of the table, time each phase of CONFIG's step (forward, backward, "
                        "scale_loss's unscale, step; repeatable; eager and compiled as the modes say)")
    args = parser.parse_args(argv)
    device = args.device
    if args.profile and device != "cpu":
        raise SystemExit("--profile measures the CPU time of casts: leave --device out with it.")
    if args.kernels and device != "cuda":
        raise SystemExit("--kernels times GPU kernels: use it with --device cuda.")
    if args.phases and (args.profile or args.config):
        raise SystemExit("--phases names the configurations it times: leave --profile and --config out.")
    if args.sync_check and not (args.phases and device == "cuda"):
        raise SystemExit("--sync-check lists where the host waits for a GPU: use it with --phases and "
                         "--device cuda.")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is "
                         "False): run on a machine with a GPU and CUDA torch, or leave --device out.")
    # 3 on a CPU: the GPT's fp32 step takes seconds on 2 cores. A GPU step takes milliseconds: 30.
    steps = args.steps or (2 if args.quick else 3 if device == "cpu" else 30)
    slow_steps = 1  # ~90x configurations: one timed step after the warm-up
    names = args.workload or (["mlp"] if args.quick else list(DEFAULT_WORKLOADS))
    modes = (False,) if args.no_compile or args.quick else (True,) if args.compiled_only else (False, True)
    configs = [c for c in CONFIGS if args.config is None or c.name in args.config]
    console = Console(width=max(Console().width, 180))
    console.print(f"hardware: {hardware.hardware_line()}")
    console.print(hardware.load_line())
    malloc = MallocTuning(False, "default glibc malloc (--default-malloc)") if args.default_malloc else (
        keep_freed_memory())
    console.print(f"host allocator: {malloc.reason}")
    for dtype in hardware.HALF_DTYPES:
        d = hardware.half_arithmetic(device, dtype)
        console.print(f"  {dtype}: {d.arithmetic.value} ({d.decided_by.value}: {d.reason})")
    instead_of_table = args.phases or args.profile or args.kernels
    references = () if instead_of_table else reference_dtypes(configs, device)  # MFU: the table only
    gemm_rates = {dtype: [reference_gemm(dtype, device)] for dtype in references}
    console.print(f"{steps} steps per config ({slow_steps} for those without fast kernels here)")
    for name in names:
        workload = WORKLOADS[name] if args.batch is None else with_batch(WORKLOADS[name], args.batch)
        for config_name in args.profile or ():
            share, ms = cast_share(workload, config_name, steps)
            console.print(f"{workload.name}, {config_name}: casts {share:.1%} of a {ms:.0f} ms step")
        if args.profile:
            continue
        if args.kernels:
            print_kernel_shares(workload, args.kernels, modes, steps, device, console)
            continue
        if args.phases:
            syncs: dict[tuple[str, bool], list[str]] | None = {} if args.sync_check else None
            console.print(phases_table(workload, time_phases(workload, args.phases, modes, steps, device,
                                                             syncs)))
            for (name, compiled), where in (syncs or {}).items():
                mode = MODE_NAMES[compiled]
                console.print(f"host waits in one step of {name} ({mode}): {len(where) or 'none'}")
                for line in where:
                    console.print(f"  {line}")
            continue
        console.print(f"timing {workload.name} ...")
        results = time_workload(workload, configs, modes, steps, slow_steps, console, gemm_rates, device)
        # The machine's best GEMM rate per dtype seen in this run (once at start, once per round): a single
        # timing under a passing load reads low and inflates every MFU.
        gflops = {dtype: max(rates) for dtype, rates in gemm_rates.items()}
        for dtype, rates in gemm_rates.items():
            label, n = dtype_label(dtype), REFERENCE_SIZE[device][dtype]
            console.print(f"{label} GEMM {n}^3: {gflops[dtype]:.1f} GFLOP/s, best of {len(rates)} "
                          f"(median {statistics.median(rates):.1f}): the MFU reference of {label}")
        console.print(report(workload, results, gflops, device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
