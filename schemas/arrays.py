"""Packed numeric arrays: the wire form of token ids, logprobs and masks.

On the wire an array is a base64 string of its little-endian bytes (`<i4` for token ids,
`<f4` for logprobs, `u1` for masks), so any Kafka client in any language can read it with a
base64 decoder and a typed-array view. In Python the field holds a read-only numpy array.

Validation accepts a numpy array, a list of numbers or the base64 string, and always yields
an array of the field's exact dtype; serialisation (`mode="json"`) yields the base64 string.
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
import pybase64
from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

__all__ = [
    "FloatArray",
    "IntArray",
    "MaskArray",
    "arrays_equal",
    "pack",
    "unpack",
]


def pack(array: np.ndarray, dtype: str) -> str:
    """Base64 of the array's little-endian bytes in `dtype`."""
    data = np.ascontiguousarray(array, dtype=dtype)
    return pybase64.b64encode(data.data).decode("ascii")


def unpack(text: str | bytes, dtype: str | np.dtype[Any]) -> np.ndarray:
    """Inverse of `pack`: a read-only array viewing the decoded bytes."""
    return _unpack(text, np.dtype(dtype), str(dtype))


def _unpack(text: str | bytes, dtype: np.dtype[Any], name: str) -> np.ndarray:
    raw = pybase64.b64decode(text, validate=True)
    if len(raw) % dtype.itemsize:
        raise ValueError(
            f"packed {name} array has {len(raw)} bytes, not a multiple of {dtype.itemsize}"
        )
    return np.frombuffer(raw, dtype=dtype)


_ONLY_INT = frozenset({int})


def _validator(dtype: str) -> Any:
    kind = np.dtype(dtype).kind
    exact = np.dtype(dtype)

    def coerce(value: Any) -> np.ndarray:
        # The wire form (str) first: every decoded message takes this path.
        if type(value) is str or isinstance(value, bytes):
            return _unpack(value, exact, dtype)
        if isinstance(value, np.ndarray):
            if value.ndim != 1:
                raise ValueError(f"expected a 1-d array, got shape {value.shape}")
            if value.dtype == dtype:
                return value
            if kind != "f" and value.dtype.kind == "f":
                raise ValueError("expected integers, got floats")
            return value.astype(dtype)
        if isinstance(value, list | tuple):
            # Only plain ints (what a replica's JSON decodes to) pass the set of their types,
            # built in C; anything else (numpy ints, bools, floats) takes the per-item check.
            if (
                kind != "f"
                and not _ONLY_INT.issuperset(map(type, value))
                and any(not isinstance(v, int | np.integer) or isinstance(v, bool) for v in value)
            ):
                raise ValueError("expected a list of integers")
            try:
                return np.asarray(value, dtype=dtype)
            except (OverflowError, ValueError) as exc:
                raise ValueError(f"cannot convert to {dtype}: {exc}") from exc
        raise ValueError(
            f"expected a base64 string or a list of numbers, got {type(value).__name__}"
        )

    return coerce


def _field(dtype: str, description: str) -> Any:
    return Annotated[
        np.ndarray,
        BeforeValidator(_validator(dtype)),
        PlainSerializer(lambda a: pack(a, dtype), return_type=str, when_used="json"),
        WithJsonSchema({"type": "string", "contentEncoding": "base64", "description": description}),
    ]


IntArray = _field("<i4", "little-endian int32 array, base64")
FloatArray = _field("<f4", "little-endian float32 array, base64")
MaskArray = _field("u1", "uint8 array (0 or 1), base64")


def arrays_equal(a: Any, b: Any) -> bool:
    """Equality that treats numpy arrays by value (pydantic's `==` cannot)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        return a.shape == b.shape and bool(np.array_equal(a, b))
    return bool(a == b)
