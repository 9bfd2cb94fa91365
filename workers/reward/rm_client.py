"""Client of a discriminative reward model served by replicas' classification endpoint.

Contract (the `hf` engine's `/classify`, any backend may serve it):

    POST {address}/classify  {"input_ids": [[int, ...], ...]}
    200 → {"scores": [float, ...], "policy_version": int}     one score per sequence

A sequence is the trajectory's `prompt_ids + response_ids` (tool tokens included, as the
reward model sees the whole conversation). Requests go round-robin over the addresses; a
failed request is retried once on the next address, then every sequence of it fails with
`RewardModelError` (the stage's failure policy takes over).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import aiohttp

from workers.reward.exceptions import RewardModelError

__all__ = ["RewardModelClient"]

log = logging.getLogger("rollout.reward.rm")


class RewardModelClient:
    """Scores token sequences with `POST /classify`; one aiohttp session per client."""

    def __init__(self, addresses: list[str], *, timeout_s: float, max_batch: int) -> None:
        if not addresses:
            raise ValueError("a reward model client needs at least one address")
        self.addresses = [a.rstrip("/") for a in addresses]
        self.timeout_s = timeout_s
        self.max_batch = max_batch
        self._next = itertools.cycle(range(len(self.addresses)))
        self._session: aiohttp.ClientSession | None = None
        self.last_version: int | None = None

    async def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        return self._session

    async def classify(self, sequences: list[list[int]]) -> tuple[list[float], int | None]:
        """One score per sequence (and the model's version); `RewardModelError` on failure."""
        scores: list[float] = []
        version: int | None = None
        for start in range(0, len(sequences), self.max_batch):
            chunk = sequences[start : start + self.max_batch]
            chunk_scores, version = await self._request(chunk)
            scores.extend(chunk_scores)
        self.last_version = version
        return scores, version

    async def _request(self, chunk: list[list[int]]) -> tuple[list[float], int | None]:
        session = await self._client()
        errors: list[str] = []
        for _ in range(min(2, len(self.addresses))):
            address = self.addresses[next(self._next)]
            try:
                async with session.post(f"{address}/classify", json={"input_ids": chunk}) as resp:
                    body: Any = await resp.json(content_type=None)
                    if resp.status != 200:
                        raise RewardModelError(f"{address}/classify answered {resp.status}: {body}")
            except (aiohttp.ClientError, TimeoutError, ValueError, RewardModelError) as exc:
                log.warning("reward model %s failed: %r", address, exc)
                errors.append(f"{address}: {exc!r}")
                continue
            return _check(body, len(chunk), address)
        raise RewardModelError("reward model unavailable: " + "; ".join(errors))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _check(body: Any, expected: int, address: str) -> tuple[list[float], int | None]:
    scores = body.get("scores") if isinstance(body, dict) else None
    if not isinstance(scores, list) or len(scores) != expected:
        raise RewardModelError(f"{address}/classify returned {body!r:.200} for {expected} inputs")
    try:
        values = [float(s) for s in scores]
    except (TypeError, ValueError) as exc:
        raise RewardModelError(f"{address}/classify returned non-numeric scores") from exc
    version = body.get("policy_version")
    return values, version if isinstance(version, int) else None
