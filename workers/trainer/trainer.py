"""The off-policy trainer: `rl.replay` → PPO steps → checkpoints → `PolicyVersion` on `rl.policy`.

Loop: collect `train_batch_size` groups from the replay topic (through `TrajectoryConsumer`,
all partitions assigned), re-checking each group's staleness against the trainer's own
version (`schemas.stale`: `too_stale(staleness(version, group.min_global_steps),
max_staleness)` → the stale topic, keyed by uid, original bytes, `drop_headers`) and skipping
groups already trained (dedup by uid and attempt ids, remembered across restarts) → one
optimiser step (`workers.trainer.step`) → one line in the step log → every `sync_every`
steps: checkpoint (weights + optimizer + the consumer positions the weights cover), publish
`PolicyVersion(version, path, groups_trained, samples_trained)` (acks=all, key "policy"),
commit the same positions to the group. With `weights.mode: broadcast`
(`workers.weights.broadcast`) every `PolicyVersion` also carries where the trainer's
rendezvous store listens, the weights go to the waiting replicas over a process group right
after it is published, and a checkpoint is written every `weights.checkpoint_every`
versions only (positions are committed only with one).

Guarantees:
- Exactly once into the weights. A checkpoint's positions are those after the last record of
  its last step, so restarting from it resumes after exactly the records its weights reflect.
  Steps after the last checkpoint of a process that dies are lost with it, and their groups
  are trained again from the checkpoint's weights (`metrics.effective_steps` rebuilds the
  effective history from the step log). A batch being collected when the trainer stops is
  never trained and never covered by a checkpoint.
- A group that cannot train (an image gone from the media store, or one that does not decode:
  `images.BatchImages.check`) is dead-lettered with its cause (`image_missing`, ...) as it is
  collected, and the batch fills with the next groups.
- Stale groups are acknowledged by the broker before any checkpoint covers their offsets.
  Drops (stale, duplicate) that precede a half-collected batch are persisted when the topic
  goes quiet or the trainer stops (`ledger.Pending.settle_drops`): a full checkpoint if
  steps are unsaved, else the latest checkpoint's state rewritten in place (same weights),
  and the same version re-published with the new counts.
- `PolicyVersion.groups_trained`/`samples_trained` count what the trainer has *consumed*
  (trained, dropped as stale, skipped as duplicate): the agent-loop admission gate needs
  consumed, or every dropped group would hold its capacity for ever.
- A clean stop (stop event, `max_steps`, `idle_timeout_s`) checkpoints and publishes what
  was trained since the last checkpoint.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kafka.errors import KafkaError

from schemas.events import PolicyVersion, TrainingGroup
from schemas.stale import drop_headers, staleness, too_stale
from workers.kafka.admin import missing_topics
from workers.kafka.clients import ack_wait_s, make_producer
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.metrics import TrainerMetrics
from workers.stopping import StopSignal
from workers.trainer.config import TrainerConfig
from workers.trainer.consumer import Item, TrajectoryConsumer
from workers.trainer.exceptions import (
    CheckpointError,
    PublishError,
    RunFinishedError,
    TrainerError,
)
from workers.trainer.ledger import DedupWindow, Pending, apply_entries, dedup_key
from workers.trainer.steplog import StepLog, staleness_histogram
from workers.weights.checkpoint import (
    TrainerState,
    load_latest,
    load_optimizer,
    prune,
    save_checkpoint,
    update_state,
)
from workers.weights.config import WeightsConfig
from workers.weights.publish import send_policy_version

if TYPE_CHECKING:
    from workers.kafka.dlq import KafkaDeadLetters
    from workers.trainer.images import BatchImages
    from workers.trainer.lend import Lender
    from workers.weights.broadcast import BroadcastPublisher

__all__ = ["Trainer", "TrainerResult", "run_trainer"]

log = logging.getLogger("rollout.trainer")


@dataclass
class TrainerResult:
    """What one run of the trainer did (returned by `run`)."""

    version: int
    steps: int
    checkpoints: list[str] = field(default_factory=list)
    stopped_by: str = ""


class Trainer:
    """`Trainer(kafka, topics, config).run()`; see the module docstring."""

    def __init__(
        self,
        kafka: KafkaConfig,
        topics: TopicsConfig,
        config: TrainerConfig,
        *,
        stop_event: threading.Event | None = None,
        metrics: TrainerMetrics | None = None,
        transfer: WeightsConfig | None = None,
    ) -> None:
        self.kafka, self.topics, self.config = kafka, topics, config
        self.metrics = metrics or TrainerMetrics()
        self.stop_event = stop_event or threading.Event()
        self.root = Path(config.checkpoint_dir).resolve()
        self.run_id = uuid.uuid4().hex[:12]
        self.transfer = transfer or WeightsConfig()
        self.publisher: BroadcastPublisher | None = None  # weights.mode=broadcast
        self.lender: Lender | None = None  # lend.enable: the idle trainer serves generation
        self.images: BatchImages | None = None  # built at the first group with images
        self.dead_letters: KafkaDeadLetters | None = None  # built at the first dead letter

    # --- setup ------------------------------------------------------------------------

    def _load(self) -> None:
        import torch

        from workers.trainer.step import resolve_device

        torch.set_num_threads(self.config.torch_threads)
        torch.manual_seed(self.config.seed)
        ckpt = load_latest(self.root)
        if ckpt is None and not self.config.model_dir:
            raise CheckpointError("no checkpoint in checkpoint_dir and no model_dir configured")
        if ckpt is None and not (Path(self.config.model_dir) / "config.json").is_file():
            raise CheckpointError(
                f"no checkpoint in {self.root}, and model_dir {self.config.model_dir} is not a "
                "model directory (no config.json; `rollout model init --out DIR` writes one)"
            )
        self.source = ckpt.path if ckpt is not None else Path(self.config.model_dir)
        self.state = ckpt.state if ckpt is not None else TrainerState(source_model=str(self.source))
        self.device = resolve_device(self.config.device)
        self._build_model(ckpt)
        from workers.trainer.router_replay import check_router_replay

        # r3 on a dense model is refused here, before anything is consumed.
        log.info("routing: %s", check_router_replay(self.model, self.config.router_replay))
        self.zero_advantage_steps = 0
        pad = self.model.config.get_text_config().pad_token_id  # a VL model: its LM's
        self.pad_token_id = int(pad) if pad is not None else 0
        self.recent = DedupWindow(self.state.recent_groups, self.config.dedup_window)
        self.checkpointed: int | None = self.state.version if ckpt is not None else None
        if ckpt is not None:
            log.warning("resuming from %s (version %d)", ckpt.path, self.state.version)
        log.info(
            "trainer %s starts at version %d from %s on %s (positions %s)",
            self.run_id,
            self.state.version,
            self.source,
            self.device,
            self.state.positions,
        )

    def _refuse_finished(self) -> None:
        """A run whose latest checkpoint is already at `max_steps` has nothing to train: one
        line and a non-zero exit, before the model loads (a run that resumed another's
        checkpoints and "trained" 0 steps exited 0 before)."""
        ckpt = load_latest(self.root)
        limit = self.config.max_steps
        if ckpt is not None and limit is not None and ckpt.state.version >= limit:
            raise RunFinishedError(
                f"{ckpt.path} is already at version {ckpt.state.version}, trainer.max_steps "
                f"is {limit}: nothing to train; --steps above {ckpt.state.version} continues "
                "this run, another topics.prefix (or checkpoint_dir) starts a new one"
            )

    def _build_model(self, ckpt: Any) -> None:
        """The policy, its AdamW (restored from `ckpt` if given) and the frozen reference.

        A hook: `workers.trainer.sharded` builds the same three sharded over ranks."""
        import torch

        from workers.trainer.images import load_policy

        model = load_policy(self.source, dtype=torch.float32)  # a vision-language one too
        self.model = model.to(self.device)  # before AdamW, whose state follows the parameters
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.config.lr,
            betas=self.config.betas,
            weight_decay=self.config.weight_decay,
        )
        if ckpt is not None and not load_optimizer(self.optimizer, ckpt.path):
            log.warning("checkpoint %s has no optimizer state; AdamW starts fresh", ckpt.path)
        self.ref_model = None
        if self.config.kl_coef > 0:
            # The reference is the model the run started from, also after a restart.
            ref = load_policy(self.state.source_model or self.config.model_dir, dtype=torch.float32)
            self.ref_model = ref.to(self.device).eval().requires_grad_(False)

    def _train(self, batch: Any) -> dict[str, Any]:
        """One optimiser step on the collated batch (a hook, like `_build_model`)."""
        from workers.trainer.step import train_step

        return train_step(self.model, self.optimizer, batch, self.config, ref_model=self.ref_model)

    def _attach_images(self, batch: Any) -> Any:
        """`batch` with the pixel values of its images (a hook, like `_train`: the sharded
        trainer sends them to its other ranks, which read no store)."""
        return self._batch_images().attach(batch)

    def _save(self, state: TrainerState) -> Path:
        """Write the checkpoint of `state` with the current weights (a hook, like `_train`)."""
        return save_checkpoint(
            self.root, state, self.model, tokenizer_from=self.source, optimizer=self.optimizer
        )

    # --- the loop ---------------------------------------------------------------------

    def run(self) -> TrainerResult:
        # Before the model loads (seconds to minutes): a missing topic is the user's to fix.
        roles = ("replay", "policy", "stale", "dlq")
        if missing := missing_topics(self.kafka, [self.topics.name(role) for role in roles]):
            raise TrainerError(f"no topic {', '.join(missing)} (run `rollout topics create`)")
        self._refuse_finished()
        self._load()
        self.metrics.watch(policy_version=lambda: self.state.version)
        result = TrainerResult(version=self.state.version, steps=0)
        self.steplog = StepLog(self.config.metrics_path)
        self.producer = make_producer(self.kafka, name="trainer")
        self.consumer = TrajectoryConsumer(
            self.kafka,
            self.topics,
            topic="replay",
            group_id=self.config.group_id,
            assign=True,
            positions=self.state.positions,
            name="trainer",
            metrics=self.metrics,
        )
        if self.transfer.mode == "broadcast":
            from workers.weights.broadcast import BroadcastPublisher

            self.publisher = BroadcastPublisher(self.transfer, session=self.run_id)
            # Replicas learn where to ask and wait for the weights the trainer holds now.
            self._publish(str(self.source) if self.checkpointed is not None else "")
        if self.config.lend.enable:
            self._start_lending()
        if isinstance(self.stop_event, StopSignal):
            self.stop_event.graceful()  # from here a stop has work to finish cleanly
        self.steplog.write(
            {
                "event": "start",
                "run": self.run_id,
                "version": self.state.version,
                "source": str(self.source),
                "positions": self.consumer.positions(),
                "time": time.time(),
            }
        )
        try:
            while True:
                if (
                    self.config.max_steps is not None
                    and self.state.version >= self.config.max_steps
                ):
                    result.stopped_by = "max_steps"
                    break
                pending = self._collect()
                if pending is None:
                    result.stopped_by = "stop_event" if self.stop_event.is_set() else "idle"
                    break
                self._step(pending)
                result.steps += 1
                if self.lender is not None and self.state.version != self.config.max_steps:
                    # Lent before the version is published: the routers add the lent engine
                    # while the replicas load the weights, before the gate admits the groups
                    # this version frees (issue 30: lent after it, it missed many of them).
                    self.lender.tend(0, self.state.version, self.consumer.backlog)
                if self.state.version % self.config.sync_every == 0:
                    publisher, version = self.publisher, self.state.version
                    due = publisher is None or publisher.checkpoint_due(version)
                    if path := self._sync(checkpoint=due):
                        result.checkpoints.append(path)
            if self.checkpointed is None or self.state.version > self.checkpointed:
                if self.state.version > 0:
                    result.checkpoints.append(self._sync())
            if self.publisher is not None:  # a clean stop leaves no live replica behind
                self.publisher.finish(self.model, self.state.version)
        finally:
            if self.lender is not None:  # withdrawn (tombstone) while the producer lives
                self.lender.close()
            if self.publisher is not None:
                self.publisher.close()
            self.consumer.close()
            self.producer.flush(timeout=ack_wait_s(self.kafka))
            self.producer.close()
            self.steplog.close()
        result.version = self.state.version
        log.info(
            "trainer %s stopped (%s) at version %d", self.run_id, result.stopped_by, result.version
        )
        return result

    def _collect(self) -> Pending | None:
        """Groups for one step, or None when stopping (the partial batch is abandoned)."""
        pending = Pending()
        idle_since = time.monotonic()
        version = self.state.version
        while len(pending.train) < self.config.train_batch_size:
            if self.lender is not None:  # lent while few groups are ready, back once enough
                self.lender.tend(len(pending.train), version, self.consumer.backlog)
            if self.stop_event.is_set():
                self._settle_drops(pending)
                return None
            item = self.consumer.next_item(self.config.poll_timeout_s)
            if item is None:
                if pending.has_drops():
                    self._settle_drops(pending)
                if self.publisher is not None:  # replicas that started late or restarted
                    self.publisher.serve_waiting(self.model, self.state.version)
                idle = self.config.idle_timeout_s
                if idle is not None and time.monotonic() - idle_since > idle:
                    return None
                continue
            idle_since = time.monotonic()
            group: TrainingGroup = item.event
            key = dedup_key(group)
            if key in self.recent or key in pending.keys:
                log.info("skipping trained group %s (%s@%d)", group.uid, item.topic, item.offset)
                pending.add(item, "duplicate", key)
                continue
            lag = staleness(version, group.min_global_steps)
            if too_stale(lag, self.config.max_staleness) and self.config.stale_policy == "drop":
                pending.futures.append(self._send_stale(item, lag))
                pending.add(item, "stale", key)
                if pending.drop_count() >= self.config.train_batch_size:
                    self._settle_drops(pending)  # a long run of drops still reaches the gate
                continue
            if any(s.images for s in group.samples) and (
                error := self._batch_images().check(group)
            ):
                pending.futures.append(self._dead_letter(item, error))
                pending.add(item, "dead_letter", key)
                if pending.drop_count() >= self.config.train_batch_size:
                    self._settle_drops(pending)
                continue
            pending.add(item, "train", key)
        self._await_stale(pending)
        return pending

    def _start_lending(self) -> None:
        """Hybrid mode: the replica on the live model (`workers.trainer.lend`), not lent yet."""
        from workers.trainer.lend import Lender

        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: a sharded policy
            raise TrainerError("trainer.lend runs with one trainer process, not a sharded world")
        if self.device.type != "cpu":  # README "Hybrid lending": why not on a GPU yet
            raise TrainerError(
                f"trainer.lend on {self.device}: the lent engine is the hf engine on the "
                "trainer's own CPU weights; lending a GPU needs a vLLM engine in the trainer's "
                "process that sleeps while it steps (vLLM's /sleep, /wake_up), which is not "
                "built: lend a CPU trainer, or run vLLM replicas on other GPUs"
            )
        self.lender = Lender(
            self.config.lend,
            self.kafka,
            self.topics,
            self.producer,
            model=self.model,
            model_dir=str(self.source),
            version=self.state.version,
            threads=self.config.torch_threads,
            train_batch_size=self.config.train_batch_size,
        )

    def _await_stale(self, pending: Pending) -> None:
        for future in pending.futures:
            try:
                future.get(timeout=ack_wait_s(self.kafka))
            except KafkaError as exc:
                raise PublishError(f"stale group not acknowledged: {exc}") from exc
        pending.futures.clear()

    def _settle_drops(self, pending: Pending) -> None:
        """Persist the drops that precede the half-collected batch (see `ledger`)."""
        self._await_stale(pending)
        settled, positions = pending.settle_drops(self.consumer.positions())
        if not settled:
            return
        apply_entries(self.state, settled, positions)
        self.recent.add(e.key for e in settled)
        if self.checkpointed is None or self.state.version > self.checkpointed:
            self._sync()
        else:
            self._sync(state_only=True)

    def _send_stale(self, item: Item, lag: int) -> Any:
        version = self.state.version
        log.info(
            "stale group %s from %s[%d]@%d: staleness %d > %s at version %d",
            item.event.uid,
            item.topic,
            item.partition,
            item.offset,
            lag,
            self.config.max_staleness,
            version,
        )
        headers = drop_headers(item.headers, "stale", lag, trainer_version=version)
        self.metrics.produced(self.topics.name("stale"))
        return self.producer.send(
            self.topics.name("stale"), key=item.event.uid, value=item.value, headers=headers
        )

    def _batch_images(self) -> BatchImages:
        if self.images is None:
            from workers.trainer.images import BatchImages

            self.images = BatchImages(self.config.media, self.config.model_dir)
        return self.images

    def _dead_letter(self, item: Item, error: Exception) -> Any:
        """Send `item` to the dead-letter topic with `error`'s cause; the send's future."""
        if self.dead_letters is None:
            from workers.kafka.dlq import KafkaDeadLetters

            dlq = self.topics.name("dlq")
            self.dead_letters = KafkaDeadLetters(
                self.producer, dlq, stage="trainer", metrics=self.metrics
            )
        return self.dead_letters.send_record(item, error)

    def _step(self, pending: Pending) -> None:
        from workers.trainer.batching import collate_groups

        version = self.state.version
        groups: list[TrainingGroup] = [i.event for i in pending.train]
        lags = [staleness(version, g.min_global_steps) for g in groups]
        batch = collate_groups(groups, pad_token_id=self.pad_token_id).to(self.device)
        if batch.images is not None:  # a vision-language policy: the rollout's pixels again
            batch = self._attach_images(batch)
        routed = batch.routed_experts or []
        if self.config.router_replay == "r3" and sum(r is not None for r in routed) < len(batch):
            # Not fatal (those samples are routed live), but replay is then not what runs.
            log.warning(
                "step %d: router_replay=r3, but %d of %d samples carry no routed experts "
                "(are the replicas asked for them?); routed live",
                version + 1,
                len(batch) - sum(r is not None for r in routed),
                len(batch),
            )
        started = time.monotonic()
        if self.lender is None:
            metrics = self._train(batch)
        else:
            with self.lender.training():  # withdrawn and idle: nothing forwards meanwhile
                metrics = self._train(batch)
        if metrics["zero_advantage"]:
            self.zero_advantage_steps += 1
            log.warning(
                "step %d: every advantage is 0 (%d such steps): the policy gradient is empty, "
                "only the KL and entropy terms move the policy; rewards %s",
                version + 1,
                self.zero_advantage_steps,
                sorted({s.reward_score for g in groups for s in g.samples}),
            )
        spans = [
            hi - lo + 1
            for lo, hi in zip(batch.min_global_steps, batch.max_global_steps, strict=True)
        ]
        st = self.state
        st.version = version + 1
        drops = [e for e in pending.entries if e.kind != "train"]
        shaped = [s.reward_score for g in groups for s in g.samples]
        # The task's own score: the reward stage's shaping (the overlong penalty) taken out.
        scores = [
            s.reward_score - float(s.reward_extra.get("overlong_penalty", 0.0))
            for g in groups
            for s in g.samples
        ]
        apply_entries(st, pending.entries, self.consumer.positions())
        self.recent.add(e.key for e in pending.entries)
        record = {
            "event": "step",
            "run": self.run_id,
            "step": st.version,
            "time": time.time(),
            "step_time_s": time.monotonic() - started,
            **metrics,
            "groups": len(groups),
            "samples": len(batch),
            "reward_mean": sum(scores) / len(scores),
            "shaped_reward_mean": sum(shaped) / len(shaped),
            "zero_advantage_steps": self.zero_advantage_steps,
            "truncated_frac": float(batch["truncated"].float().mean()),
            "stale_dropped": sum(e.kind == "stale" for e in drops),
            "duplicates_skipped": sum(e.kind == "duplicate" for e in drops),
            "dead_lettered": sum(e.kind == "dead_letter" for e in drops),
            "staleness_hist": staleness_histogram(lags),
            "trajectory_spans_mean": sum(spans) / len(spans),
            "trajectory_spans_max": max(spans),
            "trajectory_ids": batch.trajectory_ids,
            "uids": [g.uid for g in groups],
        }
        self.steplog.write(record)
        if self.lender is not None:
            self.steplog.write({"event": "lend", "step": st.version, **self.lender.counters()})
        self.metrics.step(metrics, record["reward_mean"])
        for lag in lags:
            self.metrics.observe_staleness(lag)
        log.info(
            "step %d: loss %.4f clipfrac %.3f ppo_kl %.4f is_w mean %.4f [%.4f, %.4f] "
            "entropy %.3f staleness %s groups %d",
            st.version,
            metrics["loss"],
            metrics["pg_clipfrac"],
            metrics["ppo_kl"],
            metrics["is_weight_mean"],
            metrics["is_weight_min"],
            metrics["is_weight_max"],
            metrics["entropy"],
            record["staleness_hist"],
            len(groups),
        )

    def _sync(self, *, state_only: bool = False, checkpoint: bool = True) -> str:
        """Checkpoint (or, with `state_only`, rewrite the latest one's state; without
        `checkpoint`, neither: weights by broadcast only), publish the version with the
        consumed counts, commit the positions a checkpoint covers, send the weights (broadcast).
        Returns the checkpoint's path ("" when none was written)."""
        st = self.state
        st.recent_groups = self.recent.to_list()
        path: Path | None = None
        if state_only:
            path = self.root / f"step-{st.version}"
            update_state(path, copy.copy(st))
        elif checkpoint:
            path = self._save(copy.copy(st))
            self.checkpointed = st.version
            # The tokenizer files of the next checkpoint come from this one: the checkpoint
            # a restarted trainer resumed from is pruned a few checkpoints later.
            self.source = path
            prune(self.root, self.config.keep_checkpoints)
        self._publish(str(path) if path is not None else "")
        if path is not None:
            self.consumer.commit(st.positions)
        transfer = None
        if self.publisher is not None and not state_only:
            transfer = asdict(self.publisher.transfer(self.model, st.version))
        self.steplog.write(
            {
                "event": "checkpoint",
                "run": self.run_id,
                "version": st.version,
                "path": str(path) if path is not None else "",
                "state_only": state_only,
                "positions": st.positions,
                "groups_consumed": st.groups_consumed,
                "time": time.time(),
                **({"transfer": transfer} if transfer is not None else {}),
            }
        )
        log.info("published version %d (%s), positions %s", st.version, path, st.positions)
        return str(path) if path is not None else ""

    def _publish(self, path: str) -> None:
        """`PolicyVersion` of the current state on the policy topic, acknowledged."""
        st = self.state
        event = PolicyVersion(
            version=st.version,
            path=path,
            groups_trained=st.groups_consumed,
            samples_trained=st.samples_consumed,
            transfer=self.publisher.announcement if self.publisher is not None else None,
        )
        send_policy_version(self.producer, self.topics, event)
        self.metrics.produced(self.topics.name("policy"))
        if self.publisher is not None and self.publisher.published is None:
            self.publisher.published = st.version  # at start: the weights held are this version


def run_trainer(
    kafka: KafkaConfig,
    topics: TopicsConfig,
    config: TrainerConfig,
    stop_event: Any = None,
    **kw: Any,
) -> TrainerResult:
    """Run the trainer until stopped (stop event, `max_steps` or `idle_timeout_s`); `kw`: the
    rest of `Trainer`'s keywords (`metrics`, `transfer`)."""
    return Trainer(kafka, topics, config, stop_event=stop_event, **kw).run()
