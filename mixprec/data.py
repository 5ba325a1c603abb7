"""Data sets for the experiments, as in-memory tensors behind single-process DataLoaders.

Three sources, one result type (:class:`DataBunch`, fastai-like: ``Learner(data, model, ...)``):

- :func:`digits` -- scikit-learn's bundled handwritten digits (1797 8x8 grey images, no download), the
  default everywhere; optionally resized to MNIST's 1x28x28 or VGG16's 3x224x224.
- :func:`mnist` -- the four MNIST IDX files from a folder (raw or ``.gz``), read by :func:`read_idx`.
- :func:`synthetic` -- a learnable classification set labelled by a random linear teacher.

Every loader yields ``(x, y)`` with ``x`` float32 and ``y`` int64; mixed precision casts happen in the
model or under autocast, never in the data. All randomness (split, shuffling, synthetic data) comes from
generators seeded by ``seed``, so two calls with the same arguments give the same batches.
"""

from __future__ import annotations

import gzip
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from mixprec.errors import DatasetNotFoundError, IDXFormatError  # re-exported: they were defined here

__all__ = [
    "DataBunch",
    "DatasetNotFoundError",
    "IDXFormatError",
    "MNIST_FILES",
    "MNIST_URL",
    "digits",
    "mnist",
    "read_idx",
    "split_indices",
    "synthetic",
]

# Resized images are kept in memory when they fit under this; larger ones (digits at 3x224x224 is
# 1797*3*224*224*4 B = 1.08 GB, MNIST at that size 36 GB) are resized batch by batch as they are loaded.
_MATERIALIZE_LIMIT_BYTES = 256 * 2**20


@dataclass(frozen=True)
class DataBunch:
    """Train and validation loaders plus what a model builder needs to know about the inputs.

    ``input_shape`` is the shape of one sample exactly as the loaders yield it (``(C, H, W)`` for images,
    ``(C*H*W,)`` when flattened). ``normalization`` is the ``(mean, std)`` subtracted and divided out, or
    ``None`` when the values are raw.
    """

    train: DataLoader
    valid: DataLoader
    n_classes: int | None  # None: not a classifier (a diffusion model's noise, a regression)
    input_shape: tuple[int, ...]
    name: str
    normalization: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.n_classes is not None and self.n_classes < 2:
            raise ValueError(f"DataBunch needs n_classes >= 2 (or None for a model that is not a "
                             f"classifier), got {self.n_classes}.")
        if not self.input_shape or any(d < 1 for d in self.input_shape):
            raise ValueError(f"DataBunch input_shape must be non-empty and positive, got {self.input_shape}.")

    def one_batch(self, split: str = "train") -> tuple[Tensor, Tensor]:
        """The first batch of ``split`` ("train" or "valid"); advances the train shuffle generator."""
        loaders = {"train": self.train, "valid": self.valid}
        if split not in loaders:
            raise ValueError(f"split must be one of {sorted(loaders)}, got {split!r}.")
        xb, yb = next(iter(loaders[split]))
        return xb, yb


# ---------------------------------------------------------------------------------------------------------
# image preparation shared by digits and mnist
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ImageTransform:
    """Resize (bilinear), repeat grey to ``channels`` and optionally flatten a batch of (N, 1, H, W) images.

    Used on a whole data set when the result is small, else per batch as the loader's collate step; one
    function for both so the two paths cannot disagree.
    """

    size: int | None
    channels: int
    flatten: bool

    def __call__(self, x: Tensor) -> Tensor:
        if self.size is not None and x.shape[-2:] != (self.size, self.size):
            # align_corners=False is torch's default and keeps the image centred when upsampling 8 -> 28.
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False)
        if self.channels != 1:
            x = x.repeat(1, self.channels, 1, 1)  # a copy, not expand(): convolutions want contiguous input
        return x.flatten(1) if self.flatten else x

    def output_shape(self, image_hw: tuple[int, int]) -> tuple[int, ...]:
        h, w = (self.size, self.size) if self.size is not None else image_hw
        shape = (self.channels, h, w)
        return (math.prod(shape),) if self.flatten else shape


