"""A prompt's images at the agent loop: resolved, or refused with the dead-letter cause."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from schemas.events import PromptEvent
from workers.agent_loop.exceptions import AgentLoopError
from workers.agent_loop.images import LoopImages, PromptImages, is_vision_model, messages_of
from workers.media.config import MediaConfig


def _png(color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4, 4), color).save(out, format="PNG")
    return out.getvalue()


def _prompt(path: Path) -> PromptEvent:
    content = [
        {"type": "image_url", "image_url": {"url": str(path)}},
        {"type": "text", "text": "?"},
    ]
    return PromptEvent(uid="u", data_source="x", prompt=[{"role": "user", "content": content}])


def test_a_text_prompt_resolves_to_no_images(tmp_path: Path) -> None:
    text = PromptEvent(uid="u", data_source="x", prompt=[{"role": "user", "content": "hi"}])
    images = PromptImages(MediaConfig(store_dir=str(tmp_path / "s")), vision=False)
    assert images.resolve(text) == (text, None)
    assert messages_of(text) == [{"role": "user", "content": "hi"}]


def test_the_loop_images_expand_each_image_token_as_the_processor_does() -> None:
    images = LoopImages(refs=[], token_id=9, counts=[2, 3])
    assert images.expand([1, 9, 2, 9]) == [1, 9, 9, 2, 9, 9, 9]
    with pytest.raises(AgentLoopError, match="1 image tokens for 2 images"):
        images.expand([1, 9])


def test_a_gone_image_and_a_text_only_policy_are_refused_with_their_causes(
    tmp_path: Path,
) -> None:
    (tmp_path / "a.png").write_bytes(_png((1, 1, 1)))
    config = MediaConfig(store_dir=str(tmp_path / "s"))
    with pytest.raises(AgentLoopError, match="text-only") as text_only:
        PromptImages(config, vision=False, model="tiny").resolve(_prompt(tmp_path / "a.png"))
    assert text_only.value.cause == "image_unsupported"
    prompt = PromptImages(config, vision=False).ingest(_prompt(tmp_path / "a.png"))
    assert prompt.prompt[0].content[0].type == "image_ref"  # stored before the refusal
    for stored in (tmp_path / "s").rglob("*"):
        if stored.is_file():
            stored.unlink()
    with pytest.raises(AgentLoopError, match="not in the media store") as gone:
        PromptImages(config, vision=True).resolve(prompt)
    assert gone.value.cause == "image_missing"


def test_a_model_directory_with_an_image_processor_is_a_vision_model(tmp_path: Path) -> None:
    assert not is_vision_model(str(tmp_path))
    (tmp_path / "preprocessor_config.json").write_text("{}")
    assert is_vision_model(str(tmp_path))
