"""Broadcast weight transfers that go wrong, with receivers in processes of their own (gloo).

The trainer's side is the real `TransferHub` in this process; each receiver is a real process
(`tests/integration/transfer_receiver.py`) that wants, is granted, and receives bucket by
bucket into live weights of the dtype it serves. What must hold:

- a granted receiver that never joins: the trainer's transfer ends within the timeout, the
  others get the version, the one that did not join is counted as such (and benched until
  the next version), and no group was ever opened with it;
- a receiver killed mid-transfer: the trainer goes on, the others get the version;
- the trainer killed mid-transfer: the receiver's next bucket raises within the timeout (its
  group aborted), in the receiver's own thread: it loses that update, never its process;
- a slow receiver: in the store's order (every mark is numbered by one counter), each
  bucket is marked only after it is complete, and `received` only after its last bucket was
  loaded;
- a receiver serving bf16 gets bf16 bytes (half the trainer's fp32) and its peak extra memory
  (resident set, measured) stays within two buckets, while the whole model is 8 buckets.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.conftest import REPO
from workers.weights.group import store_client
from workers.weights.hub import TransferHub, unique_tensors

pytestmark = [pytest.mark.slow]

TIMEOUT_S = 6.0


def _model(tensors: int, shape: tuple[int, int], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}.weight": torch.randn(*shape, generator=g) for i in range(tensors)}


class Receivers:
    """Receiver processes of one hub, each with its result file."""

    def __init__(self, hub: TransferHub, model: dict[str, torch.Tensor], tmp: Path) -> None:
        self.hub, self.tmp = hub, tmp
        self.layout = tmp / "layout.json"
        self.layout.write_text(json.dumps({n: list(t.shape) for n, t in model.items()}))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, mode: str = "normal", dtype: str = "float32") -> None:
        argv = [sys.executable, "-m", "tests.integration.transfer_receiver"]
        argv += ["--address", self.hub.address, "--session", self.hub.session]
        argv += ["--replica", name, "--layout", str(self.layout), "--dtype", dtype]
        argv += ["--mode", mode, "--out", str(self.tmp / f"{name}.json")]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # freed buffers leave the resident set
        log = (self.tmp / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wanting(self, names: list[str], timeout_s: float = 60) -> list[Any]:
        """The hub's pending wants once every one of `names` has posted its want."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            wants = self.hub.pending()
            if sorted(w.replica for w in wants) == sorted(names):
                return wants
            for name, proc in self.procs.items():
                assert proc.poll() is None, self.log(name)
            time.sleep(0.1)
        raise TimeoutError(f"wants of {names}: {self.hub.pending()}")

    def result(self, name: str, timeout_s: float = 60) -> dict[str, Any]:
        self.procs[name].wait(timeout=timeout_s)
        path = self.tmp / f"{name}.json"
        assert path.exists(), self.log(name)
        return dict(json.loads(path.read_text()))

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)


def _sums(model: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, float]:
    return {n: float(t.to(dtype).double().sum()) for n, t in model.items()}


@pytest.fixture
def setup(tmp_path: Path) -> Any:
    made: list[tuple[TransferHub, Receivers]] = []

    def make(model: dict[str, torch.Tensor], bucket_bytes: int) -> tuple[TransferHub, Receivers]:
        hub = TransferHub(
            host="127.0.0.1",
            port=0,
            session=uuid.uuid4().hex[:8],
            timeout_s=TIMEOUT_S,
            bucket_bytes=bucket_bytes,
        )
        receivers = Receivers(hub, model, tmp_path)
        made.append((hub, receivers))
        return hub, receivers

    yield make
    for hub, receivers in made:
        receivers.stop()
        hub.close()


def test_a_granted_receiver_that_never_joins_costs_only_its_own_update(setup) -> None:
    model = _model(16, (64, 1024))
    hub, receivers = setup(model, 1 << 20)
    for name, mode in (("a", "normal"), ("b", "normal"), ("late", "never_join")):
        receivers.start(name, mode)
    wants = receivers.wanting(["a", "b", "late"])
    started = time.monotonic()
    report = hub.send(unique_tensors(model), 1, wants)
    took = time.monotonic() - started
    print(f"transfer with a receiver that never joined: {took:.2f}s (timeout {TIMEOUT_S}s)")
    assert took < TIMEOUT_S + 2
    assert report.receivers == ["a", "b"] and list(report.dropped) == ["late"]
    assert report.not_joined == ["late"] and "did not join" in report.dropped["late"]
    assert hub.counts["not_joined"] == 1
    for name in ("a", "b"):
        assert receivers.result(name)["sums"] == pytest.approx(
            _sums(model, torch.float32), rel=1e-12
        )
    hub.release(report.not_joined)  # as the trainer does after publishing: benched till next
    assert hub.benched == {"late"}


