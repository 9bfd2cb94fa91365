"""Helpers of the `vllm` tests: checkpoints, a real replica process, and the reference forward.

- `make_checkpoints(root, tied, n)`: n checkpoints of the project's tiny Qwen2 with different
  weights (versions 0..n-1) and a context of `CONTEXT` tokens; `tied=False` gives each its own
  `lm_head.weight` (unlike the embedding) and `tie_word_embeddings: false`, as a model with
  untied embeddings has.
- `Replica`: `rollout replica serve --backend vllm` as a subprocess in its own process group,
  stopped (SIGTERM, then SIGKILL) on exit; vLLM runs in .venv-vllm with one CPU thread and the
  model's whole context, so the contract's "long" generations (the context less the prompt)
  are still running when a test aborts or pauses them. That takes a long context: vLLM makes
  about 330 tokens/s a request here, so the tiny model's own 2048 were done in 6 s, and on
  this shared machine a test process was measured not running for up to 4.4 s at a time
  while vLLM used both cores; the pause test then found its generations finished (`length`)
  before its `/pause` was sent. 8192 tokens take about 25 s.
- `reference_logprobs(model_dir, prompt, tokens, temperature)`: log-softmax of a transformers
  fp32 forward pass of the checkpoint at each position of `tokens` (the trainer's view).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pipeline.launch.replicas import wait_healthy

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
CONTEXT = 8192  # the test checkpoints' context, and their replicas' max_model_len (see above)

# vLLM on a shared 2-core machine: one OpenMP thread, no core binding, 1 GiB of KV cache.
VLLM_CPU_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
}


# The untied replica of tests/vllm/conftest.py runs at most this many sequences at a time:
# test_load.py fills it past that (the weight-sync tests send it one request at a time).
UNTIED_MAX_NUM_SEQS = 2

# No torch.compile and no graph capture: the server is healthy in about half the time (the
# numerics checked here are the eager model's; the default compiled path matched to 5e-7 too).
FAST_START = ("--vllm-arg=--enforce-eager", "--vllm-arg=-O0")


def make_checkpoints(root: Path, *, tied: bool, count: int) -> list[Path]:
    """`count` model directories under `root` (seeds 0..count-1)."""
    import torch
    from safetensors.torch import load_file, save_file

    from pipeline.harness.models.tiny import init_model

    out = []
    for seed in range(count):
        path = init_model(root / f"{'tied' if tied else 'untied'}-v{seed}", seed=seed)
        config = json.loads((path / "config.json").read_text())
        config["max_position_embeddings"] = CONTEXT  # rope: any length runs
        (path / "config.json").write_text(json.dumps(config, indent=2))
        if not tied:
            file = path / "model.safetensors"
            state = load_file(str(file))
            embed = state["model.embed_tokens.weight"]
            gen = torch.Generator().manual_seed(1000 + seed)
            state["lm_head.weight"] = torch.randn(embed.shape, generator=gen) * 0.05
            save_file(state, str(file), metadata={"format": "pt"})
            config = json.loads((path / "config.json").read_text())
            config["tie_word_embeddings"] = False
            (path / "config.json").write_text(json.dumps(config, indent=2))
        out.append(path)
    return out


def reference_logprobs(
    model_dir: Path,
    prompt: list[int],
    tokens: list[int],
    temperature: float = 1.0,
    top_k: int = 0,
) -> list[float]:
    """log p(tokens[i] | prompt + tokens[:i]) under the checkpoint, fp32, of the distribution
    log_softmax(top_k(logits / temperature)) (top_k 0: all tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double() / temperature
    if top_k > 0:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()


def http(url: str, body: Any = None, timeout: float = 300.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url,
        data=data,
        method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read().decode()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


class Replica:
    """One `rollout replica serve --backend vllm` process, healthy inside the `with` block."""

    def __init__(
        self, model: Path, port: int, log: Path, *extra: str, max_model_len: int = CONTEXT
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.cmd = [
            sys.executable,
            "-m",
            "pipeline.cli.main",
            "-v",  # vLLM's own output into `log` too, not only its file
            "replica",
            "serve",
            "--backend",
            "vllm",
            "--model",
            str(model),
            "--port",
            str(port),
            "--replica-id",
            f"vllm-{port}",
            "--vllm-python",
            str(VLLM_PYTHON),
            "--max-model-len",
            str(max_model_len),
            "--dtype",
            "float32",
            *FAST_START,
            *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Replica:
        env = os.environ | VLLM_CPU_ENV | {"PYTHONPATH": str(REPO)}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self.wait_healthy(600.0)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def wait_healthy(self, timeout_s: float) -> None:
        alive = lambda: self.proc is not None and self.proc.poll() is None  # noqa: E731
        wait_healthy(self.url, alive, timeout_s, log=self.log, interval_s=1.0)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def complete(self, **body: Any) -> dict[str, Any]:
        status, resp = http(self.url + "/v1/completions", body)
        assert status == 200, resp
        return dict(resp)

    def update_weights(self, path: Path, version: int) -> None:
        status, resp = http(self.url + "/update_weights", {"path": str(path), "version": version})
        assert status == 200 and resp["version"] == version, resp
