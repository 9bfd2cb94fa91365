"""Plug in your own trainer: read training groups from the pipeline, update your policy, send
its weights back to the replicas, checkpoint where you are, resume there. Runnable as it is:

    python examples/own_trainer.py --bootstrap localhost:9092 --state my-trainer.json \
        --model ./model --out my-checkpoints

With `--model`, each step is a plain PyTorch policy-gradient update of that model (the
advantage-weighted log-likelihood of the response tokens, one AdamW step) and
`PolicyPublisher` sends the new weights by the run's `weights.mode` (checkpoints
under `--out`, or `--set weights.mode=broadcast`: over a process group, no disk)
and publishes the version on the policy topic, so the replicas serve it and the pipeline's
staleness gate follows. Without `--model` the step is a stand-in you replace.

Every run continues after the last group the previous run handed to its step: the consumer's
positions are saved with your state (here a JSON file; in a real trainer, with the weights), so
a crash between a step and its save replays that step's groups, and nothing is skipped.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pipeline.clients import PolicyPublisher, TrajectoryConsumer
from pipeline.config import load_config, parse_overrides


def policy_gradient_step(model: Any, optimizer: Any, batch: Any) -> float:
    """One update: −(advantage × log π(response token)), averaged over the model's tokens."""
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    )
    responses = batch["responses"].shape[1]
    # The logits at position t score the token at t + 1; the last `responses` of them score
    # the response tokens (prompts are left-padded, responses right-padded).
    logits = out.logits[:, -responses - 1 : -1].float()
    logp = logits.log_softmax(-1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    mask = batch["response_mask"].float()  # 0 on tool tokens and padding
    loss = -(batch["advantages"] * logp * mask).sum() / mask.sum().clamp(min=1.0)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="The run's YAML config (else $ROLLOUT_CONFIG).")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers.")
    parser.add_argument("--set", action="append", default=[], help="key=value overrides.")
    parser.add_argument("--state", default="my-trainer.json", help="Where positions are kept.")
    parser.add_argument("--batch", type=int, default=8, help="Groups per step.")
    parser.add_argument("--wait", type=float, default=10.0, help="Stop after this long idle.")
    parser.add_argument("--model", help="Train this model directory and publish its weights.")
    parser.add_argument("--out", default="my-checkpoints", help="Checkpoints (with --model).")
    parser.add_argument("--steps", type=int, help="Stop after this many steps (in all).")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate.")
    args = parser.parse_args()

    # 1. The run's config: the same file, ROLLOUT_ variables and overrides as `rollout`.
    overrides = parse_overrides(args.set)
    if args.bootstrap:
        overrides.setdefault("kafka", {})["bootstrap_servers"] = args.bootstrap
    cfg = load_config(args.config, overrides)

    # 2. Where the last run stopped (positions saved with the state of the last step).
    state_file = Path(args.state)
    state = json.loads(state_file.read_text()) if state_file.exists() else {"steps": 0}

    # 3. Your policy and the publisher of its versions (a real trainer resumes its weights).
    model = optimizer = publisher = None
    if args.model:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        publisher = PolicyPublisher.from_config(
            cfg, tokenizer_from=args.model, checkpoint_dir=args.out
        )
        if publisher.mode == "broadcast":
            # Replicas started for broadcast serve nothing until they hold weights: these.
            publisher.publish(model, state.get("published", 0))

    # 4. Read whole groups (rl.replay) as padded torch batches. Without max_wait_s, batches()
    #    waits for ever; with it, it ends after that long without a new group.
    try:
        with TrajectoryConsumer(
            cfg.kafka,
            cfg.topics,
            topic="replay",
            group_id="my-trainer",
            assign=True,  # every partition, no group rebalances: positions are ours alone
            positions=state.get("positions"),
        ) as source:
            for batch in source.batches(args.batch, max_wait_s=args.wait):
                # batch[name] for name in: prompts, responses, input_ids, attention_mask,
                # position_ids, response_mask, old_logprobs, advantages, token_level_rewards,
                # truncated; and per sample: trajectory_ids, uids, min/max_global_steps.
                if model is not None:
                    loss = policy_gradient_step(model, optimizer, batch)
                else:
                    loss = -(batch["advantages"] * batch["response_mask"]).sum().item()
                state["steps"] += 1
                state["groups"] = state.get("groups", 0) + len(set(batch.uids))
                state["last_loss"] = loss
                state["versions"] = [batch.min_version, batch.max_version]
                # 5. The new weights to the replicas, the version on the policy topic.
                if publisher is not None:
                    publisher.publish(model, state["steps"], groups_trained=state["groups"])
                    state["published"] = state["steps"]
                # 6. Save the positions with the step's result, atomically.
                state["positions"] = source.positions()
                tmp = state_file.with_suffix(".tmp")
                tmp.write_text(json.dumps(state))
                tmp.replace(state_file)
                source.commit()  # optional: shows the group's lag in `rollout status`
                if args.steps is not None and state["steps"] >= args.steps:
                    break
    finally:
        if publisher is not None:
            publisher.close()  # broadcast: serves the replicas still behind first
    print(json.dumps(state))


if __name__ == "__main__":
    main()
