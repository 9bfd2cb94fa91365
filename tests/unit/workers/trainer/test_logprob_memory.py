"""Peak memory of the logprob pass (issue 42): the `small` preset's geometry with a 32k-token
vocabulary, 8 sequences of 16 + 496 tokens, forward + logprobs + backward, packed. The chunked
head (`trainer.logprob_chunk_tokens` 1024, the default) never holds the [tokens, vocabulary]
fp32 logits that the full computation does: its peak is at most half of the full one's.

Each way runs in a fresh process (the figure is that process's resident high-water mark above
what it held before the pass; glibc's allocator is told to give large blocks back at once, so
an earlier pass cannot hide a later one's peak)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow]

VOCAB, SEQUENCES, PROMPT, RESPONSE = 32_768, 8, 16, 496


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024  # MiB
    raise RuntimeError(f"no {key} in /proc/self/status")


def _pass(chunk: int | None) -> dict[str, Any]:
    """One logprob pass with a gradient; the peak resident memory it added, in MiB."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipeline.harness.models.tiny import PRESETS
    from schemas.events import ExtraFields, ScoredTrajectory
    from workers.trainer.batching import collate
    from workers.trainer.logprobs import response_log_probs

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(**PRESETS["small"], vocab_size=VOCAB, tie_word_embeddings=True)
    ).train()
    generator = torch.Generator().manual_seed(0)
    samples = []
    for i in range(SEQUENCES):
        ids = torch.randint(3, VOCAB, (PROMPT + RESPONSE,), generator=generator).tolist()
        samples.append(
            ScoredTrajectory(
                uid=f"u{i}",
                trajectory_id=f"u{i}/0",
                sample_index=0,
                attempt_id="a",
                data_source="t",
                prompt_ids=ids[:PROMPT],
                response_ids=ids[PROMPT:],
                response_mask=[1] * RESPONSE,
                response_logprobs=[-1.0] * RESPONSE,
                num_turns=1,
                reward_score=0.0,
                extra_fields=ExtraFields(min_global_steps=0, max_global_steps=0),
            )
        )
    batch = collate(samples, [1.0] * SEQUENCES)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from what is resident now
    before = _status("VmRSS:")
    logp, _ = response_log_probs(model, batch, chunk_tokens=chunk)
    logp.sum().backward()
    return {"chunk": chunk, "peak_mib": round(_status("VmHWM:") - before, 1)}


def test_the_chunked_logprob_pass_takes_at_most_half_the_memory() -> None:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "2"}
    figures = {}
    for way in ("full", "chunked"):
        done = subprocess.run(
            [sys.executable, "-m", "tests.unit.workers.trainer.test_logprob_memory", way],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        figures[way] = json.loads(done.stdout.strip().splitlines()[-1])["peak_mib"]
    logits = SEQUENCES * RESPONSE * VOCAB * 4 / 2**20
    print(
        {**figures, "ratio": round(figures["chunked"] / figures["full"], 3), "logits_mib": logits}
    )
    assert figures["chunked"] <= 0.5 * figures["full"]


if __name__ == "__main__":  # one way in this process: `python -m … full|chunked`
    print(json.dumps(_pass(None if sys.argv[1] == "full" else 1024)))
