"""Rollout routing replay (R3): the trainer's forward of a MoE policy through the rollout's experts.

A Mixture-of-Experts layer routes each token to the top-k of its router's softmax. The replicas
route with the weights they serve; the trainer recomputes every logprob with its own weights
(newer by a few versions, and of other numerics), so its routers choose other experts for a
share of (token, layer) rows, and the importance weights of the loss compare two different
networks. R3 forces the trainer's forward through the experts the rollout recorded
(`schemas.routing.RoutedExperts`), with gate weights from the trainer's live router logits, so
the gradient still reaches every router.

Contracts:
- `moe_routers(model)`: the model's routers in MoE-layer order (the order of `RoutedExperts`'
  layer axis), recognised by class: routers that take the top-k of a softmax over all experts
  (`SOFTMAX_TOP_K`: Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral). A router of another kind
  (`*TopKRouter` not in the table: sigmoid or grouped gates) is refused with
  `RouterReplayError`: replaying it this way would compute other gate weights than the model.
  An empty list is a dense model.
- `routing_tensor(...)`: the routing of a batch as one int16 tensor (B, S, layers, top_k)
  aligned to the batch's `input_ids` columns; -1 marks a position with nothing recorded
  (padding, and positions past what the engine recorded), which the routers route live.
  `batch_routing(batch)` builds it for a `TrajectoryBatch` from its samples'
  `routed_experts` (each sequence's columns read off its attention mask: prompts are
  left-padded, responses right-padded, so a sequence is one run of ones).
- `RouterReplay(model, routed, replay=...)`: a context manager around ONE forward of `model`
  on a batch whose `input_ids` are (B, S). It installs a forward hook on every router. With
  `replay`, a router's (logits, weights, indices) output becomes: indices = the recorded
  experts where the row is recorded, the live top-k elsewhere; weights = softmax(logits) in
  fp32 gathered at those indices, renormalised over them when the router renormalises its
  own choice (`norm_topk_prob`; Mixtral always), in the router's own weight dtype. The logits
  are the live router's, so `d loss / d router.weight` flows through the weights. Without
  `replay` the outputs are untouched. Either way it keeps each layer's live top-k and the
  experts the layer used, so `counts(positions)` says on how many recorded (token, layer) rows
  they differ from the recording.
- Hooks are removed on exit, also when the forward raises. The context is for forwards whose
  backward needs no second forward (no activation checkpointing through the routers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from schemas.routing import RoutedExperts
from workers.trainer.batching import TrajectoryBatch
from workers.trainer.exceptions import RouterReplayError

__all__ = [
    "COUNT_KEYS",
    "MISSING",
    "SOFTMAX_TOP_K",
    "RouterReplay",
    "batch_routing",
    "check_router_replay",
    "moe_routers",
    "routing_tensor",
]

MISSING = -1
#: Every key `RouterReplay.counts` may return (the live one under replay only).
COUNT_KEYS = ("router_rows", "router_mismatch_sum", "router_live_mismatch_sum")

#: Router classes whose choice is top-k of softmax(logits) over all experts, and whether they
#: renormalise the chosen weights (an attribute name to read, or always).
SOFTMAX_TOP_K: dict[str, str | bool] = {
    "Qwen2MoeTopKRouter": "norm_topk_prob",
    "Qwen3MoeTopKRouter": "norm_topk_prob",
    "OlmoeTopKRouter": "norm_topk_prob",
    "MixtralTopKRouter": True,
}


def _renormalises(router: Any) -> bool:
    rule = SOFTMAX_TOP_K[type(router).__name__]
    return bool(getattr(router, rule)) if isinstance(rule, str) else rule


def moe_routers(model: Any) -> list[Any]:
    """The routers of `model` in layer order; [] for a dense model (module docstring)."""
    routers = []
    for module in model.modules():
        name = type(module).__name__
        if name in SOFTMAX_TOP_K:
            routers.append(module)
        elif name.endswith("TopKRouter"):
            raise RouterReplayError(
                f"{name}: routing replay supports routers that take the top-k of a softmax "
                f"({', '.join(sorted(SOFTMAX_TOP_K))}), not this one"
            )
    return routers


def check_router_replay(model: Any, mode: str) -> str:
    """At start: a line describing what `trainer.router_replay` will do with `model`.

    Raises `RouterReplayError` for `r3` on a model without MoE layers (a dense policy has no
    routing to replay: the setting names the wrong model, or is left over from another run)."""
    routers = moe_routers(model)
    arch = type(model).__name__
    if not routers:
        if mode == "r3":
            raise RouterReplayError(
                f"trainer.router_replay=r3, but {arch} has no MoE layers to replay "
                "(set trainer.router_replay=off for a dense model)"
            )
        return f"{arch}: dense, no routing"
    first = routers[0]
    shape = f"{len(routers)} MoE layers, top-{first.top_k} of {first.num_experts} experts"
    if mode == "r3":
        return f"{arch}: {shape}; the rollout's routing is replayed (r3)"
    return f"{arch}: {shape}; routed live, router_mismatch_rate logged"


def routing_tensor(
    routed: Sequence[RoutedExperts | None],
    starts: Sequence[int],
    lengths: Sequence[int],
    width: int,
) -> torch.Tensor | None:
    """The batch's routing, (B, width, layers, top_k) int16, or None when no sample has any.

    Sample i's sequence (`lengths[i]` tokens: prompt + response) occupies columns
    `starts[i] …` of `input_ids`; its recorded row j goes to column `starts[i] + j`. Rows past
    the sequence are ignored (nothing is fed there); columns without a row hold `MISSING`.
    Raises `RouterReplayError` when samples were recorded by models of different shapes."""
    present = [r for r in routed if r is not None]
    if not present:
        return None
    shapes = {(r.layers, r.top_k, r.num_experts) for r in present}
    if len(shapes) > 1:
        raise RouterReplayError(
            f"a batch's samples carry routing of different models (layers, top_k, experts): "
            f"{sorted(shapes)}"
        )
    layers, top_k, _ = shapes.pop()
    out = np.full((len(routed), width, layers, top_k), MISSING, dtype=np.int16)
    for i, (r, start, length) in enumerate(zip(routed, starts, lengths, strict=True)):
        if r is None:
            continue
        rows = r.as_array()[:length]
        out[i, start : start + len(rows)] = rows
    return torch.from_numpy(out)


def batch_routing(batch: TrajectoryBatch) -> torch.Tensor | None:
    """`routing_tensor` of `batch`'s samples, on the batch's device; None without routing."""
    if batch.routed_experts is None:
        return None
    attention = batch["attention_mask"]
    starts = (attention.cumsum(dim=1) == 0).sum(dim=1).tolist()  # the left padding
    lengths = attention.sum(dim=1).tolist()
    routed = routing_tensor(batch.routed_experts, starts, lengths, attention.shape[1])
    return None if routed is None else routed.to(attention.device)


class RouterReplay:
    """One forward's replay (or observation) of the recorded routing; see the module docstring.

    `routed`: (B, S, layers, top_k) from `routing_tensor` (any integer dtype), or None (then
    nothing is installed and `counts` is empty)."""

    def __init__(self, model: Any, routed: torch.Tensor | None, *, replay: bool) -> None:
        self.replay = replay
        self.routed = routed
        self.routers = moe_routers(model) if routed is not None else []
        self._handles: list[Any] = []
        self._live: list[torch.Tensor | None] = [None] * len(self.routers)
        self._used: list[torch.Tensor | None] = [None] * len(self.routers)
        if self.routers and routed is not None:
            self._check_shape(routed)

    def _check_shape(self, routed: torch.Tensor) -> None:
        first = self.routers[0]
        want = (len(self.routers), int(first.top_k))
        got = (int(routed.shape[2]), int(routed.shape[3])) if routed.dim() == 4 else None
        if got != want:
            raise RouterReplayError(
                f"the recorded routing has (layers, top_k) = {got}, the trained model "
                f"{want}: it was recorded by another model"
            )
        if int(routed.max()) >= int(first.num_experts):
            raise RouterReplayError(
                f"a recorded expert index is ≥ the model's {first.num_experts} experts"
            )

    def __enter__(self) -> RouterReplay:
        for layer, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(layer, router)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int, router: Any) -> Any:
        renormalise = _renormalises(router)

        def hook(module: Any, args: Any, output: Any) -> Any:
            logits, weights, live = output
            assert self.routed is not None
            recorded = self.routed[:, :, layer, :].reshape(-1, live.shape[-1])
            if recorded.shape[0] != live.shape[0]:
                raise RouterReplayError(
                    f"layer {layer} routed {live.shape[0]} tokens, the batch's routing "
                    f"covers {recorded.shape[0]}: the routing is not aligned to this forward"
                )
            recorded = recorded.to(device=live.device, dtype=live.dtype)
            self._live[layer] = live.detach().to(torch.int16)  # kept for `counts`: small
            if not self.replay:
                self._used[layer] = self._live[layer]
                return None
            have = (recorded >= 0).all(dim=-1, keepdim=True)
            chosen = torch.where(have, recorded, live)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            gate = probs.gather(-1, chosen)
            if renormalise:
                gate = gate / gate.sum(dim=-1, keepdim=True)
            self._used[layer] = chosen.detach().to(torch.int16)
            return logits, gate.to(weights.dtype), chosen

        return hook

    def counts(self, positions: torch.Tensor) -> dict[str, float]:
        """Over the recorded (token, layer) rows at `positions` ((B, S) bool, e.g. the
        response tokens): `router_rows`, `router_mismatch_sum` (rows whose experts used in the
        forward differ, as a set, from the recorded ones) and, with replay,
        `router_live_mismatch_sum` (rows where the live router would have chosen others).
        Empty when nothing was recorded or the model is dense."""
        if not self.routers or self.routed is None or any(u is None for u in self._used):
            return {}
        top_k = self.routed.shape[-1]
        recorded = self.routed.reshape(-1, len(self.routers), top_k).to(torch.long)
        recorded = recorded.to(positions.device)
        rows = positions.reshape(-1, 1) & (recorded >= 0).all(dim=-1)  # (B*S, layers)
        want = recorded.sort(dim=-1).values

        def differ(chosen: list[torch.Tensor | None]) -> float:
            got = torch.stack([c for c in chosen if c is not None], dim=1)
            got = got.to(device=want.device, dtype=want.dtype).sort(dim=-1).values
            return float(((got != want).any(dim=-1) & rows).sum())

        out = {"router_rows": float(rows.sum()), "router_mismatch_sum": differ(self._used)}
        if self.replay:
            out["router_live_mismatch_sum"] = differ(self._live)
        return out
