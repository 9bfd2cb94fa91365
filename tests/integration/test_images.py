"""Images in the prompt stream on the real broker with real hf replicas (issue 32).

Produced through `PromptProducer` as `rollout produce` does (verl's `images` column, an
OpenAI `image_url` part), images reach the agent loop by reference; one whose store file is
gone, one that does not decode, and any image for a text-only policy are dead-lettered with
their reasons while the other prompts finish. With the `vl` preset, image prompts run the
whole loop to a trainer step, whose recomputed logprobs match the engine's.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.config import load_config
from pipeline.data.producer import PromptProducer
from pipeline.launch.local import LocalPipeline
from schemas import PromptEvent
from schemas.codec import decode_as
from schemas.deadletter import DeadLetter
from schemas.events import TrainingGroup
from schemas.media import ImageRef
from tests.integration.agent_helpers import read_turns, run_worker_until
from tests.integration.trainer_helpers import image_group, png
from workers.agent_loop.app import AgentLoopWorker
from workers.agent_loop.config import AgentLoopWorkerConfig
from workers.kafka.clients import make_consumer
from workers.llm.contract import SamplingParams
from workers.media.config import MediaConfig
from workers.trainer.batching import collate, collate_groups
from workers.trainer.images import BatchImages, load_policy
from workers.trainer.step import response_log_probs

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _letters(kafka_config, topic: str, count: int) -> list[DeadLetter]:
    consumer = make_consumer(kafka_config, topic, group_id=None)
    letters: list[DeadLetter] = []
    try:
        for _ in range(40):
            for records in consumer.poll(timeout_ms=500).values():
                letters.extend(DeadLetter.from_message(r.headers, r.key, r.value) for r in records)
            if len(letters) >= count:
                break
    finally:
        consumer.close()
    return letters


async def test_bad_images_are_dead_lettered_with_their_reasons_and_text_prompts_finish(
    kafka_config, topics_config, tiny_model, hf_replicas, unique, tmp_path: Path
) -> None:
    media = MediaConfig(store_dir=str(tmp_path / "store"))
    (tmp_path / "gone.png").write_bytes(png((0, 0, 200)))
    verl = tmp_path / "geo.parquet"
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "<image>What is 1 + 1?"}],
        "images": [{"bytes": png((200, 0, 0)), "path": None}],
        "reward_model": {"ground_truth": "2"},
    }
    pq.write_table(pa.Table.from_pylist([row]), verl)
    jsonl = tmp_path / "gone.jsonl"
    parts = [
        {"type": "image_url", "image_url": {"url": str(tmp_path / "gone.png")}},
        {"type": "text", "text": "and this?"},
    ]
    row2 = {
        "uid": "gone",
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": parts}],
    }
    jsonl.write_text(json.dumps(row2))
    junk = b"\x89PNG\r\n\x1a\n not really"
    undecodable = ImageRef(
        sha256=hashlib.sha256(junk).hexdigest(),
        mime_type="image/png",
        size=len(junk),
        data=base64.b64encode(junk).decode(),
    )
    with PromptProducer(kafka_config, topics_config, media) as producer:
        reports = [
            producer.produce_file(verl, uid_prefix="verl"),
            producer.produce_file(jsonl),
            producer.produce_rows(
                [
                    PromptEvent(
                        uid="junk",
                        data_source="openai/gsm8k",
                        prompt=[
                            {
                                "role": "user",
                                "content": [
                                    {"type": "image_ref", "image_ref": undecodable.model_dump()}
                                ],
                            }
                        ],
                    ),
                    {"uid": "text", "prompt": "What is 2 + 2?", "data_source": "openai/gsm8k"},
                ]
            ),
        ]
    assert [r.sent for r in reports] == [1, 1, 2] and not any(r.errors for r in reports)
    stored = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    gone_sha = hashlib.sha256(png((0, 0, 200))).hexdigest()
    assert len(stored) == 2 and gone_sha in {p.name for p in stored}
    (tmp_path / "store" / gone_sha[:2] / gone_sha).unlink()  # gone before the agent loop runs

    cfg = AgentLoopWorkerConfig(
        group_id=unique("al"),
        model=str(tiny_model),
        n=1,
        replicas=[r.address for r in hf_replicas],
        sampling=SamplingParams(max_tokens=8, temperature=1.0),
        commit_interval_s=0.5,
        media=media,
    )
    worker = AgentLoopWorker(kafka_config, topics_config, cfg)
    await run_worker_until(
        worker,
        lambda: worker.counters["trajectories"] >= 1 and worker.counters["dead_letters"] >= 3,
    )
    assert worker.counters["dead_letters"] == 3 and worker.counters["trajectories"] == 1
    letters = _letters(kafka_config, topics_config.name("dlq"), 3)
    causes = {json.loads(letter.value)["uid"]: letter.error_cause for letter in letters}
    assert causes == {
        "verl-0": "image_unsupported",
        "gone": "image_missing",
        "junk": "image_unreadable",
    }
    why = {letter.error_cause: letter.error_message for letter in letters}
    assert "text-only" in why["image_unsupported"]
    assert gone_sha[:12] in why["image_missing"] and "media store" in why["image_missing"]
    turns = read_turns(
        kafka_config, topics_config.name("turns"), until=lambda ts: any(t.final for t in ts)
    )
    assert {t.uid for t in turns} == {"text"} and turns[0].images is None


def _groups(kafka_config, topic: str, count: int) -> list[TrainingGroup]:
    consumer = make_consumer(kafka_config, topic, group_id=None)
    groups: list[TrainingGroup] = []
    try:
        for _ in range(40):
            for records in consumer.poll(timeout_ms=500).values():
                groups.extend(decode_as(r.value, TrainingGroup) for r in records)
            if len(groups) >= count:
                break
    finally:
        consumer.close()
    return groups


@pytest.mark.long  # every stage its own process (LocalPipeline): about two minutes on 2 cores
def test_image_prompts_flow_to_a_trainer_step_with_the_engines_logprobs(
    kafka_config, kafka_bootstrap, topics_config, vl_model, tmp_path: Path
) -> None:
    image_flow(kafka_config, kafka_bootstrap, topics_config, vl_model, tmp_path)


def image_flow(
    kafka_config,
    kafka_bootstrap: str,
    topics_config,
    vl_model: Path,
    tmp_path: Path,
    *,
    backend: str = "hf",
    replica_args: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
) -> None:
    """A verl parquet row (`images`) and a JSONL row (`image_url`), the same text and another
    image, go prompts → turns → scored → replay → one trainer step on `backend`'s replica; the
    trainer's recomputed logprobs (its own collate, pixels and forward) equal the engine's
    within 1e-4, and the two prompts' logprobs differ (tests/vllm/test_images.py: on vLLM)."""
    prefix = topics_config.prefix
    store = tmp_path / "store"
    (tmp_path / "blue.png").write_bytes(png((0, 0, 220)))
    verl = tmp_path / "geo.parquet"
    question = "What is 1 + 1?"
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "<image>" + question}],
        "images": [{"bytes": png((220, 0, 0)), "path": None}],
        "reward_model": {"ground_truth": "2"},
    }
    pq.write_table(pa.Table.from_pylist([row]), verl)
    jsonl = tmp_path / "url.jsonl"
    parts = [
        {"type": "image_url", "image_url": {"url": f"file://{tmp_path / 'blue.png'}"}},
        {"type": "text", "text": question},
    ]
    url_row = {**{k: v for k, v in row.items() if k != "images"}, "uid": "url"}
    jsonl.write_text(json.dumps({**url_row, "prompt": [{"role": "user", "content": parts}]}))
    cfg = load_config(
        None,
        {
            "kafka": {"bootstrap_servers": kafka_bootstrap},
            "topics": {"prefix": prefix},
            "media": {"store_dir": str(store)},
            "agent_loop": {
                "group_id": f"{prefix}agent-loop",
                "model": str(vl_model),
                "n": 2,
                "commit_interval_s": 0.5,
                "sampling": {"max_tokens": 6, "temperature": 1.0},
                "llm": {"no_replica_wait_s": timeout_s},  # vLLM: a minute or more to start
            },
            "reward": {"group_id": f"{prefix}reward", "tokenizer": str(vl_model)},
            "replay": {"group_id": f"{prefix}replay", "n": 2, "batch_within_s": 0.1},
            "trainer": {
                "model_dir": str(vl_model),
                "checkpoint_dir": str(tmp_path / "ckpt"),
                "group_id": f"{prefix}trainer",
                "train_batch_size": 2,
                "max_steps": 1,
                "max_staleness": 0,
                "torch_threads": 1,
            },
        },
    )
    with PromptProducer(cfg.kafka, cfg.topics, cfg.media) as producer:
        sent = [producer.produce_file(verl, uid_prefix="verl"), producer.produce_file(jsonl)]
    assert [r.sent for r in sent] == [1, 1], [r.errors for r in sent]

    with LocalPipeline(
        cfg,
        tmp_path / "run",
        model_dir=str(vl_model),
        replicas=1,
        backend=backend,
        replica_args=replica_args,
        extra_env=extra_env,
    ) as pipe:
        deadline = time.monotonic() + timeout_s
        while pipe.process("train").proc.poll() is None and time.monotonic() < deadline:
            pipe.check()
            time.sleep(1.0)
        train = pipe.process("train")
        assert train.proc.poll() == 0, train.tail()
    steps = [
        r
        for r in map(json.loads, (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines())
        if r.get("event") == "step"
    ]
    assert [(s["step"], s["samples"]) for s in steps] == [(1, 4)]

    groups = {g.uid: g for g in _groups(kafka_config, topics_config.name("replay"), 2)}
    assert sorted(groups) == ["url", "verl-0"]
    refs = {uid: g.samples[0].images for uid, g in groups.items()}
    assert all(len(r) == 1 and r[0].data is None for r in refs.values())  # by reference
    assert refs["url"][0].sha256 != refs["verl-0"][0].sha256
    assert all(s.images == refs[uid] for uid, g in groups.items() for s in g.samples)

    # The trainer's recomputation of the version-0 logprobs, with its own functions.
    model = load_policy(vl_model, dtype=torch.float32).eval()
    batch = BatchImages(cfg.trainer.media, vl_model).attach(
        collate_groups([groups["verl-0"], groups["url"]])
    )
    with torch.no_grad():
        recomputed, _ = response_log_probs(model, batch)
    mask = batch["response_mask"] > 0
    gap = (recomputed - batch["old_logprobs"]).abs()[mask].max().item()
    assert gap < 1e-4, gap
    print(f"trainer vs engine logprobs: max gap {gap:.3g} over {int(mask.sum())} tokens")
    # The same text, another image: the first token's distribution differs.
    first = [g.samples[0] for g in (groups["verl-0"], groups["url"])]
    assert first[0].prompt_ids.tolist() == first[1].prompt_ids.tolist()
    with torch.no_grad():
        logits = [
            model(
                input_ids=torch.tensor([s.prompt_ids.tolist()]),
                pixel_values=BatchImages(cfg.trainer.media, vl_model)
                .attach(collate([s]))
                .pixels[0],
            ).logits[0, -1]
            for s in first
        ]
    apart = (logits[0] - logits[1]).abs().max().item()
    print(f"another image, same tokens: last-position logits differ by up to {apart:.3g}")
    assert apart > 1e-3


def test_a_group_whose_image_is_gone_is_dead_lettered_and_the_next_trains(
    kafka_config, topics_config, vl_model, tmp_path: Path
) -> None:
    """The trainer meets a group whose image left the store after the rollout: that group is
    dead-lettered (`image_missing`), the other group trains, and both are consumed."""
    from transformers import AutoProcessor

    from tests.integration.trainer_helpers import produce
    from workers.media.store import MediaStore
    from workers.trainer.config import TrainerConfig
    from workers.trainer.steplog import effective_steps
    from workers.trainer.trainer import run_trainer
    from workers.weights.checkpoint import load_latest

    store = MediaStore(tmp_path / "store")
    red, blue = png((220, 0, 0)), png((0, 0, 220))
    gone, kept = store.put(red, "image/png"), store.put(blue, "image/png")
    policy = load_policy(vl_model, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(vl_model)
    groups = [
        image_group(policy, processor, "gone", gone, red),
        image_group(policy, processor, "kept", kept, blue),
    ]
    store.path(gone.sha256).unlink()  # after the rollout, before the trainer
    produce(kafka_config, topics_config.name("replay"), groups)
    cfg = TrainerConfig.model_validate(
        {
            "model_dir": str(vl_model),
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "group_id": f"trainer-{tmp_path.name}",
            "train_batch_size": 1,  # the dead letter does not hold the batch back
            "torch_threads": 1,
            "idle_timeout_s": 2.0,  # stop once both groups are consumed, in either order
            "poll_timeout_s": 0.2,
            "media": {"store_dir": str(tmp_path / "store")},
        }
    )
    result = run_trainer(kafka_config, topics_config, cfg)
    assert result.version == 1 and result.stopped_by == "idle", result
    (letter,) = _letters(kafka_config, topics_config.name("dlq"), 1)
    assert (letter.stage, letter.error_cause, letter.key) == ("trainer", "image_missing", b"gone")
    assert gone.sha256[:12] in letter.error_message
    steps = effective_steps(cfg.metrics_path)
    assert [s["uids"] for s in steps.values()] == [["kept"]]
    latest = load_latest(cfg.checkpoint_dir)
    assert latest is not None and sum(latest.state.positions.values()) == 2
    assert (latest.state.groups_trained, latest.state.groups_dead_lettered) == (1, 1)
