"""Publishing by broadcast (`weights.mode: broadcast`): the trainer's transfers.

`BroadcastPublisher(config, session)` starts the trainer's `workers.weights.hub.TransferHub`;
the trainer puts `announcement` on every `PolicyVersion` it publishes (Kafka stays the control
plane: versions, counts and staleness are as with checkpoints) and then:

- `transfer(model, version)` right after publishing `version`: to every replica with a
  standing want (all that are alive: each posts its next want as soon as it has loaded);
- `serve_waiting(model, version)` between steps (the trainer polls an idle topic): to replicas
  that do not serve the version the trainer holds and published (one that started late or
  restarted, and waits, serving nothing), only while the weights are exactly that version;
- `checkpoint_due(version)`: checkpoints are still written every `checkpoint_every` versions,
  for resuming, and at the version after a transfer that a replica did not join: that replica
  is granted nothing until that version is published and takes it the checkpoint way (where it
  can read the checkpoint; else its standing want is served after);
- `finish(model, version)` at a clean stop: serves the replicas still behind (for at most
  `timeout_s`), since none can get weights from a trainer that is gone.

One trainer process only: a sharded trainer (nproc > 1) would first have to gather the full
weights on rank 0 every sync; it is refused at start.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from schemas.events import WeightTransfer
from workers.ports import check_reachable
from workers.weights.config import WeightsConfig
from workers.weights.exceptions import WeightsError
from workers.weights.hub import TransferHub, TransferReport, unique_tensors

__all__ = ["BroadcastPublisher"]

log = logging.getLogger("rollout.trainer.broadcast")

GRACE_S = 10.0  # at a stop, how long a replica loading an older version has to want the last


class BroadcastPublisher:
    """The trainer's side of `broadcast`; see the module docstring."""

    def __init__(self, config: WeightsConfig, *, session: str) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise WeightsError(
                "weights.mode=broadcast runs with one trainer process; "
                "with nproc > 1 use weights.mode=disk"
            )
        check_reachable(config.host, "weights.host")  # handed to every replica
        self.config = config
        self.hub = TransferHub(
            host=config.host,
            port=config.port,
            session=session,
            timeout_s=config.timeout_s,
            bucket_bytes=config.bucket_mb * 2**20,
            backend=config.backend,
        )
        self.published: int | None = None
        log.info("weight transfers from %s (session %s)", self.hub.address, session)

    @property
    def announcement(self) -> WeightTransfer:
        return WeightTransfer(
            address=self.hub.address, session=self.hub.session, backend=self.hub.backend
        )

    def checkpoint_due(self, version: int) -> bool:
        return version % self.config.checkpoint_every == 0 or bool(self.hub.benched)

    def transfer(self, model: Any, version: int) -> TransferReport:
        """Send `version` (just published) to every replica that waits for weights (only to
        those that lack it when `version` was published before: a re-publication)."""
        fresh, self.published = self.published != version, version
        report = self._send(model, version, self.hub.pending(None if fresh else version))
        if fresh:  # those benched took this version the checkpoint way; now these are
            self.hub.release(report.not_joined)
        return report

    def serve_waiting(self, model: Any, version: int) -> TransferReport | None:
        """Send the published `version` to replicas that lack it, if any (None if none, or if
        `model` no longer holds the published version)."""
        if self.published != version:
            return None
        wants = self.hub.pending(version)
        return self._send(model, version, wants) if wants else None

    def finish(self, model: Any, version: int) -> list[str]:
        """At a clean stop: a replica cannot get weights from a trainer that is gone, so serve
        those that still want them, and give those loading an older version (granted, not yet
        wanting again) up to `GRACE_S` to ask for this one; the ones still behind after
        (gone, mostly), never longer than `timeout_s` in all."""
        started = time.monotonic()
        while True:
            self.serve_waiting(model, version)
            behind = self.hub.behind(version)
            waited = time.monotonic() - started
            if not behind or waited > self.config.timeout_s:
                break
            if waited > min(GRACE_S, self.config.timeout_s) and not self.hub.pending(version):
                break
            time.sleep(0.1)
        if behind:
            log.warning("stopping with replicas not at version %d: %s", version, behind)
        return behind

    def _send(self, model: Any, version: int, wants: list[Any]) -> TransferReport:
        report = self.hub.send(unique_tensors(model.state_dict()), version, wants)
        self.hub.benched |= set(report.not_joined)
        if wants:
            log.info(
                "version %d to %d replicas in %.2fs (%.1f MB, %d buckets; open %.2fs, pack "
                "%.2fs, send %.2fs)%s",
                version,
                len(report.receivers),
                report.seconds,
                report.bytes / 1e6,
                report.buckets,
                report.open_s,
                report.pack_s,
                report.send_s,
                f"; dropped {sorted(report.dropped)} (did not join: {report.not_joined}; "
                f"so far {self.hub.counts})"
                if report.dropped
                else "",
            )
        return report

    def close(self) -> None:
        self.hub.close()
