from __future__ import annotations

import dataclasses
import gzip
import math
import socket
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mixprec import data as D

# ------------------------------------------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def sk_digits():
    from sklearn.datasets import load_digits

    return load_digits()


def test_digits_needs_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("digits() tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    db = D.digits()
    assert db.name == "digits" and db.n_classes == 10


def test_digits_split_partitions_all_samples(sk_digits) -> None:
    db = D.digits(valid_pct=0.2)
    n_train, n_valid = len(db.train.dataset), len(db.valid.dataset)
    assert n_train + n_valid == len(sk_digits.target) == 1797
    assert n_valid == round(0.2 * 1797)
    train_idx, valid_idx = D.split_indices(1797, 0.2, seed=0)
    assert sorted(torch.cat([train_idx, valid_idx]).tolist()) == list(range(1797))


def test_digits_values_are_sklearn_images_normalised(sk_digits) -> None:
    db = D.digits(seed=3)
    assert db.normalization is not None
    mean, std = db.normalization
    train_idx, valid_idx = D.split_indices(1797, 0.2, seed=3)
    for loader, idx in ((db.train, train_idx), (db.valid, valid_idx)):
        x, y = loader.dataset.tensors
        expected = torch.as_tensor(sk_digits.images[idx.numpy()], dtype=torch.float32).unsqueeze(1) / 16
        torch.testing.assert_close(x * std + mean, expected, atol=1e-5, rtol=0)
        assert y.tolist() == sk_digits.target[idx.numpy()].tolist()
    x_train = db.train.dataset.tensors[0]
    assert abs(x_train.mean().item()) < 1e-5 and abs(x_train.std().item() - 1) < 1e-5


@pytest.mark.parametrize(
    ("kwargs", "shape"),
    [
        ({}, (1, 8, 8)),
        ({"size": 28}, (1, 28, 28)),
        ({"size": 28, "flatten": True}, (784,)),
        ({"size": 224, "channels": 3}, (3, 224, 224)),
    ],
)
def test_digits_shapes(kwargs: dict, shape: tuple[int, ...]) -> None:
    db = D.digits(batch_size=16, **kwargs)
    assert db.input_shape == shape
    for split in ("train", "valid"):
        xb, yb = db.one_batch(split)
        assert xb.shape == (16, *shape) and xb.dtype == torch.float32
        assert yb.shape == (16,) and yb.dtype == torch.int64


def test_digits_resize_is_bilinear_interpolate_of_the_8x8_images() -> None:
    small = D.digits(normalize=False).valid.dataset.tensors[0]
    big = D.digits(normalize=False, size=28).valid.dataset.tensors[0]
    reference = F.interpolate(small, size=(28, 28), mode="bilinear", align_corners=False)
    torch.testing.assert_close(big, reference)
    assert 0.0 <= big.min() and big.max() <= 1.0


def test_digits_channels_repeat_the_grey_image() -> None:
    xb, _ = D.digits(channels=3, batch_size=8).one_batch("valid")
    assert xb.is_contiguous()
    torch.testing.assert_close(xb[:, 0], xb[:, 1], rtol=0, atol=0)
    torch.testing.assert_close(xb[:, 0], xb[:, 2], rtol=0, atol=0)


def test_lazy_resize_matches_materialised(monkeypatch: pytest.MonkeyPatch) -> None:
    eager = D.digits(size=20, channels=3, batch_size=32)
    monkeypatch.setattr(D, "_MATERIALIZE_LIMIT_BYTES", 0)
    lazy = D.digits(size=20, channels=3, batch_size=32)
    assert lazy.valid.dataset.tensors[0].shape[-1] == 8  # stored small, resized per batch
    assert lazy.input_shape == eager.input_shape
    for (xa, ya), (xb, yb) in zip(eager.valid, lazy.valid, strict=True):
        torch.testing.assert_close(xa, xb)
        assert torch.equal(ya, yb)


def test_digits_is_deterministic_by_seed() -> None:
    a, b, c = D.digits(seed=0), D.digits(seed=0), D.digits(seed=1)
    for (xa, ya), (xb, yb) in zip(a.train, b.train, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.valid.dataset.tensors[1], c.valid.dataset.tensors[1])


@pytest.mark.parametrize(
    "kwargs", [{"valid_pct": 0.0}, {"valid_pct": 1.0}, {"batch_size": 0}, {"size": 0}, {"channels": 0}]
)
def test_digits_rejects_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        D.digits(**kwargs)


def test_databunch_is_frozen() -> None:
    db = D.synthetic(n=64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        db.n_classes = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="split"):
        db.one_batch("test")


# ---------------------------------------------------------------------------------------------------- IDX

# numpy dtype -> IDX type code, from the format description on the MNIST page (independent of D._IDX_DTYPES)
IDX_CODES = {"u1": 0x08, "i1": 0x09, "i2": 0x0B, "i4": 0x0C, "f4": 0x0D, "f8": 0x0E}


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> Path:
    code = IDX_CODES[array.dtype.str[1:]]
    header = struct.pack(">BBBB", 0, 0, code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)
    return path


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("dtype", list(IDX_CODES))
def test_read_idx_round_trips(tmp_path: Path, dtype: str, gz: bool) -> None:
    # negative values (signed types) and fractions (float types) check byte order and sign handling
    offset = 0 if dtype == "u1" else 30
    scale = 1.5 if dtype.startswith("f") else 1
    array = ((np.arange(60).reshape(3, 4, 5) - offset) * scale).astype(dtype)
    path = write_idx(tmp_path / "a-idx3-ubyte", array, gz=gz)
    out = D.read_idx(path)
    assert out.shape == array.shape and out.dtype == np.dtype(dtype).newbyteorder("=")
    np.testing.assert_array_equal(out, array)


def test_read_idx_one_dimensional(tmp_path: Path) -> None:
    labels = np.arange(10, dtype=np.uint8)
    np.testing.assert_array_equal(D.read_idx(write_idx(tmp_path / "l", labels)), labels)


def test_read_idx_wrong_magic(tmp_path: Path) -> None:
    path = tmp_path / "bad"
    path.write_bytes(b"<html>not found</html>")
    with pytest.raises(D.IDXFormatError, match="magic number"):
        D.read_idx(path)


def test_read_idx_unknown_type_code(tmp_path: Path) -> None:
    path = tmp_path / "bad"
    path.write_bytes(struct.pack(">BBBBI", 0, 0, 0x07, 1, 2) + b"\0\0")
    with pytest.raises(D.IDXFormatError, match="0x07"):
        D.read_idx(path)


def test_read_idx_truncated(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "t", np.zeros((4, 3), dtype=np.uint8))
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(D.IDXFormatError, match="truncated"):
        D.read_idx(path)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_read_idx_damaged_gzip_names_the_file(tmp_path: Path, damage: str) -> None:
    """A cut download or a corrupt .gz gave gzip's EOFError/BadGzipFile with a traceback."""
    path = write_idx(tmp_path / "t-idx2-ubyte", np.zeros((40, 30), dtype=np.uint8), gz=True)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2] if damage == "truncated" else whole[:4] + b"garbage")
    with pytest.raises(D.IDXFormatError, match="not a valid gzip file") as info:
        D.read_idx(path)
    assert str(path) in str(info.value) and "Download it again" in str(info.value)


