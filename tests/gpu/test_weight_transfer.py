"""Weights into a live vLLM replica on a GPU over NCCL, both ways (infra/gpu_check.sh).

- vLLM's native NCCL weight-transfer engine: the replica's vLLM started with
  `--weight-transfer-config {"backend": "nccl"}` (gpu_check passes it through `--vllm-arg`);
  this process is the trainer, with the other checkpoint on the GPU, and drives vLLM's own
  `NCCLTrainerWeightTransferEngine` against vLLM's HTTP routes (`/init_weight_transfer_engine`,
  `/start_weight_update`, `/update_weights`, `/finish_weight_update`).
- the project's broadcast (`weights.mode: broadcast` with
  `weights.backend: nccl`): a `TransferHub` with the weights on the GPU grants a
  `GrantClient`'s want, and the adapter's `/update_weights {version, transfer}` makes vLLM's
  workers receive over a fresh NCCL group (`WeightSync.rollout_receive_weights`).

After each, the replica's greedy logprobs of a fixed prompt are those of the sent weights: much
closer to a transformers forward pass of them than to the weights served before (vLLM's GPU
kernels and transformers' differ by more than the CPU's 1e-6, so the check is relative).
These two need two GPUs (`TWO_GPUS`): NCCL refuses two ranks of one communicator on one
device ("Duplicate GPU detected"), so the trainer here takes `cuda:1` while vLLM has `cuda:0`;
with one GPU they are skipped, saying so.

What one GPU can check (no vLLM needed): `test_broadcast_to_a_second_process_on_this_machine`,
the project's broadcast from a trainer with its weights on `cuda:0` to a receiver in a second
process (`tests/integration/transfer_receiver.py`) that receives into GPU memory, bucket by
bucket, in fp32 and in bf16 (half the bytes): over NCCL where there is a second GPU for it,
else over gloo with CUDA tensors on the receiver. Its peak extra GPU memory must stay within
two buckets.

Environment: ROLLOUT_REPLICA_URL (the adapter), ROLLOUT_VLLM_URL (vLLM's own port, for its
routes), ROLLOUT_MODEL_PATH (the served model), ROLLOUT_UPDATE_WEIGHTS_PATH (the other one).
Written for a GPU machine and not run on one yet (none was lent to the sessions that wrote it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
TWO_GPUS = pytest.mark.skipif(
    GPUS < 2,
    reason=f"{GPUS} GPU: NCCL between the trainer and vLLM needs each on a GPU of its own "
    "(two ranks on one device: 'Duplicate GPU detected')",
)
TRAINER = "cuda:1" if GPUS >= 2 else "cuda:0"  # vLLM's workers take cuda:0
REPO = Path(__file__).resolve().parents[2]

PROMPT = [(7 * i + 3) % 500 + 10 for i in range(48)]
ENV = (
    "ROLLOUT_REPLICA_URL",
    "ROLLOUT_VLLM_URL",
    "ROLLOUT_MODEL_PATH",
    "ROLLOUT_UPDATE_WEIGHTS_PATH",
)


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    """The environment, and the replica brought to the served model from disk first (the
    contract tests before may have left the other one), so each test knows what was before."""
    missing = [name for name in ENV if not os.environ.get(name)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (infra/gpu_check.sh sets them)")
    url = os.environ["ROLLOUT_REPLICA_URL"]
    path = os.environ["ROLLOUT_MODEL_PATH"]
    _post(url + "/update_weights", {"path": path, "version": _version(url) + 1})
    return {name: os.environ[name] for name in ENV}


def _version(url: str) -> int:
    with urllib.request.urlopen(url + "/health", timeout=30) as response:
        return int(json.loads(response.read())["version"])


def _post(url: str, body: Any) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def _greedy(replica: str) -> tuple[list[int], list[float]]:
    body = _post(
        replica + "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, "logprobs": 0, "ignore_eos": True},
    )
    (choice,) = body["choices"]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _model(path: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(TRAINER).eval()


def _diff(model: Any, tokens: list[int], logprobs: list[float]) -> float:
    import torch

    ids = torch.tensor([PROMPT + tokens], device=TRAINER)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1].double()
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens, device=TRAINER)[:, None])
    return max(abs(a - b) for a, b in zip(ref.squeeze(1).tolist(), logprobs, strict=True))


def _check(env: dict[str, str], sent: Any, before: Any) -> None:
    tokens, logprobs = _greedy(env["ROLLOUT_REPLICA_URL"])
    to_sent, to_before = _diff(sent, tokens, logprobs), _diff(before, tokens, logprobs)
    print(f"max abs diff to the weights sent {to_sent:.2g}, to those before {to_before:.2g}")
    assert to_sent < 0.05 and to_sent * 5 < to_before


@TWO_GPUS
def test_vllms_native_nccl_engine(env: dict[str, str]) -> None:
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    from workers.ports import free_port

    served, other = _model(env["ROLLOUT_MODEL_PATH"]), _model(env["ROLLOUT_UPDATE_WEIGHTS_PATH"])
    info = NCCLTrainerInitInfo(
        master_address="127.0.0.1", master_port=free_port(), world_size=2, rank=0
    )
    engine = NCCLTrainerWeightTransferEngine.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(env["ROLLOUT_VLLM_URL"]), source=ModuleSource(other)
    )
    try:
        engine.send_weights()
    finally:
        engine.shutdown()
    # KV of the weights before must not serve the prompt (the adapter resets it only on its
    # own loads; vLLM's routes went around it).
    _post(env["ROLLOUT_VLLM_URL"] + "/reset_prefix_cache", {})
    _check(env, other, served)


@TWO_GPUS
def test_the_projects_broadcast_over_nccl(env: dict[str, str]) -> None:
    from schemas.events import WeightTransfer
    from workers.weights.hub import TransferHub, unique_tensors
    from workers.weights.sync import GrantClient

    url = env["ROLLOUT_REPLICA_URL"]
    served = _model(env["ROLLOUT_UPDATE_WEIGHTS_PATH"])  # what the test before loaded
    sent = _model(env["ROLLOUT_MODEL_PATH"])
    hub = TransferHub(
        host="127.0.0.1",
        port=0,
        session="gpu",
        timeout_s=120,
        bucket_bytes=64 << 20,
        backend="nccl",
    )
    grants = GrantClient(url)
    version = _version(url) + 1
    answer: dict[str, Any] = {}
    try:
        grants.connect(WeightTransfer(address=hub.address, session="gpu", backend="nccl"))
        grants.want(version - 1, 1, None, ("gloo", "nccl"))  # what its /health says

        def replica() -> None:
            grant = grants.wait(120)
            assert grant is not None
            answer.update(_post(url + "/update_weights", {"version": version, "transfer": grant}))

        thread = threading.Thread(target=replica)
        thread.start()
        report = hub.send(unique_tensors(sent.state_dict()), version, hub.pending())
        thread.join(timeout=600)
    finally:
        grants.close()
        hub.close()
    assert not report.dropped and answer.get("version") == version, (report, answer)
    _check(env, sent, served)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_broadcast_to_a_second_process_on_this_machine(tmp_path: Path, dtype: str) -> None:
    from workers.weights.hub import TransferHub, unique_tensors

    g = torch.Generator().manual_seed(0)
    # 2 MiB each in fp32 (alone in a bucket: sent from the tensor), 1 MiB in bf16 (packed)
    cpu = {f"layer.{i}.weight": torch.randn(512, 1024, generator=g) for i in range(128)}
    weights = {name: t.to("cuda:0") for name, t in cpu.items()}  # 256 MiB in fp32
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps({n: list(t.shape) for n, t in cpu.items()}))
    nccl = GPUS >= 2  # NCCL refuses two ranks on one GPU: then gloo, CUDA tensors received
    backend, device = ("nccl", "cuda:1") if nccl else ("gloo", "cuda:0")
    hub = TransferHub(
        host="127.0.0.1",
        port=0,
        session=uuid.uuid4().hex[:8],
        timeout_s=120,
        bucket_bytes=32 << 20,
        backend=backend,
    )
    out = tmp_path / "receiver.json"
    argv = [sys.executable, "-m", "tests.integration.transfer_receiver"]
    argv += ["--address", hub.address, "--session", hub.session, "--replica", "gpu"]
    argv += ["--layout", str(layout), "--dtype", dtype, "--device", device, "--out", str(out)]
    argv += ["--backends", "gloo,nccl" if nccl else "gloo"]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # host buffers leave when freed
    receiver = subprocess.Popen(argv, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (wants := hub.pending()):
            assert receiver.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        started = time.monotonic()
        report = hub.send(unique_tensors(weights), 1, wants)
        seconds = time.monotonic() - started
        assert receiver.wait(timeout=120) == 0
    finally:
        if receiver.poll() is None:
            receiver.kill()
        hub.close()
    result = json.loads(out.read_text())
    expected = {n: float(t.to(getattr(torch, dtype)).double().sum()) for n, t in cpu.items()}
    fp32 = sum(t.numel() * 4 for t in cpu.values())
    print(
        f"{backend} to {device} in {dtype}: {result['manifest_bytes'] / 2**20:.0f} MiB of "
        f"{fp32 / 2**20:.0f} MiB fp32 in {seconds:.2f}s ({report.lanes}); receiver's peak "
        f"extra GPU memory {result['extra'] / 2**20:.1f} MiB, max bucket "
        f"{result['max_bucket'] / 2**20:.1f} MiB"
    )
    assert report.receivers == ["gpu"] and result["sums"] == pytest.approx(expected, rel=1e-12)
    assert result["manifest_bytes"] == (fp32 if dtype == "float32" else fp32 // 2)
    assert result["extra"] <= 2 * result["max_bucket"]