@dataclass(frozen=True)
class _TransformingCollate:
    """Collate a list of ``(x, y)`` samples into a batch and apply an image transform to ``x``."""

    transform: Callable[[Tensor], Tensor]

    def __call__(self, samples: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        x = torch.stack([s[0] for s in samples])
        y = torch.stack([s[1] for s in samples])
        return self.transform(x), y


def _check_image_options(size: int | None, channels: int) -> None:
    if size is not None and size < 1:
        raise ValueError(f"size must be a positive number of pixels or None (keep the original), got {size}.")
    if channels < 1:
        raise ValueError(f"channels must be >= 1 (1 = grey, 3 = grey repeated as RGB), got {channels}.")


def _loaders(
    train: tuple[Tensor, Tensor],
    valid: tuple[Tensor, Tensor],
    batch_size: int,
    seed: int,
    collate: Callable | None = None,
) -> tuple[DataLoader, DataLoader]:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    # A dedicated generator makes the shuffle order a function of `seed` alone, untouched by other code that
    # draws from torch's global RNG (model init, dropout). num_workers=0: the data is already in memory and
    # worker processes would only add start-up cost on a 2-core machine.
    shuffle_gen = torch.Generator().manual_seed(seed)
    train_dl = DataLoader(
        TensorDataset(*train), batch_size=batch_size, shuffle=True, generator=shuffle_gen,
        num_workers=0, collate_fn=collate,
    )
    valid_dl = DataLoader(
        TensorDataset(*valid), batch_size=batch_size, shuffle=False, num_workers=0, collate_fn=collate
    )
    return train_dl, valid_dl


def _image_bunch(
    train: tuple[Tensor, Tensor],
    valid: tuple[Tensor, Tensor],
    *,
    name: str,
    n_classes: int,
    batch_size: int,
    size: int | None,
    channels: int,
    flatten: bool,
    normalize: bool,
    seed: int,
) -> DataBunch:
    """Normalise (N, 1, H, W) float images with train statistics, resize/repeat/flatten, wrap in loaders."""
    _check_image_options(size, channels)
    (x_train, y_train), (x_valid, y_valid) = train, valid
    stats = None
    if normalize:
        # Statistics of the train split at the original resolution. Bilinear weights sum to 1, so resizing
        # commutes with this affine map: normalising first is the same as normalising the resized images
        # with these (not the resized images') statistics, and it is cheap at 8x8.
        mean, std = x_train.mean().item(), x_train.std().item()
        x_train, x_valid = (x_train - mean) / std, (x_valid - mean) / std
        stats = (mean, std)
    transform = _ImageTransform(size, channels, flatten)
    out_shape = transform.output_shape((x_train.shape[-2], x_train.shape[-1]))
    n_bytes = (len(x_train) + len(x_valid)) * math.prod(out_shape) * x_train.element_size()
    collate = None
    if n_bytes <= _MATERIALIZE_LIMIT_BYTES:
        x_train, x_valid = transform(x_train), transform(x_valid)
    else:
        collate = _TransformingCollate(transform)
    train_dl, valid_dl = _loaders((x_train, y_train), (x_valid, y_valid), batch_size, seed, collate)
    return DataBunch(train_dl, valid_dl, n_classes, out_shape, name, stats)


def split_indices(n: int, valid_pct: float, seed: int) -> tuple[Tensor, Tensor]:
    """A seeded random split of ``range(n)`` into (train, valid) index tensors; ``round(valid_pct*n)`` valid.

    The permutation comes from a generator seeded by ``seed`` alone, so the split is the same on every call.
    """
    if not 0.0 < valid_pct < 1.0:
        raise ValueError(f"valid_pct must be strictly between 0 and 1, got {valid_pct}.")
    n_valid = round(valid_pct * n)
    if not 0 < n_valid < n:
        raise ValueError(f"valid_pct={valid_pct} of {n} samples leaves an empty split; pick a larger set.")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm[n_valid:], perm[:n_valid]


# ---------------------------------------------------------------------------------------------------------
# digits
# ---------------------------------------------------------------------------------------------------------


def digits(
    batch_size: int = 64,
    valid_pct: float = 0.2,
    size: int | None = None,
    channels: int = 1,
    seed: int = 0,
    flatten: bool = False,
    normalize: bool = True,
) -> DataBunch:
    """scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes), split train/valid by ``seed``.

    ``size=None`` keeps 1x8x8; ``size=28`` gives 1x28x28 like MNIST (784 features flattened: the input of the
    784-8192-10 MLP); ``size=224, channels=3`` gives 3x224x224 as in the VGG16-on-MNIST experiment (resized
    batch by batch, since the whole set would take 1.08 GB). Resizing is bilinear; values are normalised with
    the mean and std of the train split unless ``normalize=False`` (then pixels are in [0, 1]).
    """
    from sklearn.datasets import load_digits  # local: scikit-learn is only needed for this data set

    bunch = load_digits()
    # Pixel values are integer ink counts 0..16; divide so un-normalised images lie in [0, 1] like MNIST's.
    images = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.as_tensor(bunch.target, dtype=torch.int64)
    train_idx, valid_idx = split_indices(len(labels), valid_pct, seed)
    return _image_bunch(
        (images[train_idx], labels[train_idx]),
        (images[valid_idx], labels[valid_idx]),
        name="digits", n_classes=10, batch_size=batch_size, size=size, channels=channels,
        flatten=flatten, normalize=normalize, seed=seed,
    )


# ---------------------------------------------------------------------------------------------------------
# MNIST from IDX files
# ---------------------------------------------------------------------------------------------------------

MNIST_URL = "https://yann.lecun.com/exdb/mnist/"
MNIST_CLASSES = 10  # the digits 0..9: every label must be one of them

# role -> file name as published on the MNIST page (each may also be gzipped, as it is published).
MNIST_FILES: dict[str, str] = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "valid_images": "t10k-images-idx3-ubyte",
    "valid_labels": "t10k-labels-idx1-ubyte",
}

