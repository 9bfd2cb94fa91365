"""The hf engine's image inputs: the prefix-cache key names images, reuse keeps them whole."""

from __future__ import annotations

import torch

from workers.llm.engines.hf.images import Prepared, image_key

A, B = "a" * 64, "b" * 64


def test_the_cache_key_names_each_image_by_its_hash_never_by_its_placeholder() -> None:
    assert image_key(A) < 0 and image_key(A) != image_key(B)


def test_a_reuse_never_ends_inside_an_image_and_feeds_the_images_after_it() -> None:
    pixels = torch.arange(2.0).reshape(2, 1, 1, 1)
    prepared = Prepared(key=[], starts=[2, 8], length=4, token_id=9, pixels=pixels)
    kv = [(torch.zeros(1, 1, 10, 2), torch.zeros(1, 1, 10, 2))]
    reuse, prefix, extra = prepared.feed(4, kv)  # inside the first image: back to its start
    assert reuse == 2 and prefix[0][0].shape[2] == 2
    assert extra["pixel_values"].flatten().tolist() == [0.0, 1.0]
    reuse, prefix, extra = prepared.feed(7, kv)  # past the first image: only the second
    assert reuse == 7 and extra["pixel_values"].flatten().tolist() == [1.0]
    reuse, prefix, extra = prepared.feed(1, None)
    assert (reuse, prefix) == (1, None) and len(extra["pixel_values"]) == 2
    assert prepared.feed(12, kv)[2] == {}  # both images cached
