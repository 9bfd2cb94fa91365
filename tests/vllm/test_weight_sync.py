"""After every `/update_weights`, vLLM serves exactly the published checkpoint.

Parity: the logprobs vLLM returns for the tokens it samples equal a transformers fp32 forward
pass of the checkpoint just published (max abs <= 1e-3), for a model with tied embeddings and
one without, over several updates in a row, coming back to an earlier version too. Each step
also checks the previous checkpoint does *not* match (so a replica that kept its old weights,
or half of them, fails). Before the fix, tied models matched neither (max abs 0.64 here).

Behaviour logprobs (`--logprobs-mode processed_logprobs`): at temperature t with top-k, the
logprob of a sampled token is that of the distribution it was drawn from,
log_softmax(top_k(logits / t)), not the raw model's log_softmax(logits).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.support import Replica, http, reference_logprobs

pytestmark = pytest.mark.vllm

PROMPT = [(13 * i + 7) % 900 + 20 for i in range(24)]
TOLERANCE = 1e-3


def sample(replica: Replica, **params: object) -> tuple[list[int], list[float], int]:
    body = replica.complete(
        prompt=PROMPT, max_tokens=16, ignore_eos=True, logprobs=0, **({"seed": 3} | params)
    )
    (choice,) = body["choices"]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"], body["policy_version"]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def current_version(replica: Replica) -> int:
    status, body = http(replica.url + "/health")
    assert status == 200, body
    return int(body["version"])


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_every_update_serves_exactly_the_published_checkpoint(
    kind: str, request: pytest.FixtureRequest, checkpoints: dict[str, list[Path]]
) -> None:
    replica: Replica = request.getfixturevalue(f"{kind}_replica")
    versions = checkpoints[kind]
    version = current_version(replica)
    previous = None
    for index in (1, 2, 0, 1):  # several in a row, and back to earlier weights
        version += 1
        replica.update_weights(versions[index], version)
        tokens, logprobs, served = sample(replica, temperature=1.0)
        assert served == version
        diff = max_diff(logprobs, reference_logprobs(versions[index], PROMPT, tokens))
        assert diff <= TOLERANCE, f"{kind} v{index}: max abs diff {diff:.3g} to its checkpoint"
        line = f"{kind}: version {version} = v{index}: max abs diff {diff:.2g}"
        if previous is not None:
            stale = max_diff(logprobs, reference_logprobs(versions[previous], PROMPT, tokens))
            assert stale > 0.05, f"{kind} v{index} still matches v{previous} ({stale:.3g})"
            line += f" (to v{previous}: {stale:.2g})"
        print(line)  # the figures, with `pytest -s`
        previous = index


def test_logprobs_are_those_of_the_distribution_sampled(
    tied_replica: Replica, checkpoints: dict[str, list[Path]]
) -> None:
    model = checkpoints["tied"][0]
    tied_replica.update_weights(model, current_version(tied_replica) + 1)
    tokens, logprobs, _ = sample(tied_replica, temperature=0.7, top_k=20)
    processed = reference_logprobs(model, PROMPT, tokens, temperature=0.7, top_k=20)
    raw = reference_logprobs(model, PROMPT, tokens)
    assert max_diff(logprobs, processed) <= TOLERANCE
    assert max_diff(logprobs, raw) > 0.5  # the test tells the two modes apart
    print(
        f"t=0.7 top_k=20: {max_diff(logprobs, processed):.2g} to processed, "
        f"{max_diff(logprobs, raw):.2g} to raw"
    )
    # Greedy: the distribution sampled is the model's own, so processed == raw.
    tokens, logprobs, _ = sample(tied_replica, temperature=0.0)
    assert max_diff(logprobs, reference_logprobs(model, PROMPT, tokens)) <= TOLERANCE
