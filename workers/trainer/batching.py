"""Padded torch batches from trajectories, in verl's layout.

For B samples with longest prompt P and longest response R:

- `prompts`   [B, P]    prompt ids, LEFT-padded with `pad_token_id`
- `responses` [B, R]    response ids (model and tool tokens), RIGHT-padded
- `input_ids` [B, P+R]  `cat(prompts, responses)`: every prompt ends at column P−1 and every
  response starts at column P, so `logits[:, P−1 : P+R−1]` predict the responses
- `attention_mask` [B, P+R]  1 on real tokens, 0 on padding
- `position_ids`   [B, P+R]  `cumsum(attention_mask) − 1`, 0 on left padding
- `response_mask`  [B, R]    1 for model tokens, 0 for tool/user tokens and padding
- `old_logprobs`   [B, R]    the behaviour (rollout) logprobs, 0 on padding
- `advantages`     [B, R]    the sample's advantage broadcast over `response_mask`
- `token_level_rewards` [B, R]  the score on the last response token (verl), 0 elsewhere
- `truncated`      [B]       1 where the response was cut at its token budget
  (`finish_reason == "length"`), for the trainer's `mask_truncated` (DAPO's overlong filter)

Metadata rides along: trajectory ids, uids, each sample's `min/max_global_steps`, and for a
Mixture-of-Experts policy each sample's `routed_experts` (the rollout's routing of its prompt +
response positions, `schemas.routing.RoutedExperts`; None where a sample has none, and the
whole list None when no sample has any). Torch is imported by the functions that need it, so
importing this module stays light.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from schemas.advantages import grpo_advantages
from schemas.events import ScoredTrajectory, TrainingGroup
from schemas.media import ImageRef
from schemas.routing import RoutedExperts

if TYPE_CHECKING:
    import torch

__all__ = ["TrajectoryBatch", "collate", "collate_groups", "grpo_advantages"]

TENSOR_KEYS = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "old_logprobs",
    "advantages",
    "token_level_rewards",
    "truncated",
)


@dataclass
class TrajectoryBatch:
    """Tensors of `TENSOR_KEYS` (batch first) and per-sample metadata; `batch["input_ids"]`."""

    tensors: dict[str, torch.Tensor]
    trajectory_ids: list[str]
    uids: list[str]
    min_global_steps: list[int]
    max_global_steps: list[int]
    prompt_length: int
    extra: dict[str, Any] = field(default_factory=dict)
    routed_experts: list[RoutedExperts | None] | None = None  # per sample (module docstring)
    # Vision-language policies: each sample's image references (None: no sample has any) and
    # their pixel values, one tensor per sample or None (`workers.trainer.images.BatchImages`).
    images: list[list[ImageRef]] | None = None
    pixels: list[Any] | None = None

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __len__(self) -> int:
        return len(self.trajectory_ids)

    @property
    def min_version(self) -> int:
        return min(self.min_global_steps)

    @property
    def max_version(self) -> int:
        return max(self.max_global_steps)

    def to(self, device: Any) -> TrajectoryBatch:
        moved = {k: v.to(device) for k, v in self.tensors.items()}
        return TrajectoryBatch(
            moved,
            self.trajectory_ids,
            self.uids,
            self.min_global_steps,
            self.max_global_steps,
            self.prompt_length,
            dict(self.extra),
            self.routed_experts,
            self.images,
            None if self.pixels is None else [_to(p, device) for p in self.pixels],
        )

    def select(self, lo: int, hi: int) -> TrajectoryBatch:
        """Samples `lo` to `hi` (exclusive), with the whole batch's padding."""
        return TrajectoryBatch(
            {k: v[lo:hi] for k, v in self.tensors.items()},
            self.trajectory_ids[lo:hi],
            self.uids[lo:hi],
            self.min_global_steps[lo:hi],
            self.max_global_steps[lo:hi],
            self.prompt_length,
            dict(self.extra),
            None if self.routed_experts is None else self.routed_experts[lo:hi],
            None if self.images is None else self.images[lo:hi],
            None if self.pixels is None else self.pixels[lo:hi],
        )

    def take(self, indices: Sequence[int]) -> TrajectoryBatch:
        """The samples at `indices` (in that order), with the whole batch's padding."""
        import torch

        rows = list(indices)
        at = torch.tensor(rows, dtype=torch.long, device=self["input_ids"].device)
        return TrajectoryBatch(
            {k: v.index_select(0, at.to(v.device)) for k, v in self.tensors.items()},
            [self.trajectory_ids[i] for i in rows],
            [self.uids[i] for i in rows],
            [self.min_global_steps[i] for i in rows],
            [self.max_global_steps[i] for i in rows],
            self.prompt_length,
            dict(self.extra),
            None if self.routed_experts is None else [self.routed_experts[i] for i in rows],
            None if self.images is None else [self.images[i] for i in rows],
            None if self.pixels is None else [self.pixels[i] for i in rows],
        )

    def split(self, size: int) -> list[TrajectoryBatch]:
        """Consecutive slices of at most `size` samples (same padding as the whole batch)."""
        return [self.select(lo, lo + size) for lo in range(0, len(self), size)]


