"""Helpers of the broadcast weight-transfer tests: replicas in directory trees of their own
that cannot read the trainer's, driven through the real `rollout replica serve|sync`.

Isolation: every process here runs as one user, so file modes alone would let a replica read
the trainer's checkpoints. The replicas are started without the two capabilities that let
root bypass file modes (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, dropped from the bounding set
before exec), and the trainer's tree is made mode 000: the test process, which keeps them,
still writes and reads there; the replicas get EACCES (`cannot_read` proves it per test).
Where that cannot be arranged (not root), the tests that need it skip, saying why.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO
from tests.http import http
from workers.ports import free_port

_PR_CAPBSET_DROP = 24
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2


def load_model(path: Path) -> Any:
    """A checkpoint as the trainer holds it: transformers, fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def drop_file_capabilities() -> None:
    """preexec_fn: this child (and what it runs) can no longer bypass file modes."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def cannot_read(path: Path) -> bool:
    """Whether a process started like the replicas gets EACCES listing `path`."""
    probe = (
        f"import os, sys\ntry:\n os.listdir({str(path)!r})\nexcept PermissionError:\n sys.exit(7)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], preexec_fn=drop_file_capabilities, check=False
    )
    return done.returncode == 7


def hide(path: Path) -> None:
    """Make `path` unreadable to the replicas (mode 000), or skip when that cannot hold."""
    if os.geteuid() != 0:
        pytest.skip("replicas that cannot read the trainer's files need root (to drop caps)")
    path.chmod(0)
    if not cannot_read(path):
        path.chmod(0o700)
        pytest.skip("cannot drop CAP_DAC_OVERRIDE here: the replicas could read the trainer's")


class ReplicaTree:
    """One hf replica and its sync controller, in `root/name` (cwd, TMPDIR, model copy, config),
    unable to read what `hide` hid."""

    def __init__(
        self,
        root: Path,
        name: str,
        model: Path,
        bootstrap: str,
        prefix: str,
        *serve_args: str,
        backend: str = "hf",
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.backend, self.serve_args, self.env = backend, serve_args, env or {}
        self.dir = root / name
        self.dir.mkdir(parents=True)
        # Its own TMPDIR, short: vLLM binds ZeroMQ IPC sockets under it, and a socket path past
        # 107 bytes (pytest's tmp_path is deep) stops vLLM from starting.
        self.tmp = Path(tempfile.mkdtemp(prefix=f"rollout-{name}-"))
        self.model = self.dir / "model"
        shutil.copytree(model, self.model)
        self.config = self.dir / "run.yaml"
        self.config.write_text(
            yaml.safe_dump(
                {
                    "kafka": {"bootstrap_servers": bootstrap},
                    "topics": {"prefix": prefix},
                    "weights": {"mode": "broadcast"},
                }
            )
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.replica: subprocess.Popen[bytes] | None = None
        self.sync: subprocess.Popen[bytes] | None = None

    def _spawn(self, what: str, *argv: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, **self.env, "PYTHONPATH": str(REPO), "TMPDIR": str(self.tmp)}
        with (self.dir / f"{what}.log").open("ab") as log:
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pipeline.cli.main",
                    "-v",
                    "--config",
                    str(self.config),
                    *argv,
                ],
                cwd=self.dir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=drop_file_capabilities,
                start_new_session=True,
            )

    def start_replica(self) -> None:
        self.replica = self._spawn(
            "replica",
            "replica",
            "serve",
            "--backend",
            self.backend,
            "--model",
            str(self.model),
            "--port",
            str(self.port),
            "--replica-id",
            self.name,
            "--threads",
            "1",
            *self.serve_args,
        )

    def start_sync(self) -> None:
        self.sync = self._spawn("sync", "replica", "sync", "--replica", self.url)

    def health(self) -> tuple[int, Any]:
        return http(self.url + "/health", timeout=5)

    def serves(self, version: int) -> bool:
        """Whether it answers `/health` with 200 at `version`."""
        status, body = self.health()
        return status == 200 and body["version"] == version

    def awaits_weights(self) -> bool:
        """Whether it is up and serves nothing until it holds the trainer's weights."""
        status, body = self.health()
        return status == 503 and bool(body.get("awaiting_weights"))

    def wait_version(self, version: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.serves(version):
                return
            if self.replica is not None and self.replica.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.tail()}")
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not at version {version}: {self.health()} {self.tail()}")

    def complete(self, prompt: list[int], seed: int) -> tuple[list[int], list[float], int]:
        status, body = http(
            self.url + "/v1/completions",
            {
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 1.0,
                "seed": seed,
                "logprobs": 0,
                "ignore_eos": True,
            },
            timeout=120,
        )
        assert status == 200, body
        (choice,) = body["choices"]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"], body["policy_version"]

    def tail(self, chars: int = 3000) -> str:
        return "".join(
            f"\n--- {log.name}\n{log.read_text(errors='replace')[-chars:]}"
            for log in sorted(self.dir.glob("*.log"))
        )

    def kill_replica(self, sig: int = signal.SIGKILL) -> None:
        if self.replica is not None and self.replica.poll() is None:
            os.killpg(self.replica.pid, sig)

    def stop(self) -> None:
        for proc in (self.sync, self.replica):
            if proc is None or proc.poll() is not None:
                continue
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        shutil.rmtree(self.tmp, ignore_errors=True)