def test_a_receiver_killed_mid_transfer_costs_only_its_own_update(setup) -> None:
    model = _model(16, (64, 1024))
    hub, receivers = setup(model, 1 << 20)
    receivers.start("a")
    receivers.start("victim", "die_after:2")
    wants = receivers.wanting(["a", "victim"])
    started = time.monotonic()
    report = hub.send(unique_tensors(model), 1, wants)
    took = time.monotonic() - started
    print(f"transfer with a receiver killed after 2 of {report.buckets} buckets: {took:.2f}s")
    assert receivers.procs["victim"].wait(timeout=10) == -signal.SIGKILL
    assert report.receivers == ["a"] and list(report.dropped) == ["victim"], report
    assert report.not_joined == [] and took < TIMEOUT_S + 2
    assert receivers.result("a")["sums"] == pytest.approx(_sums(model, torch.float32), rel=1e-12)


def test_a_slow_receiver_has_nothing_marked_before_it_arrived(setup) -> None:
    model = _model(16, (64, 1024))
    hub, receivers = setup(model, 1 << 20)
    receivers.start("slow", "slow")
    report = hub.send(unique_tensors(model), 1, receivers.wanting(["slow"]))
    result = receivers.result("slow")
    assert report.receivers == ["slow"] and result["sums"] == pytest.approx(
        _sums(model, torch.float32), rel=1e-12
    )
    store = dist.PrefixStore(hub.session + "/", store_client(hub.address, 5))
    group, n = result["group"], report.buckets
    assert n == result["buckets"] == 4

    def at(key: str) -> int:
        return int(store.get(key))

    joined = at(f"{group}/joined/1")
    marked = [at(f"{group}/bucket/{i}/1") for i in range(n)]
    loaded = [at(f"test/slow/loaded/{i}") for i in range(n)]
    received = at(f"{group}/received/1")
    print(f"store order: joined {joined}, buckets {marked}, loaded {loaded}, received {received}")
    assert joined < marked[0]
    for i in range(n):  # bucket i complete and marked before its load, before bucket i+1's
        assert marked[i] < loaded[i] and (i + 1 == n or loaded[i] < marked[i + 1])
    assert received > loaded[-1]  # received only after the last bucket was loaded


def test_a_bf16_receiver_gets_half_the_bytes_within_two_buckets_of_memory(setup) -> None:
    model = _model(256, (256, 1024))  # 256 MiB in fp32, 128 MiB in bf16
    bucket = 16 << 20
    hub, receivers = setup(model, bucket)
    receivers.start("bf16", dtype="bfloat16")
    report = hub.send(unique_tensors(model), 1, receivers.wanting(["bf16"]))
    result = receivers.result("bf16")
    fp32_bytes = sum(t.numel() * 4 for t in model.values())
    print(
        f"bf16 receiver: {result['manifest_bytes'] / 2**20:.1f} MiB received of "
        f"{fp32_bytes / 2**20:.0f} MiB fp32, {result['buckets']} buckets of at most "
        f"{result['max_bucket'] / 2**20:.1f} MiB; peak extra memory "
        f"{result['extra'] / 2**20:.1f} MiB (two buckets: {2 * result['max_bucket'] / 2**20:.1f})"
        f" in {result['seconds']:.2f}s"
    )
    assert report.receivers == ["bf16"]
    assert result["sums"] == pytest.approx(_sums(model, torch.bfloat16), rel=1e-12)
    assert result["manifest_bytes"] * 2 == fp32_bytes == report.bytes * 2
    assert report.lanes == {
        "gloo/bfloat16": {"bytes": fp32_bytes // 2, "buckets": 8, "replicas": ["bf16"]}
    }
    assert result["extra"] <= 2 * result["max_bucket"]


def test_the_trainers_death_mid_transfer_costs_the_receiver_its_update_only(
    tmp_path: Path,
) -> None:
    from workers.weights.protocol import MEMBERS, Grant, Want, grant_key, want_key
    from workers.weights.receive import receive_buckets

    address_file = tmp_path / "address"
    argv = [sys.executable, "-m", "tests.integration.transfer_sender"]
    argv += ["--address-file", str(address_file), "--timeout", str(TIMEOUT_S)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log = (tmp_path / "sender.log").open("wb")
    sender = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not address_file.exists():
            assert sender.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        address, session = address_file.read_text().split()
        store = dist.PrefixStore(session + "/", store_client(address, 30))
        want = Want("r", uuid.uuid4().hex, -1)
        store.set(want_key("r"), want.dumps())
        store.append(MEMBERS, "r\n")
        store.wait([grant_key(want.nonce)])
        stream = receive_buckets(Grant.loads(store.get(grant_key(want.nonce))).as_dict())
        first = next(stream)
        assert float(first["t0"][0, 0]) == 0.0
        sender.send_signal(signal.SIGKILL)
        sender.wait(timeout=10)
        killed = time.monotonic()
        with pytest.raises(RuntimeError) as failure:  # gloo's error, or the timeout
            for _ in stream:
                pass
        took = time.monotonic() - killed
        print(
            f"trainer killed after 1 bucket: the receiver raised after {took:.2f}s: "
            f"{type(failure.value).__name__}: {str(failure.value).strip().splitlines()[-1]}"
        )
        assert took < TIMEOUT_S + 3
    finally:
        if sender.poll() is None:
            sender.kill()
        log.close()
