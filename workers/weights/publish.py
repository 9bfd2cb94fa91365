"""`PolicyPublisher`: new weights from a trainer the project did not write, to the replicas.

    from pipeline.clients import PolicyPublisher

    with PolicyPublisher.from_config(cfg, tokenizer_from="./model") as publisher:
        for step, batch in enumerate(source.batches(8), start=1):
            ...                                   # your update of `model`
            publisher.publish(model, step)        # weights out, version on rl.policy

What the project's own trainer does after a step, for any trainer: the weights travel by the
run's weight transfer (`weights.mode`), and the version is published on the policy
topic (`PolicyVersion`, acknowledged), so every replica's sync controller loads it and the
staleness gate, the replay stage and `rollout status` follow the version as they follow the
project's trainer.

- `checkpoint` (the default, `disk`): the weights are written as `step-<version>/` under
  `checkpoint_dir` (safetensors, the tokenizer copied from `tokenizer_from`, the `latest`
  pointer; the newest `keep` kept) and the version names that directory, which every replica
  must be able to read. A directory given instead of weights is published as it is.
- `broadcast`: the weights go from this process's memory to every replica that asks, over a
  process group (`weights.*`, gloo on CPU, NCCL on GPUs; `workers.weights`); no disk.
  Replicas started for broadcast serve nothing until they hold weights, so publish the weights
  you start from first (version 0, or the version you resume at). The publisher keeps a copy
  of the last version's tensors (one model's worth of memory, on their device) and a thread
  of its own serves every replica that asks for it later (one that started late or
  restarted) while your trainer goes on changing its weights; `close()` serves those still
  behind for at most the transfer's timeout. The process must stay up while replicas need
  its weights.

Weights: a `transformers` model (anything with `state_dict()`; `save_pretrained()` for the
checkpoint way), a state dict of tensors, or a saved model directory. Versions grow: the
first may be 0 (the starting weights), every later one is larger than the last.
"""

from __future__ import annotations

import logging
import shutil
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kafka.errors import KafkaError

from schemas.codec import encode, headers_for
from schemas.events import POLICY_KEY, PolicyVersion
from workers.kafka.clients import make_producer
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.weights.config import WeightsConfig
from workers.weights.exceptions import PublishError, WeightsError

if TYPE_CHECKING:
    from workers.weights.broadcast import BroadcastPublisher

__all__ = ["PolicyPublisher", "send_policy_version"]

log = logging.getLogger("rollout.trainer.publisher")

Mode = Literal["disk", "checkpoint", "broadcast"]

SERVE_EVERY_S = 0.5  # broadcast: how often the publisher looks for replicas that want weights


def send_policy_version(producer: Any, topics: TopicsConfig, event: PolicyVersion) -> None:
    """`event` on the policy topic (its one key, so compaction keeps the newest), waiting for
    the in-sync replicas' acknowledgement as long as the producer retries it (its
    `delivery_timeout_ms`: through a broker's loss and the election after); `PublishError`
    when it does not come."""
    future = producer.send(
        topics.name("policy"), key=POLICY_KEY, value=encode(event), headers=headers_for(event)
    )
    try:
        future.get(timeout=producer.config.get("delivery_timeout_ms", 120_000) / 1000 + 5.0)
    except KafkaError as exc:
        raise PublishError(f"PolicyVersion {event.version} not acknowledged: {exc}") from exc