class TestTrainer:
    """The trainer's publishing path at each sync, driven by a test with weights of its
    choosing: a checkpoint in `root` (which `hide` keeps from the replicas), `PolicyVersion`
    on the policy topic, the broadcast (`BroadcastPublisher.transfer`), then
    `serve_waiting` until every replica serves the version (one whose want was not standing
    yet gets it there, as between the real trainer's steps)."""

    __test__ = False  # not a test class

    def __init__(
        self, kafka: Any, topics: Any, root: Path, tokenizer_from: Path, timeout_s: float = 60
    ) -> None:
        import uuid

        from workers.kafka.clients import make_producer
        from workers.weights.broadcast import BroadcastPublisher
        from workers.weights.config import WeightsConfig

        self.root, self.tokenizer_from, self.topic = root, tokenizer_from, topics.name("policy")
        config = WeightsConfig(timeout_s=timeout_s, bucket_mb=1)
        self.publisher = BroadcastPublisher(config, session=uuid.uuid4().hex[:12])
        self.producer = make_producer(kafka, name="test-trainer")

    def publish(
        self, version: int, model: Any, replicas: list[ReplicaTree], timeout_s: float = 300
    ) -> tuple[list[str], list[str]]:
        """Version `version` = `model` to every replica; (who received it, who was dropped)."""
        from schemas.codec import encode, headers_for
        from schemas.events import PolicyVersion
        from workers.weights.checkpoint import TrainerState, save_checkpoint

        path = save_checkpoint(
            self.root, TrainerState(version=version), model, tokenizer_from=self.tokenizer_from
        )
        event = PolicyVersion(version=version, path=str(path), transfer=self.publisher.announcement)
        self.producer.send(
            self.topic, key="policy", value=encode(event), headers=headers_for(event)
        ).get(timeout=30)
        reports = [self.publisher.transfer(model, version)]
        deadline = time.monotonic() + timeout_s
        while not all(r.serves(version) for r in replicas):
            assert time.monotonic() < deadline, [(r.name, r.health()) for r in replicas]
            if report := self.publisher.serve_waiting(model, version):
                reports.append(report)
            time.sleep(0.1)
        return sorted(x for r in reports for x in r.receivers), [
            x for r in reports for x in r.dropped
        ]

    def close(self) -> None:
        self.producer.close()
        self.publisher.close()


def four_updates(
    replicas: list[ReplicaTree],
    trainer: TestTrainer,
    weights: dict[str, Any],
    prompt: list[int],
    tolerance: float,
    startup_s: float,
) -> list[str]:
    """Acceptance (a): the replicas wait, serving nothing, then hold the trainer's version 0
    (weights `v0`), then A → B → A → B as versions 1-4; after each, every replica reports the
    version and its logprobs of `prompt` equal a forward pass of the trainer's weights within
    `tolerance`, and are off the previous weights by more than 0.05. Returns the figures."""
    from tests.integration.trainer_helpers import behaviour_logprobs

    def diff(model: Any, tokens: list[int], logprobs: list[float]) -> float:
        ref = behaviour_logprobs(model, prompt, tokens)
        return max(abs(a - b) for a, b in zip(ref, logprobs, strict=True))

    deadline = time.monotonic() + startup_s
    while not all(r.awaits_weights() for r in replicas):
        assert time.monotonic() < deadline, [(r.health(), r.tail()) for r in replicas]
        for replica in replicas:
            assert replica.replica is not None and replica.replica.poll() is None, replica.tail()
        time.sleep(0.5)
    lines = []
    previous = "v0"
    for version, name in enumerate(["v0", "A", "B", "A", "B"]):
        started = time.monotonic()
        receivers, dropped = trainer.publish(version, weights[name], replicas)
        took = time.monotonic() - started
        assert not dropped and (version == 0 or receivers == sorted(r.url for r in replicas))
        for replica in replicas:
            tokens, logprobs, served = replica.complete(prompt, seed=version)
            assert served == version == replica.health()[1]["version"]
            error = diff(weights[name], tokens, logprobs)
            assert error <= tolerance, f"{replica.name} v{version}={name}: {error:.3g}"
            line = f"{replica.name} version {version} = {name}: max abs diff {error:.2g}"
            if version > 0:
                stale = diff(weights[previous], tokens, logprobs)
                assert stale > 0.05, f"{replica.name} still serves {previous} ({stale:.3g})"
                line += f" (to {previous}: {stale:.2g})"
            lines.append(f"{line}; published to all loaded in {took:.2f}s")
        previous = name
    # No replica ever had a checkpoint it could read: every load came over a group.
    for replica in replicas:
        loads = [
            ln
            for ln in (replica.dir / "sync.log").read_text().splitlines()
            if "now serves version" in ln
        ]
        assert len(loads) == 5 and all("from broadcast" in ln for ln in loads), loads
    return lines
