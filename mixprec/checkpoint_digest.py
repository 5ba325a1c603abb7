"""A checksum of a checkpoint's contents, so that a flipped bit is refused instead of loaded as other weights.

``torch.load`` does not check the CRCs of the zip archive it reads: a bit flipped in a tensor's bytes on
disk loads silently as a different weight. ``payload_digest`` hashes what was saved -- every tensor's
dtype, shape and raw bytes, every number, string and array -- walking the nested dicts and lists in a
fixed order. ``save_checkpoint`` stores it next to the payload; ``load_checkpoint`` recomputes it from
what it read and refuses a difference.

The digest is of the *values*, not of the file's bytes, so the file stays a plain ``torch.load``-able
dict and a checkpoint loaded onto another device (``map_location``) hashes the same.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

# sha256: a cryptographic hash is overkill against bit rot, but hashlib's is the fastest strong one in the
# standard library (~1 GB/s) and collisions are not a question anyone has to think about.
_HASH = "sha256"


def payload_digest(payload: Any) -> str:
    """The hex digest of a nested structure of dicts, lists, tuples, tensors, arrays and scalars.

    Copies device tensors to the CPU (a host sync, and a transfer of the whole state)."""
    h = hashlib.new(_HASH)
    _feed(h, payload)
    return h.hexdigest()


def _feed_tensor(h: Any, t: torch.Tensor) -> None:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    h.update(f"T{flat.dtype}{tuple(t.shape)}".encode())
    # Bytes through a uint8 view: every dtype (bf16 and fp8 too, which numpy cannot hold) hashes its bits.
    h.update(flat.view(torch.uint8).numpy().tobytes())


def _feed_array(h: Any, a: np.ndarray) -> None:
    h.update(f"A{a.dtype}{a.shape}".encode())
    h.update(np.ascontiguousarray(a).tobytes())


def _feed_mapping(h: Any, m: Mapping[Any, Any]) -> None:
    h.update(f"D{len(m)}".encode())
    # Sorted by repr: keys are str (state dict names) or int (optimizer state indices), never both unsortable.
    for key in sorted(m, key=repr):
        h.update(repr(key).encode())
        _feed(h, m[key])


def _feed_sequence(h: Any, seq: list[Any] | tuple[Any, ...]) -> None:
    h.update(f"{type(seq).__name__[0]}{len(seq)}".encode())
    for item in seq:
        _feed(h, item)


def _feed_scalar(h: Any, value: Any) -> None:
    # repr round-trips floats exactly (nan, inf and -0.0 included), and ints of any size.
    h.update(f"S{type(value).__name__}:{value!r}".encode())


def _feed_other(h: Any, value: Any) -> None:
    # Anything else a state dict may hold (a Path, a torch.dtype, a small object): its pickle, which is
    # what torch.save stored and what torch.load rebuilt it from.
    h.update(b"P" + pickle.dumps(value, protocol=4))


_FEEDERS: tuple[tuple[type | tuple[type, ...], Callable[[Any, Any], None]], ...] = (
    (torch.Tensor, _feed_tensor),
    (np.ndarray, _feed_array),
    (Mapping, _feed_mapping),
    ((list, tuple), _feed_sequence),
    ((bool, int, float, str, bytes, type(None), np.generic), _feed_scalar),
)


def _feed(h: Any, value: Any) -> None:
    for kinds, feeder in _FEEDERS:
        if isinstance(value, kinds):
            feeder(h, value)
            return
    _feed_other(h, value)
