"""Helpers for trainer tests: TrainingGroups with real tiny-model tokens and behaviour logprobs
(image groups of the `vl` preset too)."""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import torch
import yaml
from PIL import Image

from schemas.codec import decode, encode, headers_for
from schemas.events import ExtraFields, PolicyVersion, ScoredTrajectory, TrainingGroup
from schemas.media import ImageRef
from workers.kafka.clients import make_consumer, make_producer
from workers.kafka.config import KafkaConfig, TopicsConfig


def behaviour_logprobs(model: Any, prompt: list[int], response: list[int]) -> list[float]:
    """What a replica would report: log π(response token), one unpadded sequence at a time."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1).tolist()


def make_groups(
    model_dir: Path, count: int, *, n: int = 2, seed: int = 0, prefix: str = "p", version: int = 0
) -> list[TrainingGroup]:
    """`count` groups of `n` samples; some samples carry a tool span (response_mask 0)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    groups = []
    for g in range(count):
        uid = f"{prefix}-{g}"
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 8))]
        samples, scores = [], []
        for i in range(n):
            response = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 9))]
            mask = [1] * len(response)
            if i % 2 == 1 and len(response) > 4:
                mask[2:4] = [0, 0]  # a tool response inside the trajectory
            score = float(rng.random() < 0.5)
            scores.append(score)
            samples.append(
                ScoredTrajectory(
                    uid=uid,
                    trajectory_id=f"{uid}/{i}",
                    sample_index=i,
                    attempt_id=f"att-{g}-{i}",
                    data_source="test",
                    prompt_ids=prompt,
                    response_ids=response,
                    response_mask=mask,
                    response_logprobs=behaviour_logprobs(model, prompt, response),
                    num_turns=2,
                    reward_score=score,
                    extra_fields=ExtraFields(min_global_steps=version, max_global_steps=version),
                )
            )
        mean = sum(scores) / n
        groups.append(
            TrainingGroup(
                uid=uid,
                samples=samples,
                advantages=[s - mean for s in scores],
                min_global_steps=version,
                max_global_steps=version,
                emitted_at_version=version,
            )
        )
    return groups


def produce(kafka: KafkaConfig, topic: str, groups: list[TrainingGroup]) -> None:
    producer = make_producer(kafka, name="test-replay")
    try:
        futures = [
            producer.send(topic, key=g.uid, value=encode(g), headers=headers_for(g)) for g in groups
        ]
        for future in futures:
            future.get(timeout=30)
    finally:
        producer.close()


def read_all(kafka: KafkaConfig, topic: str, *, timeout_s: float = 5.0) -> list[Any]:
    """Every record of `topic` from the beginning (record objects), until quiet."""
    consumer = make_consumer(kafka, topic, group_id=None, name="test-read")
    out: list[Any] = []
    try:
        idle = 0.0
        while idle < timeout_s:
            batch = consumer.poll(timeout_ms=500)
            if not batch:
                idle += 0.5
                continue
            idle = 0.0
            for records in batch.values():
                out.extend(records)
    finally:
        consumer.close()
    return out


def policy_versions(kafka: KafkaConfig, topic: str) -> list[PolicyVersion]:
    return [decode(r.value) for r in read_all(kafka, topic, timeout_s=2.0)]


def small_trainer_config(
    path: Path, kafka: KafkaConfig, topics: TopicsConfig, model: Path, **trainer: Any
) -> Path:
    """A run config at `path` for a trainer of two groups a step, one sequence a micro-batch,
    a checkpoint every two steps, its checkpoints beside `path` (`trainer` adds or overrides)."""
    settings = {
        "model_dir": str(model),
        "checkpoint_dir": str(path.parent / "ckpt"),
        "train_batch_size": 2,
        "micro_batch_size": 1,
        "sync_every": 2,
        "torch_threads": 1,
        "poll_timeout_s": 0.2,
        "group_id": f"trainer-{path.parent.name}",
    } | trainer
    config = {
        "kafka": {"bootstrap_servers": kafka.bootstrap},
        "topics": {"prefix": topics.prefix},
        "trainer": settings,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def png(color: tuple[int, int, int]) -> bytes:
    """A 16 x 16 PNG of one colour."""
    out = io.BytesIO()
    Image.new("RGB", (16, 16), color).save(out, format="PNG")
    return out.getvalue()


def image_group(policy: Any, processor: Any, uid: str, ref: ImageRef, data: bytes) -> TrainingGroup:
    """A group of two samples on one image prompt (the `vl` preset's template), with the
    policy's own logprobs."""
    text = "<|im_start|>user\n<image>What is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    enc = processor(text=text, images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    prompt = enc["input_ids"][0].tolist()
    samples = []
    for i, response in enumerate(([17, 18, 2], [19, 20, 21, 2])):
        with torch.no_grad():
            ids = torch.tensor([prompt + response])
            logits = policy(input_ids=ids, pixel_values=enc["pixel_values"]).logits[0]
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)
        samples.append(
            ScoredTrajectory(
                uid=uid,
                trajectory_id=f"{uid}/{i}",
                sample_index=i,
                attempt_id=f"{uid}-att-{i}",
                data_source="test",
                prompt_ids=prompt,
                response_ids=response,
                response_mask=[1] * len(response),
                response_logprobs=[logp[j, t].item() for j, t in enumerate(response)],
                num_turns=1,
                reward_score=float(i),
                extra_fields=ExtraFields(min_global_steps=0, max_global_steps=0),
                images=[ref],
            )
        )
    return TrainingGroup(
        uid=uid,
        samples=samples,
        advantages=[-0.5, 0.5],
        min_global_steps=0,
        max_global_steps=0,
        emitted_at_version=0,
    )
