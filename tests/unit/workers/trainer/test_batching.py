"""Padding and layout of trainer batches built from synthetic events."""

from __future__ import annotations

import pytest
import torch

from schemas.events import ExtraFields, ScoredTrajectory, TrainingGroup
from workers.trainer.batching import collate, collate_groups, grpo_advantages


def _traj(
    uid: str,
    index: int,
    prompt: list[int],
    response: list[int],
    mask: list[int],
    score: float,
    lo: int = 0,
    hi: int = 0,
) -> ScoredTrajectory:
    return ScoredTrajectory(
        uid=uid,
        trajectory_id=f"{uid}/{index}",
        sample_index=index,
        attempt_id="a",
        data_source="test",
        prompt_ids=prompt,
        response_ids=response,
        response_mask=mask,
        response_logprobs=[-0.5 - 0.1 * i for i in range(len(response))],
        num_turns=2,
        reward_score=score,
        extra_fields=ExtraFields(min_global_steps=lo, max_global_steps=hi),
    )


def test_layout_left_pads_prompts_right_pads_responses() -> None:
    a = _traj("u", 0, [11, 12, 13], [21, 22], [1, 1], 1.0, 2, 3)
    b = _traj("u", 1, [14], [23, 24, 25, 26], [1, 0, 0, 1], 0.5, 1, 1)
    batch = collate([a, b], [0.7, -0.7], pad_token_id=0)
    assert batch.prompt_length == 3
    assert batch["prompts"].tolist() == [[11, 12, 13], [0, 0, 14]]
    assert batch["responses"].tolist() == [[21, 22, 0, 0], [23, 24, 25, 26]]
    assert batch["input_ids"].tolist() == [[11, 12, 13, 21, 22, 0, 0], [0, 0, 14, 23, 24, 25, 26]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4, 4], [0, 0, 0, 1, 2, 3, 4]]
    assert batch["response_mask"].tolist() == [[1, 1, 0, 0], [1, 0, 0, 1]]
    assert batch["old_logprobs"][0].tolist() == pytest.approx([-0.5, -0.6, 0.0, 0.0])
    assert batch["old_logprobs"][1].tolist() == pytest.approx([-0.5, -0.6, -0.7, -0.8])
    # advantages broadcast over model tokens only (tool tokens and padding get 0)
    assert batch["advantages"][0].tolist() == pytest.approx([0.7, 0.7, 0, 0])
    assert batch["advantages"][1].tolist() == pytest.approx([-0.7, 0, 0, -0.7])
    # the score sits on the last response token (even when that token is a tool token)
    assert batch["token_level_rewards"].tolist() == [[0, 1.0, 0, 0], [0, 0, 0, 0.5]]
    assert batch.trajectory_ids == ["u/0", "u/1"]
    assert (batch.min_version, batch.max_version) == (1, 3)
    assert batch["input_ids"].dtype == torch.int64
    assert batch["old_logprobs"].dtype == torch.float32


def test_groups_flatten_in_order_with_their_advantages() -> None:
    g1 = TrainingGroup(
        uid="p",
        samples=[_traj("p", 0, [1], [2], [1], 1.0), _traj("p", 1, [1], [3], [1], 0.0)],
        advantages=[1.0, -1.0],
        min_global_steps=0,
        max_global_steps=0,
        emitted_at_version=0,
    )
    g2 = TrainingGroup(
        uid="q",
        samples=[_traj("q", 0, [4, 5], [6, 7], [1, 1], 1.0)],
        advantages=[0.25],
        min_global_steps=0,
        max_global_steps=0,
        emitted_at_version=0,
    )
    batch = collate_groups([g1, g2])
    assert batch.trajectory_ids == ["p/0", "p/1", "q/0"]
    assert batch.uids == ["p", "p", "q"]
    assert batch["advantages"][:, 0].tolist() == [1.0, -1.0, 0.25]
    halves = batch.split(2)
    assert [len(h) for h in halves] == [2, 1]
    assert halves[1]["input_ids"].tolist() == [[4, 5, 6, 7]]
    assert halves[0]["input_ids"].shape == (2, 4)


def test_default_advantages_are_zero_and_empty_is_an_error() -> None:
    batch = collate([_traj("u", 0, [1], [2, 3], [1, 1], 1.0)])
    assert batch["advantages"].abs().sum().item() == 0
    with pytest.raises(ValueError):
        collate([])


def test_grpo_advantages() -> None:
    adv = grpo_advantages([1.0, 0.0, 1.0, 0.0, 5.0], ["a", "a", "a", "a", "b"])
    std = (4 * 0.25 / 3) ** 0.5  # unbiased std of [1, 0, 1, 0]
    assert adv[:4] == pytest.approx([0.5 / std, -0.5 / std, 0.5 / std, -0.5 / std], rel=1e-5)
    assert adv[4] == 0.0
    assert grpo_advantages([1.0, 3.0], ["x", "x"], norm_by_std=False) == [-1.0, 1.0]


def test_each_samples_routed_experts_ride_the_batch_and_its_slices() -> None:
    import numpy as np

    from schemas.routing import RoutedExperts

    routed = RoutedExperts.from_array(np.ones((3, 2, 2), dtype=np.uint8), num_experts=8)
    a = _traj("u", 0, [1, 2], [3, 4], [1, 1], 1.0).model_copy(update={"routed_experts": routed})
    b = _traj("u", 1, [1], [5, 6, 7], [1, 1, 1], 0.0)  # one of a dense policy: None
    batch = collate([a, b])
    assert batch.routed_experts == [routed, None]
    assert batch.select(1, 2).routed_experts == [None]
    assert batch.to("cpu").routed_experts == [routed, None]
    assert [s.routed_experts for s in batch.split(1)] == [[routed], [None]]
    assert collate([b]).routed_experts is None  # no sample has any: nothing to replay


def test_each_samples_images_ride_the_batch_and_its_slices() -> None:
    from schemas.media import ImageRef

    ref = ImageRef(sha256="ab" * 32, mime_type="image/png", size=10)
    a = _traj("u", 0, [1, 2], [3, 4], [1, 1], 1.0).model_copy(update={"images": [ref]})
    b = _traj("u", 1, [1], [5, 6, 7], [1, 1, 1], 0.0)  # a text prompt
    batch = collate([a, b])
    assert batch.images == [[ref], []]
    batch.pixels = [torch.ones(1, 3, 2, 2), None]
    assert batch.select(0, 1).images == [[ref]] and batch.select(1, 2).pixels == [None]
    assert batch.to("cpu").pixels[0].shape == (1, 3, 2, 2)
    assert collate([b]).images is None  # no sample has any
