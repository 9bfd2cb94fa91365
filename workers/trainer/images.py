"""Image inputs of the trainer: the policy class of a vision-language model, and the pixel
values of a batch rebuilt from its samples' image references (`schemas.media`).

The replicas prefilled each image from its bytes with the model's image processor
(`workers.llm.engines.hf.images`); here the same bytes (read from the media store, or inline)
go through the same processor, so the recomputed logprobs see the pixels the rollout saw.
A group whose image the store no longer has (or cannot be decoded) is dead-lettered as it is
collected (`BatchImages.check`, cause `image_missing` / `image_unreadable` / ...), and the rest
of the batch trains: training it on its text alone would train another task. The check keeps
what it decoded until the step uses it, so each image is read and decoded once, and one that
leaves the store between the check and the step no longer matters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from schemas.events import TrainingGroup
from workers.llm.policy import load_model as load_policy
from workers.media.config import MediaConfig
from workers.media.exceptions import MediaError
from workers.media.store import MediaStore, decode_image
from workers.trainer.batching import TrajectoryBatch
from workers.trainer.exceptions import TrainerError

__all__ = ["BatchImages", "load_policy"]


class BatchImages:
    """Attach pixel values to batches whose samples carry images."""

    def __init__(self, config: MediaConfig, model_dir: str | Path) -> None:
        self.store = MediaStore(config.store_dir)
        self.model_dir = str(model_dir)
        self._processor: Any = None
        # Images `check` decoded (by digest), kept for the next `attach`, which empties it.
        self._decoded: dict[str, Any] = {}

    def check(self, group: TrainingGroup) -> MediaError | None:
        """Why `group` cannot train (an image missing from the store, unreadable, not an
        image), or None when every image of its samples reads and decodes."""
        for sample in group.samples:
            for ref in sample.images or []:
                if ref.sha256 in self._decoded:
                    continue
                try:
                    self._decoded[ref.sha256] = decode_image(self.store.get(ref))
                except MediaError as exc:
                    return exc
        return None

    def attach(self, batch: TrajectoryBatch) -> TrajectoryBatch:
        """`batch` with `pixels` set (one tensor per sample with images, in prompt order)."""
        if batch.images is None:
            return batch
        if self._processor is None:
            from transformers import AutoImageProcessor

            self._processor = AutoImageProcessor.from_pretrained(self.model_dir)
        pixels: list[Any] = []
        for tid, refs in zip(batch.trajectory_ids, batch.images, strict=True):
            if not refs:
                pixels.append(None)
                continue
            try:
                decoded = [self._decoded.get(ref.sha256) or self._read(ref) for ref in refs]
            except MediaError as exc:
                raise TrainerError(f"trajectory {tid}: {exc}") from exc
            out = self._processor(images=decoded, return_tensors="pt")["pixel_values"]
            pixels.append(out.float().to(batch["input_ids"].device))
        self._decoded.clear()  # this batch's (and any dead-lettered group's): not kept on
        batch.pixels = pixels
        return batch

    def _read(self, ref: Any) -> Any:
        """An image `check` did not decode (a batch collected without it), read now."""
        return decode_image(self.store.get(ref))
