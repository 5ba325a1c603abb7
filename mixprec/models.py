"""Reference models for the experiments, written in plain PyTorch (no torchvision dependency).

- :func:`mlp` -- the 2-layer MLP of the fp16-from-scratch write-up, 784-8192-10 (6,512,650 parameters).
- :func:`simple_cnn` -- fastai's ``simple_cnn``: stride-2 conv blocks, global average pool.
- :func:`vgg16` -- torchvision's VGG16 (configuration "D"), 138,357,544 parameters at 1000 classes.
- :func:`tiny_transformer` -- a small pre-norm transformer encoder classifier for tokens or image rows.

:func:`build` makes any of them by name, sized for a :class:`~mixprec.data.DataBunch`.

ReLUs are not in-place anywhere: in-place activations would overwrite the output that forward hooks
(the overflow tracer, the memory breakdown) see for the layer before them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixprec.data import DataBunch

__all__ = [
    "MODELS",
    "VGG16_CONFIG",
    "RowEmbedding",
    "SelfAttention",
    "TinyTransformer",
    "TransformerBlock",
    "build",
    "mlp",
    "simple_cnn",
    "tiny_transformer",
    "vgg16",
]


# ---------------------------------------------------------------------------------------------------------
# MLP
# ---------------------------------------------------------------------------------------------------------


def mlp(n_in: int = 784, n_hidden: int = 8192, n_out: int = 10) -> nn.Sequential:
    """Flatten -> Linear(n_in, n_hidden) -> ReLU -> Linear(n_hidden, n_out).

    The defaults are the fp16-from-scratch write-up's model: 784*8192 + 8192 + 8192*10 + 10 = 6,512,650
    parameters (26.05 MB in fp32). The hidden layer is wide on purpose: two large GEMMs dominate the step,
    which is where half precision pays off.
    """
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(n_in, n_hidden),
        nn.ReLU(),
        nn.Linear(n_hidden, n_out),
    )


# ---------------------------------------------------------------------------------------------------------
# simple_cnn
# ---------------------------------------------------------------------------------------------------------


def _conv_block(ni: int, nf: int, ks: int, stride: int, bn: bool, act: bool) -> nn.Sequential:
    # No conv bias before BatchNorm: BN's own shift makes it redundant (it would be subtracted right away).
    layers: list[nn.Module] = [nn.Conv2d(ni, nf, ks, stride=stride, padding=ks // 2, bias=not bn)]
    if bn:
        layers.append(nn.BatchNorm2d(nf))
    if act:
        layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def simple_cnn(
    actns: Sequence[int] = (3, 16, 16, 2),
    kernel_szs: Sequence[int] | None = None,
    strides: Sequence[int] | None = None,
    bn: bool = True,
) -> nn.Sequential:
    """fastai's ``simple_cnn``: ``len(actns) - 1`` conv blocks from ``actns[i]`` to ``actns[i+1]`` channels.

    Each block is Conv2d(kernel 3, stride 2, padding kernel//2) + BatchNorm (if ``bn``) + ReLU; the last block
    is a bare convolution whose channels are the class logits. Then AdaptiveAvgPool2d(1) + Flatten, so the
    output is (batch, actns[-1]) for any input size.
    """
    n = len(actns) - 1
    if n < 1:
        raise ValueError(
            f"actns needs at least 2 entries (in channels, ..., out channels), got {tuple(actns)}."
        )
    kernel_szs = tuple(kernel_szs) if kernel_szs is not None else (3,) * n
    strides = tuple(strides) if strides is not None else (2,) * n
    if len(kernel_szs) != n or len(strides) != n:
        raise ValueError(
            f"simple_cnn with {n} conv blocks needs {n} kernel sizes and strides, got {len(kernel_szs)} and "
            f"{len(strides)}: pass one per pair of consecutive actns."
        )
    blocks = [
        _conv_block(actns[i], actns[i + 1], kernel_szs[i], strides[i], bn=bn and i < n - 1, act=i < n - 1)
        for i in range(n)
    ]
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten())


# ---------------------------------------------------------------------------------------------------------
# VGG16
# ---------------------------------------------------------------------------------------------------------

# torchvision's configuration "D": output channels of each 3x3 conv, "M" = 2x2 max pool (stride 2).
VGG16_CONFIG: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
)


def _vgg_features(in_channels: int, batch_norm: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    channels = in_channels
    for v in VGG16_CONFIG:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            continue
        assert isinstance(v, int)
        layers.append(nn.Conv2d(channels, v, kernel_size=3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(v))
        layers.append(nn.ReLU())
        channels = v
    return nn.Sequential(*layers)


def _init_vgg(model: nn.Module) -> None:
    # The initialisation torchvision's VGG uses: He (fan_out) for convs, N(0, 0.01) for the classifier.
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.01)
            nn.init.zeros_(m.bias)


def vgg16(
    num_classes: int = 1000, in_channels: int = 3, batch_norm: bool = False, dropout: float = 0.5
) -> nn.Sequential:
    """VGG16 as in torchvision: 13 3x3 convs in 5 stages, AdaptiveAvgPool2d(7x7), a 3-layer classifier.

    With the defaults it has torchvision's ``vgg16`` parameter count, 138,357,544 (553 MB in fp32), 90% of it
    in the first classifier Linear(25088, 4096). Inputs need height and width >= 32 (five 2x2 pools).
    Children are ``features``, ``avgpool``, ``classifier`` (an ``nn.Sequential``, so ``model[-1]`` indexes
    the classifier and the model runs on a plain forward).
    """
    classifier = nn.Sequential(
        nn.Flatten(),
        nn.Linear(512 * 7 * 7, 4096),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(4096, 4096),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(4096, num_classes),
    )
    model = nn.Sequential()
    model.add_module("features", _vgg_features(in_channels, batch_norm))
    model.add_module("avgpool", nn.AdaptiveAvgPool2d((7, 7)))
    model.add_module("classifier", classifier)
    _init_vgg(model)
    return model


# ---------------------------------------------------------------------------------------------------------
# tiny transformer
# ---------------------------------------------------------------------------------------------------------


class SelfAttention(nn.Module):
    """Multi-head self-attention written out op by op, so a cast policy sees each matmul and the softmax."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads}).")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (d // self.n_heads) ** -0.5
        # Softmax exponentiates: in fp16 exp() overflows above 11.1, so a mixed precision policy runs this op
        # in fp32 (torch's F.softmax subtracts the row max first, which keeps the exponent <= 0).
        attn = self.dropout(F.softmax(scores, dim=-1))
        out = (attn @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(out)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``.

    Pre-norm (LayerNorm before each sublayer, identity residual path) trains stably without warm-up and
    keeps the residual stream free of normalisation, as in GPT-2 and ViT.
    """

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model),
            nn.GELU(),
            nn.Linear(mlp_ratio * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class RowEmbedding(nn.Module):
    """Image -> tokens: each of the H rows of a (C, H, W) image (all channels) is one token of C*W features.

    Accepts (B, C, H, W) or flattened (B, C*H*W) batches.
    """

    def __init__(self, image_shape: tuple[int, int, int], d_model: int) -> None:
        super().__init__()
        self.image_shape = image_shape
        c, _, w = image_shape
        self.linear = nn.Linear(c * w, d_model)

    def forward(self, x: Tensor) -> Tensor:
        c, h, w = self.image_shape
        if x[0].numel() != c * h * w:
            raise ValueError(
                f"RowEmbedding was built for images {self.image_shape}, got a batch {tuple(x.shape)}: "
                "build the model for this data set's input_shape."
            )
        rows = x.reshape(len(x), c, h, w).permute(0, 2, 1, 3).reshape(len(x), h, c * w)
        return self.linear(rows)


class TinyTransformer(nn.Module):
    """embed -> + learned positions -> pre-norm blocks -> LayerNorm -> mean over tokens -> Linear head."""

    def __init__(
        self,
        embed: nn.Module,
        seq_len: int,
        n_classes: int,
        d_model: int,
        n_heads: int,
        n_layers: int,
        mlp_ratio: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.embed = embed
        self.seq_len = seq_len
        self.pos = nn.Parameter(torch.empty(1, seq_len, d_model))
        # Small positional init (as in GPT-2/ViT) so positions start as a perturbation of the content.
        nn.init.normal_(self.pos, std=0.02)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(d_model, n_heads, mlp_ratio, dropout) for _ in range(n_layers)
        )
        self.ln_f = nn.LayerNorm(d_model)  # pre-norm leaves the last residual un-normalised: do it here
        self.head = nn.Linear(d_model, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        t = h.shape[1]
        if t > self.seq_len:
            raise ValueError(
                f"sequence of {t} tokens is longer than seq_len={self.seq_len}: build the model with a "
                "larger seq_len or truncate the inputs."
            )
        h = self.dropout(h + self.pos[:, :t])
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h).mean(dim=1))


def tiny_transformer(
    vocab_size: int | None = None,
    d_model: int = 64,
    n_heads: int = 4,
    n_layers: int = 2,
    seq_len: int | None = None,
    n_classes: int = 10,
    image_shape: tuple[int, int, int] | None = None,
    mlp_ratio: int = 4,
    dropout: float = 0.0,
) -> TinyTransformer:
    """A small pre-norm transformer encoder classifier, on token ids or on images.

    Exactly one input kind:

    - ``vocab_size=V, seq_len=T``: inputs are int64 token ids (B, t) with t <= T, embedded by nn.Embedding.
    - ``image_shape=(C, H, W)``: inputs are float images (B, C, H, W) (or flattened, (B, C*H*W)); each image
      row is a token (:class:`RowEmbedding`), so an 8x8 digit is 8 tokens of 8 features and a 28x28 MNIST
      digit 28 tokens of 28. ``seq_len`` defaults to H.
    """
    if (vocab_size is None) == (image_shape is None):
        raise ValueError(
            "tiny_transformer needs exactly one input kind: vocab_size=... (token ids) or "
            "image_shape=(C, H, W) (image rows as tokens)."
        )
    embed: nn.Module
    if image_shape is not None:
        if len(image_shape) != 3:
            raise ValueError(f"image_shape must be (C, H, W), got {tuple(image_shape)}.")
        image_shape = (int(image_shape[0]), int(image_shape[1]), int(image_shape[2]))
        seq_len = image_shape[1] if seq_len is None else seq_len
        embed = RowEmbedding(image_shape, d_model)
    else:
        assert vocab_size is not None
        if seq_len is None:
            raise ValueError("tiny_transformer on token ids needs seq_len (the longest input sequence).")
        embed = nn.Embedding(vocab_size, d_model)
    return TinyTransformer(embed, seq_len, n_classes, d_model, n_heads, n_layers, mlp_ratio, dropout)


# ---------------------------------------------------------------------------------------------------------
# build by name
# ---------------------------------------------------------------------------------------------------------


Shape = tuple[int, ...]


def _image_shape(name: str, shape: Shape) -> tuple[int, int, int]:
    if len(shape) != 3:
        raise ValueError(
            f"model {name!r} needs image inputs (C, H, W), but got samples of shape {shape}: "
            "build the data without flatten=True, or pass input_shape=(C, H, W)."
        )
    c, h, w = shape
    return c, h, w


def _build_mlp(shape: Shape | None, n_classes: int | None, kw: dict[str, Any]) -> nn.Module:
    if shape is not None:
        kw.setdefault("n_in", math.prod(shape))
    if n_classes is not None:
        kw.setdefault("n_out", n_classes)
    return mlp(**kw)


def _build_cnn(shape: Shape | None, n_classes: int | None, kw: dict[str, Any]) -> nn.Module:
    if shape is not None and "actns" not in kw:
        c, _, _ = _image_shape("cnn", shape)
        # Three stride-2 blocks take 8x8 digits to 1x1 and 28x28 to 4x4; channels double as resolution halves.
        kw["actns"] = (c, 16, 32, n_classes or 10)
    return simple_cnn(**kw)


def _build_vgg16(shape: Shape | None, n_classes: int | None, kw: dict[str, Any]) -> nn.Module:
    if shape is not None:
        c, h, w = _image_shape("vgg16", shape)
        if min(h, w) < 32:
            raise ValueError(
                f"vgg16 halves the image five times and needs at least 32x32 inputs, got {h}x{w}. "
                "Resize it: --size 32 (train, compare) or --input 3x32x32 (memory) on the command line, "
                "mixprec.data.digits(size=32, channels=3) in Python."
            )
        kw.setdefault("in_channels", c)
    if n_classes is not None:
        kw.setdefault("num_classes", n_classes)
    return vgg16(**kw)


def _build_transformer(shape: Shape | None, n_classes: int | None, kw: dict[str, Any]) -> nn.Module:
    if "vocab_size" not in kw:
        kw.setdefault("image_shape", _image_shape("transformer", shape) if shape else (1, 8, 8))  # 8x8 digits
    if n_classes is not None:
        kw.setdefault("n_classes", n_classes)
    return tiny_transformer(**kw)


# model name -> builder(input shape, classes, keyword overrides); shape and classes (when known) fill in the
# sizes the caller did not set.
MODELS: dict[str, Callable[[Shape | None, int | None, dict[str, Any]], nn.Module]] = {
    "mlp": _build_mlp,
    "cnn": _build_cnn,
    "vgg16": _build_vgg16,
    "transformer": _build_transformer,
}


def build(
    name: str,
    data: DataBunch | None = None,
    *,
    input_shape: Shape | None = None,
    n_classes: int | None = None,
    **kw: Any,
) -> nn.Module:
    """Make model ``name`` (one of :data:`MODELS`), sized for ``data`` (or for ``input_shape`` and
    ``n_classes``, the shape of one sample and the number of classes) when given.

    Other keyword arguments go to the model's constructor and win over what the sizes imply, e.g.
    ``build("mlp", data, n_hidden=1024)``.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names are: {', '.join(MODELS)}.")
    if data is not None:
        input_shape = input_shape or tuple(data.input_shape)
        n_classes = n_classes or data.n_classes
    return MODELS[name](input_shape, n_classes, dict(kw))
