"""Routed experts of a MoE policy, recorded across a weight update, reach `rl.replay` intact.

Real parts: the broker, an `hf` replica serving the `moe` preset (old checkpoint, seed 0) as a
`rollout replica serve` subprocess, and the agent-loop, reward and replay stages as `rollout`
subprocesses (`LocalPipeline`, the agent loop given the replica's address); the agent loop
asks for routing because the model's config.json is MoE (the config's
`return_routed_experts` left at its default). Once the replica has
generated some tokens of the prompt's two samples, the test pauses it (`/pause`: everything in
flight is aborted mid-way), loads the new checkpoint (seed 1) with `/update_weights`, and
resumes it; the client resumes each generation on the new weights.

For each sample of the `TrainingGroup` on `rl.replay`: the tokens sampled before the update
carry the old checkpoint's logprobs and the rest the new one's (which tells where the first
piece ended), and `routed_experts` is exactly a transformers forward of the old weights (a hook
on each layer's router) for the positions the first piece fed, and of the new weights for the
rest: append-only history, from the engine through the client, the turn event, the reward
stage's assembly and the replay stage.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.clients import PromptProducer
from pipeline.config import load_config
from pipeline.data.arithmetic import arithmetic_rows
from pipeline.launch.local import LocalPipeline
from schemas.events import TrainingGroup
from tests.conftest import ReplicaProcess
from tests.integration.agent_helpers import TurnReader

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MAX_TOKENS = 384  # long enough that the pause lands mid-way on a loaded machine
SAMPLES = 2
TOL = 1e-4  # fp32 engine vs fp32 reference; the two checkpoints differ by ~0.2 a token


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from pipeline.harness.models.tiny import init_model

    root = tmp_path_factory.mktemp("moe")
    old = init_model(root / "old", preset="moe", seed=0)
    return old, init_model(root / "new", preset="moe", seed=1)


def _post(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return dict(json.loads(resp.read()))


def _generated(url: str) -> float:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:  # not up yet
        return 0.0
    name = "rollout_replica_generated_tokens_total{"
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _reference(model_dir: Path, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """A transformers forward over `ids`: (each position's logprobs of the next token,
    its routing (positions, layers, top_k) read off hooks on every router)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    taken: list[torch.Tensor] = []
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    for router in routers:
        router.register_forward_hook(lambda _m, _a, out: taken.append(out[2]))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert len(taken) == len(routers) == 4
    return logprobs.numpy(), torch.stack(taken, 1).numpy()


def test_routing_across_a_weight_update_reaches_replay_append_only(
    kafka_bootstrap: str, topics_config: Any, moe_checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    old, new = moe_checkpoints
    prefix = topics_config.prefix
    cfg = load_config(
        None,
        {
            "kafka": {"bootstrap_servers": kafka_bootstrap},
            "topics": {"prefix": prefix},
            "agent_loop": {
                "group_id": f"{prefix}agent-loop",
                "model": str(old),
                "n": SAMPLES,
                "commit_interval_s": 0.5,
                "sampling": {"max_tokens": MAX_TOKENS, "temperature": 1.0, "ignore_eos": True},
                "loops": {"max_response_length": MAX_TOKENS},
                "llm": {"health_interval_s": 1.0, "no_replica_wait_s": 180.0},
            },
            "reward": {"group_id": f"{prefix}reward", "tokenizer": str(old)},
            "replay": {"group_id": f"{prefix}replay", "n": SAMPLES},
        },
    )
    assert cfg.agent_loop.llm.return_routed_experts is None  # the worker decides: MoE → on
    with PromptProducer(cfg.kafka, cfg.topics) as producer:
        producer.produce_rows(arithmetic_rows(1, seed=7), uid_prefix="moe")

    replica = ReplicaProcess(old, "moe-0", tmp_path)  # loads while the stages start
    url = replica.address
    cfg = cfg.model_copy(
        update={"agent_loop": cfg.agent_loop.model_copy(update={"replicas": [url]})}
    )
    stages = ("agent-loop", "reward", "replay")
    try:
        with LocalPipeline(
            cfg, tmp_path / "run", model_dir=str(old), replicas=0, stages=stages
        ) as pipe:
            deadline = time.monotonic() + 240
            while _generated(url) < 8 * SAMPLES:  # both samples well started, far from done
                pipe.check()
                assert replica.proc.poll() is None, replica.log.read_text()[-2000:]
                assert time.monotonic() < deadline, "the replica generated nothing in 240 s"
                time.sleep(0.05)
            assert _post(url + "/pause")["is_paused"] is True
            assert _generated(url) < SAMPLES * MAX_TOKENS, "the samples finished before the pause"
            assert _post(url + "/update_weights", {"path": str(new), "version": 1})["version"] == 1
            _post(url + "/resume")
            with TurnReader(cfg.kafka, cfg.topics.name("replay")) as reader:
                found = reader.read(until=lambda events: len(events) >= 1, timeout_s=300)
            pipe.check()
    finally:
        replica.stop()
    assert len(found) == 1 and isinstance(found[0], TrainingGroup), found
    group = found[0]
    assert len(group.samples) == SAMPLES

    for sample in group.samples:
        prompt, response = sample.prompt_ids.tolist(), sample.response_ids.tolist()
        assert len(response) == MAX_TOKENS
        assert (sample.min_global_steps, sample.max_global_steps) == (0, 1)
        seq = prompt + response
        lp_old, routed_old = _reference(old, seq)
        lp_new, routed_new = _reference(new, seq)
        got_lp = sample.response_logprobs
        at = slice(len(prompt) - 1, None)  # logprob of response token j: position P - 1 + j
        matches_old = np.abs(got_lp - lp_old[at]) <= TOL
        first_new = int(np.argmin(matches_old))  # the first token the new weights sampled
        assert 0 < first_new < MAX_TOKENS and matches_old[:first_new].all()
        assert (np.abs(got_lp[first_new:] - lp_new[at][first_new:]) <= TOL).all()

        routing = sample.routed_experts
        assert routing is not None and (routing.layers, routing.top_k) == (4, 2)
        got = routing.as_array()
        assert got.shape == (len(seq) - 1, 4, 2)  # every position fed; the last token never is
        boundary = len(prompt) + first_new - 1  # positions fed by the first piece
        assert np.array_equal(got[:boundary], routed_old[:boundary])
        assert np.array_equal(got[boundary:], routed_new[boundary : len(seq) - 1])
        # ...and the two checkpoints route differently on both sides, so the check can fail:
        assert not np.array_equal(routed_old[:boundary], routed_new[:boundary])
        assert not np.array_equal(routed_old[boundary:-1], routed_new[boundary:-1])
