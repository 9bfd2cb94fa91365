"""`BatchImages.check`: why a group with images cannot train, from a real media store on disk."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from workers.media.config import MediaConfig
from workers.media.store import MediaStore
from workers.trainer.exceptions import TrainerError
from workers.trainer.images import BatchImages


def _png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (28, 28), (200, 0, 0)).save(out, format="PNG")
    return out.getvalue()


def _group(*refs: Any) -> Any:
    return SimpleNamespace(
        samples=[SimpleNamespace(images=list(refs)), SimpleNamespace(images=None)]
    )


def test_a_group_whose_image_is_gone_or_no_image_cannot_train(tmp_path: Path) -> None:
    store = MediaStore(tmp_path / "store")
    kept = store.put(_png(), "image/png")
    gone = store.put(b"not a png, and soon not there", "image/png")
    garbled = store.put(b"not a png", "image/png")
    store.path(gone.sha256).unlink()
    images = BatchImages(MediaConfig(store_dir=str(tmp_path / "store")), tmp_path / "model")
    assert images.check(_group(kept)) is None
    missing = images.check(_group(kept, gone))
    assert missing is not None and missing.cause == "image_missing", missing
    assert gone.sha256[:12] in str(missing)
    unreadable = images.check(_group(garbled))
    assert unreadable is not None and unreadable.cause != "image_missing", unreadable


class _Batch(dict):  # what `attach` reads of a TrajectoryBatch: its ids, image refs, input ids
    def __init__(self, refs: list[Any]) -> None:
        import torch

        super().__init__(input_ids=torch.zeros(len(refs), 4, dtype=torch.long))
        self.images = refs
        self.trajectory_ids = [f"t{i}" for i in range(len(refs))]
        self.pixels: Any = None


def test_the_step_uses_what_the_check_decoded_even_if_the_file_left(tmp_path: Path) -> None:
    import torch

    store = MediaStore(tmp_path / "store")
    ref = store.put(_png(), "image/png")
    images = BatchImages(MediaConfig(store_dir=str(tmp_path / "store")), tmp_path / "model")
    seen: list[Any] = []

    def processor(*, images: list[Any], return_tensors: str) -> dict[str, Any]:
        seen.extend(images)
        return {"pixel_values": torch.ones(len(images), 3)}

    images._processor = processor  # the model's image processor; the pixels are not the point
    assert images.check(_group(ref)) is None
    store.path(ref.sha256).unlink()  # gone between the check and the step
    batch = images.attach(_Batch([[ref], None]))  # type: ignore[arg-type]
    assert [p is None for p in batch.pixels] == [False, True]
    assert len(seen) == 1 and seen[0].size == (28, 28)
    # Not kept past the step: a later batch reads again, and finds the file gone.
    with pytest.raises(TrainerError, match=f"t0: .*{ref.sha256[:12]}"):
        images.attach(_Batch([[ref]]))  # type: ignore[arg-type]
