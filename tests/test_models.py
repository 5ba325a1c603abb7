from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import data as D
from mixprec import models as M

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]
HALF_DTYPES = [torch.float16, torch.bfloat16]


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def digits() -> D.DataBunch:
    return D.digits(batch_size=32)


# ---------------------------------------------------------------------------------------------------- mlp


def test_mlp_parameter_count_and_layers() -> None:
    with torch.device("meta"):
        model = M.mlp()
    # Linear(784, 8192) + Linear(8192, 10), weights and biases
    expected = 784 * 8192 + 8192 + 8192 * 10 + 10
    assert n_params(model) == expected == 6_512_650
    assert [type(m) for m in model] == [nn.Flatten, nn.Linear, nn.ReLU, nn.Linear]
    assert (model[1].in_features, model[1].out_features, model[3].out_features) == (784, 8192, 10)


def test_mlp_trains_on_digits_fp32(digits: D.DataBunch) -> None:
    torch.manual_seed(0)
    model = M.build("mlp", digits)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        for xb, yb in digits.train:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
    with torch.no_grad():
        correct = sum(int((model(xb).argmax(1) == yb).sum()) for xb, yb in digits.valid)
    assert correct / len(digits.valid.dataset) >= 0.9


# --------------------------------------------------------------------------------------------- simple_cnn


@pytest.mark.parametrize("hw", [8, 28, 33])
def test_simple_cnn_output_shape(hw: int) -> None:
    model = M.simple_cnn((3, 16, 16, 2))
    assert model(torch.randn(5, 3, hw, hw)).shape == (5, 2)


def test_simple_cnn_structure() -> None:
    model = M.simple_cnn((1, 8, 16, 32, 10), kernel_szs=(5, 3, 3, 3), strides=(1, 2, 2, 2))
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.in_channels, c.out_channels) for c in convs] == [(1, 8), (8, 16), (16, 32), (32, 10)]
    assert [c.kernel_size for c in convs] == [(5, 5), (3, 3), (3, 3), (3, 3)]
    assert [c.stride for c in convs] == [(1, 1), (2, 2), (2, 2), (2, 2)]
    assert [c.padding for c in convs] == [(2, 2), (1, 1), (1, 1), (1, 1)]
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 3
    assert sum(isinstance(m, nn.ReLU) for m in model.modules()) == 3
    last_block = model[3]
    assert len(last_block) == 1 and isinstance(last_block[0], nn.Conv2d)  # logits: no BN, no ReLU
    assert isinstance(model[-2], nn.AdaptiveAvgPool2d) and isinstance(model[-1], nn.Flatten)


def test_simple_cnn_without_bn() -> None:
    model = M.simple_cnn(bn=False)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert all(c.bias is not None for c in model.modules() if isinstance(c, nn.Conv2d))


def test_simple_cnn_rejects_mismatched_lists() -> None:
    with pytest.raises(ValueError, match="kernel sizes"):
        M.simple_cnn((3, 16, 2), kernel_szs=(3,))


# -------------------------------------------------------------------------------------------------- vgg16


def test_vgg16_parameter_count_matches_torchvision() -> None:
    with torch.device("meta"):
        model = M.vgg16()
        model_bn = M.vgg16(batch_norm=True)
    # torchvision.models.vgg16 / vgg16_bn: 138,357,544 and 138,365,992 parameters
    assert n_params(model) == 138_357_544
    assert n_params(model_bn) == 138_365_992
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    pools = [m for m in model.modules() if isinstance(m, nn.MaxPool2d)]
    assert len(convs) == 13 and len(pools) == 5
    linears = [m for m in model.classifier if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(25088, 4096), (4096, 4096), (4096, 1000)]


@pytest.mark.parametrize("hw", [32, 224])
def test_vgg16_forward_shape(hw: int) -> None:
    # On the meta device shapes propagate through every layer at no cost (no memory, no arithmetic).
    with torch.device("meta"):
        model = M.vgg16(num_classes=10, in_channels=1)
        out = model(torch.empty(2, 1, hw, hw))
    assert out.shape == (2, 10)


# -------------------------------------------------------------------------------------------- transformer


def test_transformer_on_tokens() -> None:
    model = M.tiny_transformer(vocab_size=50, seq_len=12, n_classes=3)
    tokens = torch.randint(0, 50, (4, 12))
    assert model(tokens).shape == (4, 3)
    assert model(tokens[:, :7]).shape == (4, 3)  # shorter sequences use the first positions
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.randint(0, 50, (4, 13)))


def test_transformer_on_images_and_flattened_images() -> None:
    model = M.tiny_transformer(image_shape=(3, 8, 8), n_classes=10).eval()
    x = torch.randn(4, 3, 8, 8)
    out = model(x)
    assert out.shape == (4, 10)
    torch.testing.assert_close(model(x.flatten(1)), out)


def test_transformer_row_tokens() -> None:
    embed = M.RowEmbedding((2, 3, 4), d_model=5)
    x = torch.randn(1, 2, 3, 4)
    tokens = embed(x)
    assert tokens.shape == (1, 3, 5)
    # token r is the r-th row of every channel, concatenated: channel 0's row, then channel 1's
    row1 = torch.cat([x[0, 0, 1], x[0, 1, 1]])
    torch.testing.assert_close(tokens[0, 1], embed.linear(row1))