# IDX type code (third byte of the magic number) -> big-endian numpy dtype of the data.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def _read_bytes(path: Path) -> bytes:
    # Decide by content, not by name: gzip files start with 1f 8b, IDX files with 00 00.
    raw = path.read_bytes()
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as err:  # truncated (EOFError), bad header/CRC, bad deflate data
        raise IDXFormatError(
            f"{path} is not a valid gzip file ({err}): it is truncated or corrupt. Download it again."
        ) from None


# What each IDX dimension count holds in MNIST: read_idx names it when a file has another than expected.
_IDX_KINDS = {1: "a labels file (idx1)", 3: "an images file (idx3)"}


def read_idx(path: str | Path, ndim: int | None = None) -> np.ndarray:
    """Read an IDX file (raw or gzipped) into a native-endian numpy array.

    Layout: a 4-byte magic number ``00 00 <type code> <ndim>``, then ``ndim`` big-endian uint32 dimension
    sizes, then the data, big-endian, in C order. Raises :class:`IDXFormatError` when the file is not that,
    or (``ndim`` given) when its magic number declares another number of dimensions.
    """
    path = Path(path)
    buf = _read_bytes(path)
    if len(buf) < 4 or buf[0] != 0 or buf[1] != 0:
        raise IDXFormatError(
            f"{path} is not an IDX file: its magic number starts {buf[:4].hex(' ') or '(empty)'}, expected "
            "00 00 <type> <ndim>. Check that it is an MNIST-style IDX file (raw or .gz), not a web page."
        )
    code, declared = buf[2], buf[3]
    if ndim is not None and declared != ndim:
        raise IDXFormatError(
            f"{path} is {_IDX_KINDS.get(declared, f'an IDX file of {declared} dimensions')} (its magic "
            f"number says {declared} dimensions), where {_IDX_KINDS.get(ndim, f'{ndim} dimensions')} is "
            "expected: check that the images and labels files are not swapped or renamed."
        )
    ndim = declared
    if code not in _IDX_DTYPES:
        known = ", ".join(f"0x{c:02X}" for c in _IDX_DTYPES)
        raise IDXFormatError(f"{path}: unknown IDX type code 0x{code:02X}; known codes are {known}.")
    header = 4 + 4 * ndim
    if len(buf) < header:
        raise IDXFormatError(
            f"{path}: truncated header: {ndim} dimensions need {header} bytes, the file has {len(buf)}. "
            "Download it again."
        )
    dims = tuple(int(d) for d in np.frombuffer(buf, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[code]
    expected = math.prod(dims) * dtype.itemsize
    if len(buf) - header != expected:
        raise IDXFormatError(
            f"{path}: header says shape {dims} of {dtype.name} ({expected} bytes of data), but the file has "
            f"{len(buf) - header}. The file is truncated or corrupt: download it again."
        )
    data = np.frombuffer(buf, dtype=dtype, offset=header).reshape(dims)
    return data.astype(dtype.newbyteorder("="))  # native byte order, and a writable copy


def _find_mnist_file(folder: Path, name: str) -> Path | None:
    # The MNIST page's names, optionally gzipped; some mirrors write "train-images.idx3-ubyte".
    stem, _, kind = name.rpartition("-idx")
    for candidate in (name, name + ".gz", f"{stem}.idx{kind}", f"{stem}.idx{kind}.gz"):
        if (folder / candidate).is_file():
            return folder / candidate
    return None


def _mnist_paths(folder: Path) -> dict[str, Path]:
    found = {role: _find_mnist_file(folder, name) for role, name in MNIST_FILES.items()}
    missing = [MNIST_FILES[role] for role, p in found.items() if p is None]
    if missing:
        raise DatasetNotFoundError(
            f"MNIST not found in {folder.resolve()}: expected the four IDX files "
            f"{', '.join(MNIST_FILES.values())} (raw or .gz); missing: {', '.join(missing)}. "
            f"Download them from the MNIST page ({MNIST_URL}) or a mirror into that folder, "
            "or use the bundled digits data set, which needs no download (--data digits on the command line, "
            "mixprec.data.digits(size=28) in Python)."
        )
    return {role: p for role, p in found.items() if p is not None}


def _check_labels(path: Path, labels: np.ndarray, n_classes: int) -> None:
    """Labels outside ``0..n_classes-1`` are refused here: cross_entropy would fail on them mid-training."""
    bad = np.flatnonzero((labels < 0) | (labels >= n_classes))
    if bad.size:
        raise IDXFormatError(
            f"{path}: label {labels[bad[0]]} at index {bad[0]} is outside 0..{n_classes - 1} ({bad.size} of "
            f"{labels.size} labels are). Check that this is an MNIST label file, or download it again."
        )


def _mnist_split(images_path: Path, labels_path: Path, limit: int | None) -> tuple[Tensor, Tensor]:
    images, labels = read_idx(images_path, ndim=3), read_idx(labels_path, ndim=1)  # (N, H, W), (N,)
    if len(images) != len(labels):
        raise IDXFormatError(
            f"{images_path.name} / {labels_path.name}: {len(images)} images and {len(labels)} labels (shapes "
            f"{images.shape} and {labels.shape}). Check that the image and label files belong together."
        )
    _check_labels(labels_path, labels, MNIST_CLASSES)
    images, labels = images[:limit], labels[:limit]
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)  # [0, 255] -> [0, 1]
    return x, torch.from_numpy(labels.astype(np.int64))


def mnist(
    path: str | Path,
    batch_size: int = 64,
    size: int | None = None,
    channels: int = 1,
    seed: int = 0,
    flatten: bool = False,
    normalize: bool = True,
    n_train: int | None = None,
    n_valid: int | None = None,
) -> DataBunch:
    """MNIST from the four IDX files in folder ``path``: train on the 60k train set, validate on the 10k test.

    Nothing is downloaded; :class:`DatasetNotFoundError` says which files were expected and where to get
    them. ``n_train``/``n_valid`` keep only the first that many samples (quick runs). ``size``, ``channels``,
    ``flatten`` and ``normalize`` behave as in :func:`digits`.
    """
    paths = _mnist_paths(Path(path))
    train = _mnist_split(paths["train_images"], paths["train_labels"], n_train)
    valid = _mnist_split(paths["valid_images"], paths["valid_labels"], n_valid)
    return _image_bunch(
        train, valid, name="mnist", n_classes=MNIST_CLASSES, batch_size=batch_size, size=size,
        channels=channels, flatten=flatten, normalize=normalize, seed=seed,
    )


# ---------------------------------------------------------------------------------------------------------
# synthetic
# ---------------------------------------------------------------------------------------------------------


def synthetic(
    n: int = 2048,
    input_shape: tuple[int, ...] = (64,),
    n_classes: int = 10,
    batch_size: int = 64,
    valid_pct: float = 0.2,
    seed: int = 0,
) -> DataBunch:
    """Standard-normal inputs labelled by a random linear teacher: ``y = argmax(x.flatten() @ W + b)``.

    Linearly separable by construction, so any model that can represent a linear map can reach 100% train
    accuracy; useful to check that a training setup learns at all. Deterministic in ``seed``.
    """
    if n < 2 or n_classes < 2:
        raise ValueError(f"synthetic needs n >= 2 and n_classes >= 2, got n={n}, n_classes={n_classes}.")
    input_shape = tuple(int(d) for d in input_shape)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *input_shape), generator=gen)
    n_features = math.prod(input_shape)
    # Scaled by 1/sqrt(n_features) so the teacher's logits have unit variance whatever the input size,
    # and the bias shifts class frequencies only a little: classes stay roughly balanced.
    weight = torch.randn(n_features, n_classes, generator=gen) / math.sqrt(n_features)
    bias = 0.1 * torch.randn(n_classes, generator=gen)
    y = (x.reshape(n, -1) @ weight + bias).argmax(dim=1)
    train_idx, valid_idx = split_indices(n, valid_pct, seed)
    train, valid = (x[train_idx], y[train_idx]), (x[valid_idx], y[valid_idx])
    train_dl, valid_dl = _loaders(train, valid, batch_size, seed)
    return DataBunch(train_dl, valid_dl, n_classes, input_shape, "synthetic")