def collate(
    samples: Sequence[ScoredTrajectory],
    advantages: Sequence[float] | None = None,
    *,
    pad_token_id: int = 0,
) -> TrajectoryBatch:
    """Pad `samples` into one batch; advantages default to 0 (see `grpo_advantages`)."""
    import numpy as np
    import torch

    if not samples:
        raise ValueError("collate: no samples")
    advantages = list(advantages) if advantages is not None else [0.0] * len(samples)
    if len(advantages) != len(samples):
        raise ValueError("collate: one advantage per sample")
    if any(len(s.prompt_ids) == 0 for s in samples):
        raise ValueError(
            "collate: every sample needs a prompt (the first response token's context)"
        )
    b = len(samples)
    p = max(len(s.prompt_ids) for s in samples)
    r = max(max(len(s.response_ids) for s in samples), 1)
    prompts = np.full((b, p), pad_token_id, dtype=np.int64)
    prompt_att = np.zeros((b, p), dtype=np.int64)
    responses = np.full((b, r), pad_token_id, dtype=np.int64)
    resp_att = np.zeros((b, r), dtype=np.int64)
    response_mask = np.zeros((b, r), dtype=np.float32)
    old_logprobs = np.zeros((b, r), dtype=np.float32)
    rewards = np.zeros((b, r), dtype=np.float32)
    for i, s in enumerate(samples):
        lp, lr = len(s.prompt_ids), len(s.response_ids)
        if lp:
            prompts[i, p - lp :] = s.prompt_ids
            prompt_att[i, p - lp :] = 1
        responses[i, :lr] = s.response_ids
        resp_att[i, :lr] = 1
        response_mask[i, :lr] = s.response_mask
        old_logprobs[i, :lr] = s.response_logprobs
        if lr:
            rewards[i, lr - 1] = s.reward_score
    routed = [s.routed_experts for s in samples]
    images = [list(s.images or []) for s in samples]
    attention = torch.from_numpy(np.concatenate([prompt_att, resp_att], axis=1))
    mask_t = torch.from_numpy(response_mask)
    adv = torch.tensor(advantages, dtype=torch.float32).unsqueeze(-1) * mask_t
    tensors = {
        "prompts": torch.from_numpy(prompts),
        "responses": torch.from_numpy(responses),
        "input_ids": torch.from_numpy(np.concatenate([prompts, responses], axis=1)),
        "attention_mask": attention,
        "position_ids": (attention.cumsum(dim=1) - 1).clamp(min=0),
        "response_mask": mask_t,
        "old_logprobs": torch.from_numpy(old_logprobs),
        "advantages": adv,
        "token_level_rewards": torch.from_numpy(rewards),
        "truncated": torch.tensor([s.finish_reason == "length" for s in samples]),
    }
    return TrajectoryBatch(
        tensors=tensors,
        trajectory_ids=[s.trajectory_id for s in samples],
        uids=[s.uid for s in samples],
        min_global_steps=[s.extra_fields.min_global_steps for s in samples],
        max_global_steps=[s.extra_fields.max_global_steps for s in samples],
        prompt_length=p,
        routed_experts=routed if any(r is not None for r in routed) else None,
        images=images if any(images) else None,
    )


def _to(tensor: Any, device: Any) -> Any:
    return None if tensor is None else tensor.to(device)


def collate_groups(groups: Sequence[TrainingGroup], *, pad_token_id: int = 0) -> TrajectoryBatch:
    """Flatten groups (in order, samples in group order) with the groups' advantages."""
    samples = [s for g in groups for s in g.samples]
    advantages = [a for g in groups for a in g.advantages]
    return collate(samples, advantages, pad_token_id=pad_token_id)