def test_transformer_is_pre_norm() -> None:
    model = M.tiny_transformer(image_shape=(1, 8, 8), n_layers=2)
    calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    names = {m: n for n, m in model.named_modules()}

    def record(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        calls.append((names[module], args[0], output))

    for block in model.blocks:
        for sub in (block.ln1, block.attn, block.ln2, block.mlp):
            sub.register_forward_hook(record)
    model(torch.randn(2, 1, 8, 8))
    order = [name.split(".")[-1] for name, _, _ in calls]
    assert order == ["ln1", "attn", "ln2", "mlp"] * 2
    for i in range(0, len(calls), 2):  # each sublayer's input is the LayerNorm output just before it
        assert calls[i + 1][1] is calls[i][2]
    assert sum(isinstance(m, nn.LayerNorm) for m in model.modules()) == 2 * 2 + 1


def test_transformer_attention_matches_torch_mha() -> None:
    torch.manual_seed(0)
    ours = M.SelfAttention(16, n_heads=4)
    ref = nn.MultiheadAttention(16, 4, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(ours.qkv.weight)
        ref.in_proj_bias.copy_(ours.qkv.bias)
        ref.out_proj.weight.copy_(ours.proj.weight)
        ref.out_proj.bias.copy_(ours.proj.bias)
    x = torch.randn(3, 5, 16)
    expected, _ = ref(x, x, x, need_weights=False)
    torch.testing.assert_close(ours(x), expected)


@pytest.mark.parametrize(
    "kwargs", [{}, {"vocab_size": 10, "image_shape": (1, 8, 8)}, {"vocab_size": 10}, {"image_shape": (8, 8)}]
)
def test_transformer_rejects_ambiguous_input_kind(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        M.tiny_transformer(**kwargs)


# -------------------------------------------------------------------------------- half precision forward


def _small_models() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    return {
        "mlp": (M.mlp(64, 32, 10), torch.randn(4, 1, 8, 8)),
        "cnn": (M.simple_cnn((1, 8, 16, 10)), torch.randn(4, 1, 8, 8)),
        "transformer": (M.tiny_transformer(image_shape=(1, 8, 8), d_model=32), torch.randn(4, 1, 8, 8)),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_models_run_in_half_precision(name: str, dtype: torch.dtype, device: str) -> None:
    torch.manual_seed(0)
    model, x = _small_models()[name]
    model = model.to(device).eval()
    x = x.to(device)
    reference = model(x)
    out = model.to(dtype)(x.to(dtype))
    assert out.dtype == dtype and out.shape == reference.shape
    # a few roundings of 8-bit (bf16) or 11-bit (fp16) mantissas: compare at that precision, not fp32's
    tol = 0.1 if dtype == torch.bfloat16 else 0.02
    torch.testing.assert_close(out.float(), reference, atol=tol, rtol=tol)


# -------------------------------------------------------------------------------------------------- build


def test_build_sizes_models_for_the_data(digits: D.DataBunch) -> None:
    xb, _ = digits.one_batch("valid")
    for name in ("mlp", "cnn", "transformer"):
        model = M.build(name, digits)
        assert model(xb).shape == (len(xb), 10), name
    assert M.build("mlp", digits)[1].in_features == 64


def test_build_mlp_for_flattened_28x28() -> None:
    data = D.digits(size=28, flatten=True)
    with torch.device("meta"):
        model = M.build("mlp", data)
    assert n_params(model) == n_params(M.mlp(784, 8192, 10))
    assert model[1].in_features == 784


def test_build_keywords_override_the_data(digits: D.DataBunch) -> None:
    model = M.build("mlp", digits, n_hidden=16, n_out=3)
    assert model[1].out_features == 16 and model[3].out_features == 3
    cnn = M.build("cnn", digits, actns=(1, 4, 10))
    assert cnn(digits.one_batch()[0]).shape[1] == 10


def test_build_vgg16_from_data() -> None:
    data = D.synthetic(n=8, input_shape=(3, 32, 32), n_classes=7, batch_size=2, valid_pct=0.25)
    with torch.device("meta"):
        model = M.build("vgg16", data)
        assert model(torch.empty(2, 3, 32, 32)).shape == (2, 7)
    with pytest.raises(ValueError, match="32x32"):
        M.build("vgg16", D.synthetic(n=8, input_shape=(1, 8, 8), valid_pct=0.25))


def test_build_without_data_uses_defaults() -> None:
    with torch.device("meta"):
        assert n_params(M.build("vgg16")) == 138_357_544
        assert n_params(M.build("mlp")) == 6_512_650
    assert M.build("transformer")(torch.randn(2, 1, 8, 8)).shape == (2, 10)


def test_build_image_models_reject_flat_data() -> None:
    data = D.synthetic(n=8, input_shape=(64,), valid_pct=0.25)
    for name in ("cnn", "vgg16", "transformer"):
        with pytest.raises(ValueError, match="flatten"):
            M.build(name, data)


def test_build_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown model 'resnet'") as info:
        M.build("resnet")
    for name in ("mlp", "cnn", "vgg16", "transformer"):
        assert name in str(info.value)
