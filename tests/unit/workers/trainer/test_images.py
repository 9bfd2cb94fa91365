"""`BatchImages.check`: why a group with images cannot train, from a real media store on disk."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from workers.media.config import MediaConfig
from workers.media.store import MediaStore
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
