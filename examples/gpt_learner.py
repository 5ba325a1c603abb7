"""Example: a GPT written in plain PyTorch (nanoGPT's shape), trained by mixprec's Learner in fp32 or fp16.

The model is what a user already has: ``forward(idx, targets)`` returns ``(logits, loss)``, the output layer
shares its weight with the token embedding (weight tying), and ``configure_optimizers`` builds AdamW with a
decay/no-decay split. Converting its training loop to the Learner takes these lines (see ``train``):

    learn = Learner(data, model, loss_func=None,      # None: the model returns (logits, loss)
                    opt_func=lambda params, lr: model.configure_optimizers(WEIGHT_DECAY, lr, BETAS))
    learn.to_fp16()                                   # or nothing, for fp32
    learn.fit(steps=steps, lr=LR, callbacks=[WarmupCosineScheduler(LR, WARMUP_STEPS),
                                             GradientClipping(GRAD_CLIP)])

The data is a synthetic language: token sequences drawn from a fixed random Markov chain whose next token
depends on the previous one, so a model that learns the chain's transition table reaches its entropy
(printed), well below the ``ln(vocab)`` of guessing.

Run:  python examples/gpt_learner.py --precision fp16 --steps 300
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mixprec import DataBunch, Learner
from mixprec.callbacks import GradientClipping, WarmupCosineScheduler

# nanoGPT's training settings, each with its reason:
LR = 3e-3  # small models take a larger rate than nanoGPT's 6e-4 for GPT-2 size
WARMUP_STEPS = 20  # Adam's moment estimates are noise in the first steps: ramp the rate up meanwhile
WEIGHT_DECAY = 0.1  # on matmul weights and embeddings only (decaying biases and LayerNorm gains does nothing)
BETAS = (0.9, 0.95)  # beta2 0.95: transformers' gradient scale drifts, a shorter memory follows it
GRAD_CLIP = 1.0  # loss spikes otherwise throw the weights far off in one step


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 32
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf")).softmax(dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        hidden = 4 * cfg.n_embd
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, hidden), nn.GELU(), nn.Linear(hidden, cfg.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying: one Parameter, two uses
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)  # GPT-2's initialisation
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def configure_optimizers(
        self, weight_decay: float, lr: float, betas: tuple[float, float]
    ) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]  # the tied weight once
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=betas)


def markov_language(
    cfg: GPTConfig, n_train: int = 512, n_valid: int = 128, batch_size: int = 32, seed: int = 0
) -> tuple[DataBunch, float]:
    """Sequences from a random Markov chain (each token allows ~4 likely successors); returns the data and
    the chain's entropy per token in nats: the loss a perfect model reaches."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(cfg.vocab_size, cfg.vocab_size, generator=gen)  # peaked rows
    probs = logits.softmax(dim=-1)
    n = n_train + n_valid
    tokens = torch.empty(n, cfg.block_size + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(cfg.vocab_size, (n,), generator=gen)
    for t in range(1, cfg.block_size + 1):
        tokens[:, t] = torch.multinomial(probs[tokens[:, t - 1]], 1, generator=gen).squeeze(1)
    x, y = tokens[:, :-1], tokens[:, 1:]
    shuffle = torch.Generator().manual_seed(seed)
    train = DataLoader(TensorDataset(x[:n_train], y[:n_train]), batch_size, shuffle=True, generator=shuffle)
    valid = DataLoader(TensorDataset(x[n_train:], y[n_train:]), batch_size)
    # The stationary distribution weights each row's entropy: the chain's entropy rate.
    stationary = torch.linalg.matrix_power(probs.double(), 256)[0]
    entropy = float(-(stationary[:, None] * probs.double() * probs.double().log()).sum())
    return DataBunch(train, valid, cfg.vocab_size, (cfg.block_size,), "markov"), entropy


def train(precision: str, steps: int, cfg: GPTConfig = GPTConfig(), seed: int = 0) -> Learner:
    """Train the GPT for ``steps`` steps in ``precision`` ("fp32" or "fp16"); returns the Learner."""
    data, _ = markov_language(cfg, seed=seed)
    torch.manual_seed(seed)
    model = GPT(cfg)
    learn = Learner(data, model, loss_func=None, silent=True,
                    opt_func=lambda params, lr: model.configure_optimizers(WEIGHT_DECAY, lr, BETAS))
    if precision == "fp16":
        learn.to_fp16()
    warmup = min(WARMUP_STEPS, steps // 2)  # a short run (a smoke test) still decays over its second half
    schedule, clip = WarmupCosineScheduler(LR, warmup), GradientClipping(GRAD_CLIP)
    learn.fit(steps=steps, lr=LR, callbacks=[schedule, clip])
    return learn


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=["fp32", "fp16"], default="fp16")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    cfg = GPTConfig()
    _, entropy = markov_language(cfg)
    learn = train(args.precision, args.steps, cfg)
    print(f"{args.precision}: valid loss {learn.valid_loss:.4f} after {args.steps} steps "
          f"(guessing: {math.log(cfg.vocab_size):.4f}, the chain's entropy: {entropy:.4f}); "
          f"skipped steps: {learn.recorder.skipped_steps}")


if __name__ == "__main__":
    main()
