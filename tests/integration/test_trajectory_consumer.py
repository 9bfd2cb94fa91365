"""`TrajectoryConsumer` against the real broker: typed events, batches, positions, commit, DLQ."""

from __future__ import annotations

import pytest

from pipeline.clients import TrajectoryConsumer
from schemas.codec import encode, headers_for
from schemas.events import ExtraFields, ScoredTrajectory, TrainingGroup
from tests.integration.trainer_helpers import produce, read_all
from workers.kafka.clients import make_producer
from workers.kafka.config import KafkaConfig, TopicsConfig

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _traj(uid: str, i: int, score: float) -> ScoredTrajectory:
    return ScoredTrajectory(
        uid=uid,
        trajectory_id=f"{uid}/{i}",
        sample_index=i,
        attempt_id="a",
        data_source="t",
        prompt_ids=[1, 2, 3][: 1 + i % 3],
        response_ids=[4, 5, 6, 7][: 1 + i % 4],
        response_mask=[1, 1, 0, 1][: 1 + i % 4],
        response_logprobs=[-0.1] * (1 + i % 4),
        num_turns=2,
        reward_score=score,
        extra_fields=ExtraFields(min_global_steps=i % 2, max_global_steps=i % 2 + 1),
    )


def _group(uid: str) -> TrainingGroup:
    samples = [_traj(uid, 0, 1.0), _traj(uid, 1, 0.0)]
    return TrainingGroup(
        uid=uid,
        samples=samples,
        advantages=[0.5, -0.5],
        min_global_steps=0,
        max_global_steps=2,
        emitted_at_version=2,
    )


def test_batches_positions_seek_and_commit(
    kafka_config: KafkaConfig, topics_config: TopicsConfig, unique: object
) -> None:
    groups = [_group(f"g{i}") for i in range(6)]
    produce(kafka_config, topics_config.name("replay"), groups)
    group_id = f"user-trainer-{topics_config.prefix}"
    with TrajectoryConsumer(
        kafka_config, topics_config, topic="replay", group_id=group_id, assign=True
    ) as src:
        batches = src.batches(4, max_wait_s=3.0)
        first = next(batches)
        assert len(first) == 8 and first["input_ids"].shape[0] == 8
        assert set(first.uids) <= {g.uid for g in groups}
        saved = src.commit()
        assert sum(saved.values()) == 4  # exactly the four groups handed out
        rest = list(batches)
        assert [len(b) for b in rest] == [4]  # the last, smaller batch: 2 groups
        seen = set(first.uids) | set(rest[0].uids)
        assert seen == {g.uid for g in groups}
        src.seek(saved)
        again = src.take(2, timeout_s=5.0)
        assert {g.uid for g in again} == set(rest[0].uids)

    # a new consumer of the same group starts at the committed positions
    with TrajectoryConsumer(
        kafka_config, topics_config, topic="replay", group_id=group_id, assign=False
    ) as src:
        events = src.take(2, timeout_s=15.0)
        assert {e.uid for e in events} == set(rest[0].uids)
        assert all(isinstance(e, TrainingGroup) for e in events)


def test_backlog_counts_the_records_not_handed_out_yet(
    kafka_config: KafkaConfig, topics_config: TopicsConfig, unique: object
) -> None:
    with TrajectoryConsumer(
        kafka_config, topics_config, topic="replay", group_id=None, assign=True
    ) as src:
        assert src.backlog() == 0
        produce(kafka_config, topics_config.name("replay"), [_group(f"b{i}") for i in range(5)])
        assert src.backlog() == 5  # all still on the broker
        assert len(src.take(2, timeout_s=10.0)) == 2
        assert src.backlog() == 3  # the rest, buffered here or on the broker alike


