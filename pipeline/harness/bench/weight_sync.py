"""`rollout bench weight-sync`: seconds per weight sync, checkpoint on disk vs broadcast.

For each size (`small`: the project's preset; `0.5b`: a synthetic Qwen2 of Qwen2.5-0.5B's
geometry, about 494 M parameters, random weights from a config only), one real `hf` replica
(`rollout replica serve`, one torch thread) serving in `dtype` (bfloat16 by default: the
served-dtype path, where broadcast weights travel in the replica's dtype, half the trainer's
fp32 bytes) and, in this process, the trainer's side with the fp32 weights in memory. Each
round runs both ways in turn (disk, broadcast, disk, ...), so a slow minute of this shared
machine lands on both:

- disk: the trainer's checkpoint writer (`save_checkpoint`: safetensors, every file fsynced,
  the rename, `latest`; weights only, no optimizer state, which a real trainer also writes),
  then `POST /update_weights {path}`: the replica reads and checks it, then copies it in;
- broadcast: the trainer's `TransferHub` grants the want of a `GrantClient` (the replica's
  controller, saying the dtype the replica serves), packs the weights converted to that dtype,
  the replica receives over a fresh gloo group while it keeps serving, then copies it in
  (`POST /update_weights {transfer}`).

Measured from the weights being ready to the replica serving them (its answer); the control
plane (the `PolicyVersion` on Kafka and the controller's poll of it) is the same both ways and
left out. Figures per size, each the median of the rounds: `disk_s`, `broadcast_s`, `ratio`
(disk / broadcast, the median of the rounds' ratios), `pause_s` each way (how long the
replica stopped generating: the copy into the live weights, the same both ways, since both
read before pausing), and the breakdown `serialise_s` (checkpoint write / packing the
buckets), `transfer_s` (the replica reading the file / receiving the buckets), `load_s` (the
copy, = pause), with every round's value; and per update `broadcast_bytes` (what the replica
received) and `checkpoint_bytes` (what the disk way wrote and read).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["SYNTHETIC", "run"]

# Qwen2.5-0.5B's geometry (tied embeddings, vocabulary 151936): 494 M parameters.
SYNTHETIC = {
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
    }
}


def run(
    sizes: str = "small,0.5b", rounds: int = 5, bucket_mb: int = 256, dtype: str = "bfloat16"
) -> dict[str, Any]:
    """The figures of every size in `sizes` (comma-separated), `rounds` rounds each, into a
    replica serving `dtype`."""
    from pipeline.harness.models.tiny import PRESETS

    names = [s.strip() for s in sizes.split(",") if s.strip()]
    unknown = [n for n in names if n not in PRESETS and n not in SYNTHETIC]
    if unknown or not names:
        known = ", ".join([*PRESETS, *SYNTHETIC])
        raise SystemExit(f"rollout bench weight-sync: --sizes {sizes!r}: use some of {known}")
    if rounds < 1:
        raise SystemExit("rollout bench weight-sync: --rounds must be at least 1")
    if dtype not in ("float32", "bfloat16"):
        raise SystemExit(f"rollout bench weight-sync: --dtype {dtype}: float32 or bfloat16")
    out: dict[str, Any] = {"rounds": rounds, "bucket_mb": bucket_mb, "dtype": dtype}
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"rollout-bench-sync-{name}-") as tmp:
            out[name] = _size(name, Path(tmp), rounds, bucket_mb, dtype)
    return out


def _model(name: str, where: Path) -> Path:
    """The model directory of `name`: a preset, or a synthetic config with random weights."""
    from pipeline.harness.models.tiny import init_model

    if name not in SYNTHETIC:
        return init_model(where, preset=name, seed=0)
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipeline.harness.models.tiny import MAX_CONTEXT, build_tokenizer

    config = Qwen2Config(
        max_position_embeddings=MAX_CONTEXT, tie_word_embeddings=True, **SYNTHETIC[name]
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(where, safe_serialization=True)
    build_tokenizer().save_pretrained(where)
    return where


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url + "/update_weights",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=1800) as response:
        return dict(json.loads(response.read()))


def _size(name: str, tmp: Path, rounds: int, bucket_mb: int, dtype: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.launch.replicas import wait_healthy
    from workers.ports import free_port

    torch.set_num_threads(1)
    model_dir = _model(name, tmp / "model")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp / "replica.log"
    cmd = [sys.executable, "-m", "pipeline.cli.main", "replica", "serve", "--backend", "hf"]
    cmd += ["--model", str(model_dir), "--port", str(port), "--threads", "1", "--dtype", dtype]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        wait_healthy(url, lambda: proc.poll() is None, 900, log=log)
        return _rounds(url, model, model_dir, tmp, rounds, bucket_mb, dtype) | {"params": params}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _rounds(
    url: str, model: Any, model_dir: Path, tmp: Path, rounds: int, bucket_mb: int, dtype: str
) -> dict[str, Any]:
    from schemas.events import WeightTransfer
    from workers.weights.checkpoint import TrainerState, save_checkpoint
    from workers.weights.hub import TransferHub, unique_tensors
    from workers.weights.sync import GrantClient

    hub = TransferHub(
        host="127.0.0.1", port=0, session="bench", timeout_s=600, bucket_bytes=bucket_mb << 20
    )
    grants = GrantClient(url)
    grants.connect(WeightTransfer(address=hub.address, session="bench"))
    runs: dict[str, list[dict[str, float]]] = {"disk": [], "broadcast": []}
    version = 0
    try:
        for _ in range(rounds):
            version += 1
            started = time.monotonic()
            path = save_checkpoint(
                tmp / "checkpoints", TrainerState(version=version), model, tokenizer_from=model_dir
            )
            written = time.monotonic()
            timings = _post(url, {"path": str(path), "version": version})["timings"]
            runs["disk"].append(_figures(started, written - started, timings))
            checkpoint_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
            shutil.rmtree(path)  # the disk stays as it was: no round reads a cached older one

            version += 1
            grants.want(version - 1, 1, dtype, ("gloo",))  # what its /health says
            answer: dict[str, Any] = {}
            started = time.monotonic()
            thread = threading.Thread(target=_receive, args=(url, grants, version, answer))
            thread.start()
            report = hub.send(unique_tensors(model.state_dict()), version, hub.pending())
            thread.join()
            if report.dropped or "timings" not in answer:
                raise RuntimeError(f"broadcast failed: {report.dropped} {answer}")
            runs["broadcast"].append(_figures(started, report.pack_s, answer["timings"]))
    finally:
        grants.close()
        hub.close()
    return _summary(runs) | {
        "broadcast_bytes": report.bytes,  # one replica: its lane's
        "checkpoint_bytes": checkpoint_bytes,
        "buckets": report.buckets,
        "lanes": list(report.lanes),
    }


def _receive(url: str, grants: Any, version: int, answer: dict[str, Any]) -> None:
    """The replica's controller: the grant that answers its want, posted to the replica."""
    grant = grants.wait(600)
    if grant is not None:
        answer.update(_post(url, {"version": version, "transfer": grant}))


def _figures(started: float, serialise_s: float, timings: dict[str, float]) -> dict[str, float]:
    return {
        "total_s": time.monotonic() - started,
        "serialise_s": serialise_s,
        "transfer_s": timings["read_s"],
        "load_s": timings["pause_s"],
    }


def _summary(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    def median(way: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[way]), 4)

    ratios = [
        d["total_s"] / b["total_s"] for d, b in zip(runs["disk"], runs["broadcast"], strict=True)
    ]
    out: dict[str, Any] = {
        "disk_s": median("disk", "total_s"),
        "broadcast_s": median("broadcast", "total_s"),
        "ratio": round(statistics.median(ratios), 3),
        "ratio_runs": [round(r, 3) for r in ratios],
        "pause_s": {"disk": median("disk", "load_s"), "broadcast": median("broadcast", "load_s")},
    }
    for way in ("disk", "broadcast"):
        out[f"{way}_breakdown"] = {
            k: median(way, k) for k in ("serialise_s", "transfer_s", "load_s")
        }
        out[f"{way}_s_runs"] = [round(r["total_s"], 3) for r in runs[way]]
    return out