# -------------------------------------------------------------------------------------------------- MNIST


def fake_mnist(folder: Path, n_train: int = 12, n_valid: int = 6, gz: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_valid, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_valid, dtype=np.uint8),
    }
    for name, array in arrays.items():
        write_idx(folder / name, array, gz=gz)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_reads_the_four_files(tmp_path: Path, gz: bool) -> None:
    arrays = fake_mnist(tmp_path, gz=gz)
    db = D.mnist(tmp_path, batch_size=4, normalize=False)
    assert db.input_shape == (1, 28, 28) and db.n_classes == 10 and db.name == "mnist"
    x_train, y_train = db.train.dataset.tensors
    x_valid, y_valid = db.valid.dataset.tensors
    np.testing.assert_allclose(x_train[:, 0].numpy(), arrays["train-images-idx3-ubyte"] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(y_train.numpy(), arrays["train-labels-idx1-ubyte"])
    np.testing.assert_allclose(x_valid[:, 0].numpy(), arrays["t10k-images-idx3-ubyte"] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(y_valid.numpy(), arrays["t10k-labels-idx1-ubyte"])


def test_mnist_options(tmp_path: Path) -> None:
    fake_mnist(tmp_path)
    db = D.mnist(tmp_path, batch_size=4, n_train=8, n_valid=5, flatten=True)
    assert len(db.train.dataset) == 8 and len(db.valid.dataset) == 5
    assert db.input_shape == (784,)
    assert db.one_batch()[0].shape == (4, 784)


def test_mnist_missing_files_error_names_all_four(tmp_path: Path) -> None:
    with pytest.raises(D.DatasetNotFoundError) as info:
        D.mnist(tmp_path)
    message = str(info.value)
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        assert name in message
    assert str(tmp_path.resolve()) in message
    assert D.MNIST_URL in message
    assert isinstance(info.value, FileNotFoundError)


def test_mnist_one_missing_file_is_named(tmp_path: Path) -> None:
    fake_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(D.DatasetNotFoundError, match="missing: t10k-labels-idx1-ubyte"):
        D.mnist(tmp_path)


def test_mnist_mismatched_counts(tmp_path: Path) -> None:
    fake_mnist(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(3, dtype=np.uint8))
    with pytest.raises(D.IDXFormatError, match="belong together"):
        D.mnist(tmp_path)


def test_mnist_swapped_files_are_named_as_swapped(tmp_path: Path) -> None:
    """A user trial: an images file under the labels name gave "header says shape (600, 134612226, ...)"."""
    arrays = fake_mnist(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte", arrays["train-images-idx3-ubyte"])
    with pytest.raises(D.IDXFormatError, match=r"(?s)train-labels-idx1-ubyte is an images file \(idx3\).*"
                                               r"a labels file \(idx1\) is expected.*swapped"):
        D.mnist(tmp_path)


@pytest.mark.parametrize("bad", [10, 250])
def test_mnist_labels_outside_the_ten_digits_name_the_file_and_value(tmp_path: Path, bad: int) -> None:
    """They reached cross_entropy, which raised "Target 250 is out of bounds" in the middle of training."""
    fake_mnist(tmp_path)
    labels = np.array([3, 1, bad, 9, bad, 0, 2, 2, 5, 6, 7, 8], dtype=np.uint8)
    path = write_idx(tmp_path / "train-labels-idx1-ubyte", labels)
    with pytest.raises(D.IDXFormatError) as info:
        D.mnist(tmp_path, n_train=2)  # checked on the whole file, not only the samples kept
    assert f"{path}: label {bad} at index 2 is outside 0..9 (2 of 12 labels are)" in str(info.value)


# ---------------------------------------------------------------------------------------------- synthetic


def test_synthetic_is_deterministic_by_seed() -> None:
    a, b, c = D.synthetic(seed=5), D.synthetic(seed=5), D.synthetic(seed=6)
    for ta, tb in zip(a.train.dataset.tensors, b.train.dataset.tensors, strict=True):
        assert torch.equal(ta, tb)
    assert not torch.equal(a.train.dataset.tensors[0], c.train.dataset.tensors[0])
    for (xa, ya), (xb, yb) in zip(a.train, b.train, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_synthetic_shapes() -> None:
    db = D.synthetic(n=100, input_shape=(1, 8, 8), n_classes=4, batch_size=10, valid_pct=0.3)
    assert db.input_shape == (1, 8, 8) and db.n_classes == 4
    assert len(db.train.dataset) == 70 and len(db.valid.dataset) == 30
    xb, yb = db.one_batch()
    assert xb.shape == (10, 1, 8, 8) and int(yb.max()) < 4


def test_synthetic_is_learnable_by_a_linear_model() -> None:
    torch.manual_seed(0)
    db = D.synthetic(n=1024, input_shape=(16,), n_classes=4)
    x, y = db.train.dataset.tensors
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(300):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    xv, yv = db.valid.dataset.tensors
    assert (model(xv).argmax(1) == yv).float().mean() >= 0.9


def test_a_model_that_is_not_a_classifier_gets_n_classes_none() -> None:
    """A diffusion model's data (noisy images in, noise out) had to name a dummy n_classes >= 2."""
    import mixprec

    g = torch.Generator().manual_seed(0)
    x, noise = torch.randn(32, 4, generator=g), torch.randn(32, 4, generator=g)
    loader = DataLoader(TensorDataset(x, noise), batch_size=8)
    data = D.DataBunch(loader, loader, None, (4,), "noise")
    learn = mixprec.Learner(data, nn.Linear(4, 4), loss_func=F.mse_loss, silent=True).to_bf16()
    learn.fit(1)
    assert all(math.isfinite(v) for v in learn.recorder.losses)
    with pytest.raises(ValueError, match="or None for a model that is not a classifier"):
        D.DataBunch(loader, loader, 1, (4,), "noise")
