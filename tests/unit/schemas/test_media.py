"""Content parts and image references on the wire (`schemas.media`)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from schemas.codec import decode, encode
from schemas.events import PromptEvent, TurnEvent
from schemas.media import ImageRef, ImageRefPart, message_text, prompt_images

REF = ImageRef(sha256="ab" * 32, mime_type="image/png", size=70)


def _prompt(content: object) -> PromptEvent:
    return PromptEvent(uid="u", data_source="x", prompt=[{"role": "user", "content": content}])


def test_a_content_list_of_text_and_images_validates_and_round_trips() -> None:
    event = _prompt(
        [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": "What is this?"},
            {"type": "image_ref", "image_ref": REF.model_dump()},
        ]
    )
    again = decode(encode(event))
    assert again == event
    assert prompt_images(m.content for m in again.prompt) == [REF]
    assert message_text(again.prompt[0].content) == "<image>What is this?<image>"


def test_a_wrong_part_names_what_a_part_may_be() -> None:
    with pytest.raises(ValidationError, match=r"part 0: Input tag 'image'.*'image_url'"):
        _prompt([{"type": "image", "image": "x.png"}])
    with pytest.raises(ValidationError, match="content must be a string or a list of parts"):
        _prompt(7)


def test_prompts_differing_only_in_their_image_have_different_digests() -> None:
    other = ImageRef(sha256="cd" * 32, mime_type="image/png", size=70)
    a = _prompt([ImageRefPart(image_ref=REF).model_dump(), {"type": "text", "text": "x"}])
    b = _prompt([ImageRefPart(image_ref=other).model_dump(), {"type": "text", "text": "x"}])
    assert a.content_digest() != b.content_digest()


def test_a_text_turn_encodes_without_images_and_an_image_turn_carries_them() -> None:
    base = dict(
        trajectory_id="u/0", uid="u", sample_index=0, attempt_id="a", turn_index=0,
        role="assistant", token_ids=[1, 2], min_global_steps=0, max_global_steps=0,
    )  # fmt: skip
    assert b'"images"' not in encode(TurnEvent(**base))
    turn = decode(encode(TurnEvent(**base, images=[REF])))
    assert isinstance(turn, TurnEvent) and turn.images == [REF]


def test_a_reference_must_name_a_sha256_and_an_image_type() -> None:
    with pytest.raises(ValidationError):
        ImageRef(sha256="not-a-hash", mime_type="image/png", size=1)
    with pytest.raises(ValidationError):
        ImageRef(sha256="ab" * 32, mime_type="text/plain", size=1)
