"""Weights into a live vLLM replica on a GPU over NCCL, both ways (infra/gpu_check.sh).

- vLLM's native NCCL weight-transfer engine: the replica's vLLM started with
  `--weight-transfer-config {"backend": "nccl"}` (gpu_check passes it through `--vllm-arg`);
  this process is the trainer, with the other checkpoint on the GPU, and drives vLLM's own
  `NCCLTrainerWeightTransferEngine` against vLLM's HTTP routes (`/init_weight_transfer_engine`,
  `/start_weight_update`, `/update_weights`, `/finish_weight_update`).
- the project's broadcast (`trainer.weight_transfer: broadcast` with
  `weight_transfer.backend: nccl`): a `TransferHub` with the weights on the GPU grants a
  `GrantClient`'s want, and the adapter's `/update_weights {version, transfer}` makes vLLM's
  workers receive over a fresh NCCL group (`WeightSync.rollout_receive_weights`).

After each, the replica's greedy logprobs of a fixed prompt are those of the sent weights: much
closer to a transformers forward pass of them than to the weights served before (vLLM's GPU
kernels and transformers' differ by more than the CPU's 1e-6, so the check is relative).

Environment: ROLLOUT_REPLICA_URL (the adapter), ROLLOUT_VLLM_URL (vLLM's own port, for its
routes), ROLLOUT_MODEL_PATH (the served model), ROLLOUT_UPDATE_WEIGHTS_PATH (the other one).
Written for a GPU machine and not run on one yet (none was lent to the session that wrote it).
"""

from __future__ import annotations

import json
import os
import threading
import urllib.request
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

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

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()


def _diff(model: Any, tokens: list[int], logprobs: list[float]) -> float:
    import torch

    ids = torch.tensor([PROMPT + tokens], device="cuda")
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1].double()
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens, device="cuda")[:, None])
    return max(abs(a - b) for a, b in zip(ref.squeeze(1).tolist(), logprobs, strict=True))


def _check(env: dict[str, str], sent: Any, before: Any) -> None:
    tokens, logprobs = _greedy(env["ROLLOUT_REPLICA_URL"])
    to_sent, to_before = _diff(sent, tokens, logprobs), _diff(before, tokens, logprobs)
    print(f"max abs diff to the weights sent {to_sent:.2g}, to those before {to_before:.2g}")
    assert to_sent < 0.05 and to_sent * 5 < to_before


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


def test_the_projects_broadcast_over_nccl(env: dict[str, str]) -> None:
    from schemas.events import WeightTransfer
    from workers.llm.replicas.weight_receiver import GrantClient
    from workers.transfer.hub import TransferHub, unique_tensors

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
        grants.want(version - 1, 1)

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
