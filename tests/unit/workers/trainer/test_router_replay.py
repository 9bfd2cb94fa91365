"""Routing replay (R3) on tiny MoE models: the forward goes through exactly the recorded experts
(seen by hooks on the experts, independent of the mechanism), the gate weights are the live
router's renormalised over them, gradients reach every router, and without replay the mismatch
with routing recorded under other weights is counted."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from schemas.routing import RoutedExperts
from tests.unit.workers.trainer.moe_helpers import (
    EXPERTS,
    LAYERS,
    TOP_K,
    make_batch,
    moe_model,
    perturbed,
    routed,
    routers,
    sequences,
)
from workers.trainer.batching import TrajectoryBatch
from workers.trainer.exceptions import RouterReplayError
from workers.trainer.router_replay import (
    MISSING,
    RouterReplay,
    batch_routing,
    check_router_replay,
    moe_routers,
    routing_tensor,
)


def _batch(pairs: list[tuple[list[int], list[int]]], routing: list[RoutedExperts | None]) -> Any:
    """The collated batch, with its aligned routing tensor at `batch["routed_experts"]`."""
    out = make_batch(pairs, routing)
    out.tensors["routed_experts"] = batch_routing(out)
    return out


def _forward(model: Any, batch: TrajectoryBatch) -> Any:
    return model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
    )


class _Spy:
    """Forward pre-hooks on every layer's experts (what the layer really used) and forward
    hooks on every router registered before the replay's (the live router's own output)."""

    def __init__(self, model: Any) -> None:
        self.used: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.live: list[torch.Tensor] = []
        self.handles = []
        for layer in model.model.layers:
            self.handles.append(layer.mlp.experts.register_forward_pre_hook(self._experts))
            self.handles.append(layer.mlp.gate.register_forward_hook(self._gate))

    def _experts(self, module: Any, args: Any) -> None:
        self.used.append(args[1].detach())
        self.weights.append(args[2].detach())

    def _gate(self, module: Any, args: Any, out: Any) -> None:
        self.logits.append(out[0].detach())
        self.live.append(out[2].detach())

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "olmoe", "mixtral"])
def test_r3_forward_uses_exactly_the_recorded_experts_in_every_layer(arch: str) -> None:
    a = moe_model(0, arch=arch)
    b = perturbed(a)
    pairs = sequences()
    # Sample 0 recorded up to its prompt only (the rest routed live), sample 3 not at all.
    routing = [
        routed(a, p + r, tokens=len(p) if i == 0 else None) for i, (p, r) in enumerate(pairs)
    ]
    routing[3] = None
    batch = _batch(pairs, routing)
    recorded = batch["routed_experts"]
    spy = _Spy(b)
    try:
        with RouterReplay(b, recorded, replay=True):
            _forward(b, batch)
    finally:
        spy.close()
    assert len(spy.used) == LAYERS
    flat = recorded.reshape(-1, LAYERS, TOP_K).long()
    have = (flat >= 0).all(dim=-1)  # (B*S, layers)
    assert 0 < int(have[:, 0].sum()) < flat.shape[0]
    for layer in range(LAYERS):
        used, live = spy.used[layer], spy.live[layer]
        rows = have[:, layer]
        assert torch.equal(used[rows], flat[rows, layer])
        assert torch.equal(used[~rows], live[~rows])  # unrecorded: the live top-k
        probs = torch.softmax(spy.logits[layer], dim=-1, dtype=torch.float32)
        gate = probs.gather(-1, used)
        gate = gate / gate.sum(dim=-1, keepdim=True)  # the models renormalise (norm_topk_prob)
        torch.testing.assert_close(spy.weights[layer], gate)
    # b's own router disagrees with a's recording somewhere: the replay did something.
    assert any(
        bool((spy.live[layer][have[:, layer]] != flat[have[:, layer], layer]).any())
        for layer in range(LAYERS)
    )


def test_gate_weights_without_renormalisation_are_the_softmax_at_the_recorded_experts() -> None:
    a = moe_model(0, norm_topk_prob=False)
    pairs = sequences()
    batch = _batch(pairs, [routed(perturbed(a), p + r) for p, r in pairs])
    spy = _Spy(a)
    try:
        with RouterReplay(a, batch["routed_experts"], replay=True):
            _forward(a, batch)
    finally:
        spy.close()
    for layer in range(LAYERS):
        probs = torch.softmax(spy.logits[layer], dim=-1, dtype=torch.float32)
        torch.testing.assert_close(spy.weights[layer], probs.gather(-1, spy.used[layer]))


def test_replaying_a_models_own_routing_changes_nothing() -> None:
    a = moe_model(0)
    pairs = sequences()
    batch = _batch(pairs, [routed(a, p + r) for p, r in pairs])
    with torch.no_grad():
        plain = _forward(a, batch).logits
        with RouterReplay(a, batch["routed_experts"], replay=True):
            replayed = _forward(a, batch).logits
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(replayed[mask], plain[mask], rtol=1e-5, atol=1e-5)


def test_r3_gradients_reach_every_router() -> None:
    a = moe_model(0)
    b = perturbed(a).train()
    pairs = sequences()
    batch = _batch(pairs, [routed(a, p + r) for p, r in pairs])
    with RouterReplay(b, batch["routed_experts"], replay=True):
        logits = _forward(b, batch).logits
    logits.float().log_softmax(-1).max(-1).values.sum().backward()
    for gate in routers(b):
        assert gate.weight.grad is not None
        assert float(gate.weight.grad.abs().sum()) > 0


def test_counts_without_replay_see_the_mismatch_and_with_replay_none() -> None:
    a = moe_model(0)
    b = perturbed(a)
    pairs = sequences()
    batch = _batch(pairs, [routed(a, p + r) for p, r in pairs])
    positions = torch.zeros(batch["input_ids"].shape, dtype=torch.bool)
    positions[:, batch.prompt_length :] = batch["response_mask"] > 0
    counts = {}
    for replay in (False, True):
        with torch.no_grad(), RouterReplay(b, batch["routed_experts"], replay=replay) as r:
            _forward(b, batch)
        counts[replay] = r.counts(positions)
    off, r3 = counts[False], counts[True]
    # Every response token but each sample's last is recorded, in every layer.
    assert off["router_rows"] == sum(len(resp) - 1 for _, resp in pairs) * LAYERS
    assert 0 < off["router_mismatch_sum"] < off["router_rows"]
    assert "router_live_mismatch_sum" not in off
    assert r3["router_rows"] == off["router_rows"]
    assert r3["router_mismatch_sum"] == 0
    assert r3["router_live_mismatch_sum"] > 0
    # The same model's own routing: no mismatch.
    own = _batch(pairs, [routed(b, p + r) for p, r in pairs])
    with torch.no_grad(), RouterReplay(b, own["routed_experts"], replay=False) as r:
        _forward(b, own)
    assert r.counts(positions)["router_mismatch_sum"] == 0


def test_routing_tensor_aligns_rows_to_input_columns() -> None:
    rows = np.arange(5 * 2 * 1).reshape(5, 2, 1) % EXPERTS
    r = RoutedExperts.from_array(rows, num_experts=EXPERTS)
    longer = RoutedExperts.from_array(np.zeros((9, 2, 1), dtype=np.int64), num_experts=EXPERTS)
    out = routing_tensor([r, None, longer], starts=[2, 0, 1], lengths=[6, 4, 7], width=8)
    assert out is not None and out.dtype == torch.int16 and out.shape == (3, 8, 2, 1)
    assert (out[0, :2] == MISSING).all() and (out[0, 7:] == MISSING).all()
    assert torch.equal(out[0, 2:7].long(), torch.from_numpy(rows))
    assert (out[1] == MISSING).all()
    assert (out[2, 1:8] == 0).all() and (out[2, 0] == MISSING).all()  # rows past 7 dropped
    assert routing_tensor([None, None], [0, 0], [1, 1], 2) is None
    other = RoutedExperts.from_array(np.zeros((2, 3, 1), dtype=np.int64), num_experts=EXPERTS)
    with pytest.raises(RouterReplayError, match="different models"):
        routing_tensor([r, other], [0, 0], [2, 2], 4)


def test_routing_of_another_model_shape_is_refused() -> None:
    a = moe_model(0)
    wrong = torch.zeros((1, 4, LAYERS - 1, TOP_K), dtype=torch.int16)
    with pytest.raises(RouterReplayError, match=r"\(layers, top_k\)"):
        RouterReplay(a, wrong, replay=True)
    too_many = torch.full((1, 4, LAYERS, TOP_K), EXPERTS, dtype=torch.int16)
    with pytest.raises(RouterReplayError, match="experts"):
        RouterReplay(a, too_many, replay=False)


def test_dense_models_and_unknown_routers() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dense = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
        )
    )
    assert moe_routers(dense) == []
    assert "dense" in check_router_replay(dense, "off")
    with pytest.raises(RouterReplayError, match="no MoE layers"):
        check_router_replay(dense, "r3")
    # A dense model under a batch with routing: nothing installed, no counts.
    routing = torch.zeros((1, 3, 1, 1), dtype=torch.int16)
    with RouterReplay(dense, routing, replay=True) as r:
        dense(input_ids=torch.tensor([[1, 2, 3]]))
    assert r.counts(torch.ones((1, 3), dtype=torch.bool)) == {}

    moe = moe_model(0)
    assert len(moe_routers(moe)) == LAYERS
    assert "r3" in check_router_replay(moe, "r3")

    class SigmoidTopKRouter(torch.nn.Module):
        pass

    dense.model.extra = SigmoidTopKRouter()
    with pytest.raises(RouterReplayError, match="SigmoidTopKRouter"):
        moe_routers(dense)


def test_hooks_are_removed_also_when_the_forward_fails() -> None:
    a = moe_model(0)
    misaligned = torch.zeros((1, 99, LAYERS, TOP_K), dtype=torch.int16)
    with pytest.raises(RouterReplayError, match="not aligned"):
        with RouterReplay(a, misaligned, replay=True):
            a(input_ids=torch.tensor([[1, 2, 3]]))
    assert all(not gate._forward_hooks for gate in routers(a))


def test_the_trainer_refuses_r3_on_a_dense_model_at_start(tmp_path: Any) -> None:
    """Before anything is consumed: `Trainer._load` (the model, no broker) raises the one-line
    `RouterReplayError`; with `off` the same model loads."""
    from pipeline.harness.models.tiny import init_model
    from workers.kafka.config import KafkaConfig, TopicsConfig
    from workers.trainer.config import TrainerConfig
    from workers.trainer.trainer import Trainer

    model = init_model(tmp_path / "tiny", preset="tiny", seed=0)
    for mode in ("off", "r3"):
        config = TrainerConfig(
            model_dir=str(model), checkpoint_dir=str(tmp_path / mode), router_replay=mode
        )
        trainer = Trainer(KafkaConfig(), TopicsConfig(), config)
        if mode == "off":
            trainer._load()
            continue
        with pytest.raises(RouterReplayError, match="no MoE layers") as exc:
            trainer._load()
        assert "\n" not in str(exc.value)
