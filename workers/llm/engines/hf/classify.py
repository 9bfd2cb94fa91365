"""`/classify` for the `hf` backend: a discriminative reward model as a replica.

A model directory whose architecture is `*ForSequenceClassification` (e.g. the one
`rollout model init --reward-model` writes) is served by this app instead of the generation
engine:

    POST /classify  {"input_ids": [[int, ...], ...]}  → {"scores": [float, ...], "policy_version"}
    GET  /health, /info, /metrics                     as for any replica

A score is the classifier's first logit at each sequence's last token (right-padded batch,
the attention mask hides the padding). Scoring runs in one worker thread, so the event loop
keeps serving; a malformed body or an out-of-vocabulary id is a 400, never a crash.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from workers.llm.engines.hf.status_routes import add_status_routes

__all__ = ["create_classifier_app", "is_classifier"]

logger = logging.getLogger("rollout.llm.replica.classify")

_STATE = web.AppKey("classifier", dict)
MAX_SEQUENCES = 1024


def is_classifier(model_dir: str | Path) -> bool:
    """True when the directory holds a sequence-classification model."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return any(
        str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or []
    )


class _Classifier:
    def __init__(self, model_dir: str | Path, threads: int) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForSequenceClassification.from_pretrained(
            str(model_dir), dtype=torch.float32
        )
        self.model.eval()
        self.vocab = int(self.model.config.vocab_size)
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 2048))
        pad = self.model.config.pad_token_id
        self.pad = int(pad) if pad is not None else 0

    def score(self, sequences: list[list[int]]) -> list[float]:
        torch = self.torch
        longest = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), longest), self.pad, dtype=torch.long)
        mask = torch.zeros((len(sequences), longest), dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        with torch.inference_mode():
            logits = self.model(
                input_ids=ids, attention_mask=mask
            ).logits  # (B, T, labels) or (B, labels)
        if logits.dim() == 3:
            last = mask.sum(dim=1) - 1
            logits = logits[torch.arange(len(sequences)), last]
        return [float(x) for x in logits[:, 0]]


def _error(status: int, message: str, version: int) -> web.Response:
    body = {
        "error": {"message": message, "type": "invalid_request" if status < 500 else "server_error"}
    }
    return web.json_response({**body, "policy_version": version}, status=status)


async def create_classifier_app(
    model_dir: str | Path, *, replica_id: str = "rm-0", version: int = 0, threads: int = 1
) -> web.Application:
    classifier = await asyncio.to_thread(_Classifier, model_dir, threads)
    registry = CollectorRegistry(auto_describe=False)
    requests = Counter(
        "rollout_replica_classify_requests", "Classify requests.", ["replica"], registry=registry
    )
    sequences = Counter(
        "rollout_replica_classified_sequences", "Sequences scored.", ["replica"], registry=registry
    )
    gauge = Gauge(
        "rollout_replica_policy_version", "Version served.", ["replica"], registry=registry
    )
    gauge.labels(replica_id).set(version)
    lock = asyncio.Lock()
    app = web.Application()
    app[_STATE] = {"version": version}

    async def classify(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "body is not valid JSON", version)
        batch = body.get("input_ids") if isinstance(body, dict) else None
        unknown = set(body) - {"input_ids"} if isinstance(body, dict) else set()
        if unknown:
            return _error(400, f"unknown fields: {sorted(unknown)}", version)
        if not isinstance(batch, list) or not batch or len(batch) > MAX_SEQUENCES:
            return _error(
                400, f"input_ids must be a list of 1..{MAX_SEQUENCES} token-id lists", version
            )
        for seq in batch:
            if not isinstance(seq, list) or not seq or len(seq) > classifier.max_len:
                return _error(
                    400, f"each sequence needs 1..{classifier.max_len} token ids", version
                )
            if any(
                not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < classifier.vocab
                for t in seq
            ):
                return _error(
                    400, f"token ids must be integers in [0, {classifier.vocab})", version
                )
        async with lock:
            scores = await asyncio.to_thread(classifier.score, batch)
        requests.labels(replica_id).inc()
        sequences.labels(replica_id).inc(len(batch))
        return web.json_response({"scores": scores, "policy_version": version})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "version": version, "policy_version": version})

    async def info(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "replica_id": replica_id,
                "backend": "hf",
                "model": str(model_dir),
                "version": version,
                "max_model_len": classifier.max_len,
                "kind": "classifier",
                "policy_version": version,
                "started": time.time(),
            }
        )

    app.router.add_post("/classify", classify)
    add_status_routes(app, health=health, info=info, registry=registry)
    logger.info("reward model %s served as %s (version %d)", model_dir, replica_id, version)
    return app
