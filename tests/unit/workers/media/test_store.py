"""The content-addressed media store and image ingestion (`workers.media`)."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from PIL import Image

from schemas.events import PromptEvent
from schemas.media import ImageRefPart, prompt_images
from workers.media.config import MediaConfig
from workers.media.exceptions import MediaError
from workers.media.ingest import Ingestor
from workers.media.store import MediaStore, decode_image


def png(color: tuple[int, int, int], size: int = 8) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (size, size), color).save(out, format="PNG")
    return out.getvalue()


def _prompt(*urls: str) -> PromptEvent:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return PromptEvent(
        uid="u",
        data_source="x",
        prompt=[{"role": "user", "content": [*parts, {"type": "text", "text": "what?"}]}],
    )


def test_put_names_bytes_by_their_hash_and_get_reads_them_back(tmp_path: Path) -> None:
    store = MediaStore(tmp_path)
    data = png((255, 0, 0))
    ref = store.put(data, "image/png")
    assert store.put(data, "image/png") == ref and ref.data is None and ref.size == len(data)
    assert store.get(ref) == data
    assert decode_image(store.get(ref)).getpixel((0, 0)) == (255, 0, 0)


def test_a_gone_file_and_changed_bytes_are_named_not_read(tmp_path: Path) -> None:
    store = MediaStore(tmp_path)
    ref = store.put(png((0, 255, 0)), "image/png")
    store.path(ref.sha256).write_bytes(png((0, 0, 255)))
    with pytest.raises(MediaError, match="do not hash") as bad:
        store.get(ref)
    assert bad.value.cause == "image_corrupt"
    store.path(ref.sha256).unlink()
    with pytest.raises(MediaError, match="not in the media store") as gone:
        store.get(ref)
    assert gone.value.cause == "image_missing"


def test_small_images_travel_inline_and_need_no_store(tmp_path: Path) -> None:
    data = png((1, 2, 3))
    ref = MediaStore(tmp_path, inline_max_bytes=len(data)).put(data, "image/png")
    assert ref.data is not None and base64.b64decode(ref.data) == data
    assert MediaStore(tmp_path / "elsewhere").get(ref) == data


def test_ingest_reads_data_uris_and_paths_into_references(tmp_path: Path) -> None:
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    (tmp_path / "blue.png").write_bytes(blue)
    uri = "data:image/png;base64," + base64.b64encode(red).decode()
    ingest = Ingestor(MediaConfig(store_dir=str(tmp_path / "store")))
    event = ingest(_prompt(uri, str(tmp_path / "blue.png")))
    refs = prompt_images(m.content for m in event.prompt)
    assert [r.mime_type for r in refs] == ["image/png", "image/png"]
    assert [ingest.store.get(r) for r in refs] == [red, blue]
    assert isinstance(event.prompt[0].content[0], ImageRefPart)
    assert ingest(event) is event  # references only: nothing to do


def test_ingest_refuses_an_oversize_an_undecodable_and_a_missing_image(tmp_path: Path) -> None:
    big = png((9, 9, 9), size=64)
    ingest = Ingestor(MediaConfig(store_dir=str(tmp_path), max_image_bytes=len(big) - 1))
    (tmp_path / "big.png").write_bytes(big)
    with pytest.raises(MediaError, match=r"image 0: \d+ bytes, over media.max_image_bytes="):
        ingest(_prompt(str(tmp_path / "big.png")))
    junk = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()
    with pytest.raises(MediaError, match="not a decodable image") as bad:
        ingest(_prompt(junk))
    assert bad.value.cause == "image_unreadable"
    with pytest.raises(MediaError, match="cannot read image file"):
        ingest(_prompt(str(tmp_path / "nope.png")))