def test_scored_items_grpo_advantages_and_dead_letters(
    kafka_config: KafkaConfig, topics_config: TopicsConfig
) -> None:
    topic = topics_config.name("scored")
    producer = make_producer(kafka_config, name="test-scored")
    items = [_traj("u", 0, 1.0), _traj("u", 1, 0.0)]
    try:
        producer.send(
            topic, key=b"u", value=encode(items[0]), headers=headers_for(items[0]), partition=0
        ).get(30)
        producer.send(topic, key=b"u", value=b"not json", partition=0).get(30)
        producer.send(topic, key=b"u", value=encode(_group("x")), partition=0).get(30)  # wrong kind
        producer.send(
            topic, key=b"u", value=encode(items[1]), headers=headers_for(items[1]), partition=0
        ).get(30)
    finally:
        producer.close()
    with TrajectoryConsumer(
        kafka_config, topics_config, topic="scored", group_id=None, assign=True
    ) as src:
        (batch,) = list(src.batches(2, max_wait_s=3.0, advantages="grpo"))
        assert batch.trajectory_ids == ["u/0", "u/1"]
        assert batch["advantages"][0, 0].item() == pytest.approx(0.7071, abs=1e-3)
        assert batch["token_level_rewards"][0].tolist() == [1.0, 0.0]
        assert src.positions()[f"{topic}:0"] == 4
    dead = read_all(kafka_config, topics_config.name("dlq"), timeout_s=2.0)
    assert len(dead) == 2


def test_grpo_batches_over_scored_hand_out_only_whole_groups(
    kafka_config: KafkaConfig, topics_config: TopicsConfig
) -> None:
    """Groups interleave on `rl.scored`; a batch of 2 holds two whole groups (never two
    halves), an incomplete group is not handed out, and the position stops before it."""
    topic = topics_config.name("scored")
    order = [("a", 0, 1.0), ("b", 0, 1.0), ("b", 1, 0.0), ("a", 1, 0.0), ("c", 0, 1.0)]
    producer = make_producer(kafka_config, name="test-scored")
    try:
        for uid, i, score in order:
            item = _traj(uid, i, score).model_copy(update={"group_size": 2})
            producer.send(
                topic, key=uid, value=encode(item), headers=headers_for(item), partition=0
            ).get(30)
    finally:
        producer.close()
    with TrajectoryConsumer(
        kafka_config, topics_config, topic="scored", group_id=None, assign=True
    ) as src:
        batches = list(src.batches(2, max_wait_s=3.0, advantages="grpo"))
        assert len(batches) == 1
        (batch,) = batches
        assert sorted(batch.trajectory_ids) == ["a/0", "a/1", "b/0", "b/1"]
        adv = {t: batch["advantages"][k, 0].item() for k, t in enumerate(batch.trajectory_ids)}
        assert adv["a/0"] == pytest.approx(-adv["a/1"]) and adv["a/0"] > 0  # within its group
        # c/0 (offset 4) is held: the position stops before it, so nothing is skipped
        assert src.positions()[f"{topic}:0"] == 4
        assert src.partial_groups == 1


@pytest.mark.parametrize("group_size", [None, 3])
def test_grpo_advantages_over_scored_follow_the_runs_replay_settings(
    kafka_config: KafkaConfig, topics_config: TopicsConfig, group_size: int | None
) -> None:
    """A run with `replay.norm_adv_by_std: false` (Dr. GRPO): the advantages a consumer of
    `rl.scored` computes with the run's replay settings are the replay stage's (the centred
    scores, not divided by the std), for groups told by `group_size` or not."""
    from schemas.advantages import group_advantages
    from workers.replay.config import ReplayConfig

    replay = ReplayConfig(norm_adv_by_std=False, adv_eps=1e-3)
    scores = [1.0, 0.0, 0.0]
    items = [
        _traj("d", i, s).model_copy(update={"group_size": group_size}) for i, s in enumerate(scores)
    ]
    produce(kafka_config, topics_config.name("scored"), items)
    with TrajectoryConsumer(
        kafka_config, topics_config, topic="scored", group_id=None, assign=True
    ) as src:
        (batch,) = list(src.batches(3, max_wait_s=3.0, advantages=replay))
    got = {t: batch["advantages"][k, 0].item() for k, t in enumerate(batch.trajectory_ids)}
    want = group_advantages(scores, norm_by_std=False, eps=replay.adv_eps)
    assert [got[f"d/{i}"] for i in range(3)] == pytest.approx(want, abs=1e-6)
    assert want[0] == pytest.approx(2 / 3)  # not 1.1547, the std-normalised one
