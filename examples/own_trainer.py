"""Plug in your own trainer: read training groups from the pipeline, checkpoint where you are,
resume there. Runnable as it is (the "training" is a stand-in you replace):

    python examples/own_trainer.py --bootstrap localhost:9092 --state my-trainer.json

Every run continues after the last group the previous run handed to its step: the consumer's
positions are saved with your state (here a JSON file; in a real trainer, with the weights), so
a crash between a step and its save replays that step's groups, and nothing is skipped.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.clients import TrajectoryConsumer
from pipeline.config import load_config, parse_overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="The run's YAML config (else $ROLLOUT_CONFIG).")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers.")
    parser.add_argument("--set", action="append", default=[], help="key=value overrides.")
    parser.add_argument("--state", default="my-trainer.json", help="Where positions are kept.")
    parser.add_argument("--batch", type=int, default=8, help="Groups per step.")
    parser.add_argument("--wait", type=float, default=10.0, help="Stop after this long idle.")
    args = parser.parse_args()

    # 1. The run's config: the same file, ROLLOUT_ variables and overrides as `rollout`.
    overrides = parse_overrides(args.set)
    if args.bootstrap:
        overrides.setdefault("kafka", {})["bootstrap_servers"] = args.bootstrap
    cfg = load_config(args.config, overrides)

    # 2. Where the last run stopped (positions saved with the state of the last step).
    state_file = Path(args.state)
    state = json.loads(state_file.read_text()) if state_file.exists() else {"steps": 0}

    # 3. Read whole groups (rl.replay) as padded torch batches. Without max_wait_s, batches()
    #    waits for ever; with it, it ends after that long without a new group.
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
            loss = -(batch["advantages"] * batch["response_mask"]).sum().item()  # your step
            state["steps"] += 1
            state["groups"] = state.get("groups", 0) + len(set(batch.uids))
            state["last_loss"] = loss
            state["versions"] = [batch.min_version, batch.max_version]
            # 4. Save the positions with the step's result, atomically.
            state["positions"] = source.positions()
            tmp = state_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            tmp.replace(state_file)
            source.commit()  # optional: shows the group's lag in `rollout status`
    print(json.dumps(state))


if __name__ == "__main__":
    main()
