"""`workers.weights.buckets`: tensors into flat byte buckets and back, bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from workers.weights.buckets import ALIGN, alone, pack, plan, unpack


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(5, 7, generator=g)),
        ("b.bias", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("c.count", torch.arange(11, dtype=torch.int64)),
        ("d.mask", torch.tensor([True, False, True])),
        ("e.big", torch.randn(64, 64, generator=g)),  # 16 KiB: larger than a bucket below
        ("f.scalar", torch.tensor(2.5)),
    ]


def _roundtrip(bucket_bytes: int) -> tuple[dict, dict[str, torch.Tensor]]:
    tensors = _tensors()
    manifest = json.loads(json.dumps(plan(tensors, bucket_bytes)))  # it travels as JSON
    out: dict[str, torch.Tensor] = {}
    named = dict(tensors)
    for bucket in manifest["buckets"]:
        flat = torch.empty(bucket["nbytes"], dtype=torch.uint8)
        pack(bucket, named, flat)
        out.update(unpack(bucket, flat))
    return manifest, out


@pytest.mark.parametrize("bucket_bytes", [1, 4096, 1 << 20])
def test_every_tensor_comes_back_exactly_in_its_dtype_and_shape(bucket_bytes: int) -> None:
    manifest, out = _roundtrip(bucket_bytes)
    for name, tensor in _tensors():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(out[name], tensor), name
    for bucket in manifest["buckets"]:
        assert all(offset % ALIGN == 0 for *_, offset in bucket["tensors"])
    assert manifest["total_bytes"] == sum(b["nbytes"] for b in manifest["buckets"])


def test_buckets_hold_at_most_their_size_but_a_larger_tensor_travels_alone() -> None:
    manifest, _ = _roundtrip(4096)
    sizes = {b["tensors"][0][0]: (b["nbytes"], len(b["tensors"])) for b in manifest["buckets"]}
    assert sizes["e.big"] == (64 * 64 * 4, 1)
    assert all(n <= 4096 for first, (n, _) in sizes.items() if first != "e.big")
    assert len(plan(_tensors(), 1 << 20)["buckets"]) == 1


def test_views_not_copies() -> None:
    tensors = dict(_tensors())
    (bucket,) = plan(list(tensors.items()), 1 << 20)["buckets"]
    flat = torch.empty(bucket["nbytes"], dtype=torch.uint8)
    pack(bucket, tensors, flat)
    out = unpack(bucket, flat)
    assert out["a.weight"].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        (["x", "complex128", [2], 0], "unknown dtype"),
        (["x", "float32", [2], 3], "bad offset"),
        (["x", "float32", [-1], 0], "bad shape"),
        (["x", "float32", [100], 0], "overrun"),
    ],
)
def test_a_manifest_that_does_not_fit_its_bytes_is_refused(entry: list, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        unpack({"nbytes": 64, "tensors": [entry]}, torch.empty(64, dtype=torch.uint8))


def test_untransferable_dtypes_are_refused_when_planning() -> None:
    with pytest.raises(ValueError, match="cannot be transferred"):
        plan([("z", torch.zeros(2, dtype=torch.complex64))], 1024)


def test_large_tensors_go_alone_and_are_sent_from_their_own_memory() -> None:
    tensors = _tensors()
    named = dict(tensors)
    manifest = plan(tensors, 1 << 20, alone_bytes=1024)  # e.big (16 KiB) alone; the rest packed
    alone_buckets = [b for b in manifest["buckets"] if alone(b, named) is not None]
    assert [b["tensors"][0][0] for b in alone_buckets] == ["e.big"]
    (bucket,) = alone_buckets
    view = alone(bucket, named)
    assert view is not None and view.dtype == torch.uint8 and view.numel() == bucket["nbytes"]
    assert view.untyped_storage().data_ptr() == named["e.big"].untyped_storage().data_ptr()
    (back,) = unpack(bucket, view.clone()).values()  # what a receiver reads from those bytes
    assert torch.equal(back, named["e.big"])
    packed = [b for b in manifest["buckets"] if b is not bucket]
    assert all(alone(b, named) is None for b in packed if len(b["tensors"]) > 1)
