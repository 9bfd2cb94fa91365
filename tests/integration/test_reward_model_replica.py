"""A discriminative reward model served by an hf replica's /classify, scored by the RM client."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.conftest import ReplicaProcess
from workers.reward.rm_client import RewardModelClient

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reward_replica(tmp_path_factory):
    from pipeline.harness.models.tiny import init_model

    model = init_model(
        tmp_path_factory.mktemp("rm") / "rm", preset="tiny", seed=1, reward_model=True
    )
    replica = ReplicaProcess(model, "rm-0", tmp_path_factory.mktemp("rm-logs"))
    try:
        replica.wait_healthy()
        yield replica
    finally:
        replica.stop()


def post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_classify_scores_each_sequence_independently_of_padding(reward_replica) -> None:
    url = reward_replica.address + "/classify"
    status, alone = post(url, json.dumps({"input_ids": [[5, 6, 7]]}).encode())
    assert status == 200 and len(alone["scores"]) == 1 and alone["policy_version"] == 0
    status, batch = post(
        url, json.dumps({"input_ids": [[5, 6, 7], [9, 10, 11, 12, 13, 14]]}).encode()
    )
    assert status == 200 and len(batch["scores"]) == 2
    assert batch["scores"][0] == pytest.approx(alone["scores"][0], abs=1e-5)  # padding is masked


def test_bad_requests_are_400_and_the_server_keeps_serving(reward_replica) -> None:
    url = reward_replica.address + "/classify"
    for body in (
        b"{nope",
        b'{"input_ids": []}',
        b'{"input_ids": [[1, -2]]}',
        b'{"input_ids": [[1]], "x": 1}',
        json.dumps({"input_ids": [[10**9]]}).encode(),
    ):
        status, answer = post(url, body)
        assert status == 400 and answer["error"]["message"], body
    assert post(url, b'{"input_ids": [[1, 2]]}')[0] == 200


async def test_reward_model_client_scores_through_the_replica(reward_replica) -> None:
    client = RewardModelClient([reward_replica.address], timeout_s=30, max_batch=2)
    try:
        scores, version = await client.classify([[1, 2, 3], [4, 5], [6]])
    finally:
        await client.close()
    assert len(scores) == 3 and all(isinstance(s, float) for s in scores) and version == 0