class _Weights:
    """A state dict as the broadcast publisher takes a model: something with `state_dict()`."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, Any]:
        return self.tensors


class PolicyPublisher:
    """Publish policy versions of your own trainer (see the module docstring)."""

    def __init__(
        self,
        kafka: KafkaConfig,
        topics: TopicsConfig,
        *,
        mode: Mode = "disk",
        transfer: WeightsConfig | None = None,
        checkpoint_dir: str | Path = "checkpoints",
        tokenizer_from: str | Path | None = None,
        keep: int = 3,
    ) -> None:
        if mode not in ("disk", "checkpoint", "broadcast"):
            raise WeightsError(f"mode {mode!r}: one of disk (checkpoint) or broadcast")
        self.topics = topics
        self.mode: Mode = "disk" if mode == "checkpoint" else mode
        self.root = Path(checkpoint_dir).resolve()
        self.tokenizer_from = Path(tokenizer_from) if tokenizer_from is not None else None
        self.keep = keep
        self.version: int | None = None
        self._held: Any = None  # broadcast: the weights of the last version, for late replicas
        self._producer = make_producer(kafka, name="policy-publisher")
        self._broadcast: BroadcastPublisher | None = None
        self._lock = threading.Lock()  # one transfer at a time: publish's, or the server's
        self._closing = threading.Event()
        self._server: threading.Thread | None = None
        if self.mode == "broadcast":
            from workers.weights.broadcast import BroadcastPublisher

            session = f"publisher-{uuid.uuid4().hex[:12]}"
            self._broadcast = BroadcastPublisher(transfer or WeightsConfig(), session=session)

    @classmethod
    def from_config(
        cls, cfg: Any, *, tokenizer_from: str | Path | None = None, **kwargs: Any
    ) -> PolicyPublisher:
        """A publisher of the run `cfg` (a `RunConfig`): its Kafka, topics, weight transfer
        and checkpoint directory; the tokenizer from `trainer.model_dir` unless given."""
        tokenizer = tokenizer_from or cfg.trainer.model_dir or None
        settings: dict[str, Any] = {
            "mode": cfg.weights.mode,
            "transfer": cfg.weights,
            "checkpoint_dir": cfg.trainer.checkpoint_dir,
            "tokenizer_from": tokenizer,
            "keep": cfg.trainer.keep_checkpoints,
        }
        return cls(cfg.kafka, cfg.topics, **(settings | kwargs))

    def __enter__(self) -> PolicyPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def publish(
        self,
        weights: Any,
        version: int,
        *,
        groups_trained: int = 0,
        samples_trained: int = 0,
    ) -> PolicyVersion:
        """Send `weights` as `version` and publish it on the policy topic (acknowledged)."""
        if version < 0 or (self.version is not None and version <= self.version):
            raise WeightsError(f"version {version}: versions grow (last published: {self.version})")
        path = ""
        if self.mode == "disk":
            path = str(self._write(weights, version))
        event = PolicyVersion(
            version=version,
            path=path,
            groups_trained=groups_trained,
            samples_trained=samples_trained,
            transfer=self._broadcast.announcement if self._broadcast is not None else None,
        )
        send_policy_version(self._producer, self.topics, event)
        self.version = version
        if self._broadcast is not None:
            held = _Weights(
                {k: v.detach().clone() for k, v in _as_model(weights).state_dict().items()}
            )
            with self._lock:
                self._held = held
                self._broadcast.transfer(held, version)
            if self._server is None:
                self._server = threading.Thread(target=self._serve, daemon=True, name="serve")
                self._server.start()
        log.info("published version %d%s", version, f" ({path})" if path else " (broadcast)")
        return event

    def _serve(self) -> None:
        """Broadcast: send the last version to replicas that ask for it later (late or
        restarted ones), from the copy held, until `close()`."""
        assert self._broadcast is not None
        while not self._closing.wait(SERVE_EVERY_S):
            with self._lock:
                if self.version is not None:
                    self._broadcast.serve_waiting(self._held, self.version)

    def close(self) -> None:
        """Broadcast: serve the replicas still behind (at most the transfer's timeout), then
        stop serving; flush and close the producer."""
        self._closing.set()
        try:
            if self._server is not None:
                self._server.join()
            if self._broadcast is not None:
                if self.version is not None:
                    self._broadcast.finish(self._held, self.version)
                self._broadcast.close()
        finally:
            self._producer.close()

    # --- the checkpoint way -------------------------------------------------------------

    def _write(self, weights: Any, version: int) -> Path:
        """`step-<version>/` under `checkpoint_dir` with `latest` naming it; a directory given
        as the weights is returned as it is."""
        from workers.weights.checkpoint import TrainerState, prune, save_checkpoint

        if isinstance(weights, str | Path):
            return _model_dir(weights)
        if self.tokenizer_from is None:
            raise WeightsError(
                "publishing weights by checkpoint needs tokenizer_from (a model dir)"
            )
        state = TrainerState(version=version, source_model=str(self.tokenizer_from))
        model = (
            weights if hasattr(weights, "save_pretrained") else _Saved(weights, self.tokenizer_from)
        )
        path = save_checkpoint(self.root, state, model, tokenizer_from=self.tokenizer_from)
        prune(self.root, self.keep)
        return path


class _Saved:
    """A state dict that saves like a model: safetensors beside the base model's config."""

    def __init__(self, tensors: dict[str, Any], base: Path) -> None:
        self.tensors, self.base = tensors, base

    def save_pretrained(self, directory: str, safe_serialization: bool = True) -> None:
        from safetensors.torch import save_file

        from workers.weights.hub import unique_tensors

        tensors = {k: v.detach().contiguous().cpu() for k, v in unique_tensors(self.tensors)}
        save_file(tensors, str(Path(directory) / "model.safetensors"), metadata={"format": "pt"})
        for name in ("config.json", "generation_config.json"):
            if (self.base / name).is_file():
                shutil.copy2(self.base / name, Path(directory) / name)


def _model_dir(path: str | Path) -> Path:
    directory = Path(path).resolve()
    if not (directory / "config.json").is_file():
        raise WeightsError(f"{directory} is not a saved model (no config.json)")
    return directory


def _as_model(weights: Any) -> Any:
    """Something with `state_dict()`: a model as it is, a state dict wrapped, a directory's
    safetensors loaded."""
    if hasattr(weights, "state_dict"):
        return weights
    if isinstance(weights, dict):
        return _Weights(weights)
    from safetensors.torch import load_file

    files = sorted(_model_dir(weights).glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{weights} holds no .safetensors weights to broadcast")
    tensors: dict[str, Any] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return _Weights(tensors)
