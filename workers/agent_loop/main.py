"""`rollout worker agent-loop`: how the agent-loop stage starts, runs and stops in a process.

`run(kafka, topics, config)` runs `app.AgentLoopWorker` until it is stopped and returns the
process's exit status:

- SIGTERM stops it gracefully (the prompts in flight get `grace_period_s` to finish), also
  one that arrives while it still imports or connects (`early_stop`); Ctrl-C says so on
  stderr, and a second Ctrl-C exits at once (130). Either way is safe: offsets are committed
  only after the outputs are acknowledged, so what was in flight is redelivered.
- A broker that cannot be reached, or a client that gave up on it, and prompts that failed
  (left unfinished, so they are redelivered) end it with `StageTempFailure` (exit 75,
  EX_TEMPFAIL): a supervisor starts it again, and nothing was committed past what is done.
- A Mixture-of-Experts policy's routing rides to the trainer (routing replay) unless
  `llm.return_routed_experts` says otherwise (`with_routing`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

from workers.agent_loop.config import AgentLoopWorkerConfig
from workers.kafka.config import KafkaConfig, TopicsConfig
from workers.stopping import StageTempFailure

__all__ = ["run", "with_routing"]


def with_routing(config: AgentLoopWorkerConfig) -> AgentLoopWorkerConfig:
    """`config` with `llm.return_routed_experts` decided: asked of a MoE policy, unless set."""
    if config.llm.return_routed_experts is not None:
        return config
    from workers.llm.moe import is_moe

    llm = config.llm.model_copy(update={"return_routed_experts": is_moe(config.model)})
    return config.model_copy(update={"llm": llm})


def run(
    kafka: KafkaConfig,
    topics: TopicsConfig,
    config: AgentLoopWorkerConfig,
    *,
    metrics: Any = None,
    early_stop: Any = None,
) -> int:
    """Run the stage until stopped; the exit status (module docstring). `early_stop`: an
    event set by a SIGTERM that came before the stage ran (it then stops at once)."""
    from workers.agent_loop.app import AgentLoopWorker

    config = with_routing(config)

    async def main() -> int:
        from aiokafka.errors import KafkaError

        from workers.kafka.exceptions import KafkaUnavailableError

        worker = AgentLoopWorker(kafka, topics, config, metrics=metrics)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, worker.stop)
        loop.add_signal_handler(signal.SIGINT, _interrupt_handler(worker, config.grace_period_s))
        if early_stop is not None and early_stop.is_set():
            worker.stop()
        try:
            await worker.run()
        except KafkaUnavailableError as exc:
            raise StageTempFailure(str(exc)) from exc
        except KafkaError as exc:
            raise StageTempFailure(f"Kafka at {kafka.bootstrap}: {exc}") from exc
        if lost := worker.counters["prompts_failed"]:
            raise StageTempFailure(
                f"stopped after {lost} prompt(s) failed (logged above); they are "
                "redelivered when a worker starts again"
            )
        return 0

    return asyncio.run(main())


def _interrupt_handler(worker: Any, grace_s: float) -> Any:
    """Ctrl-C: stop gracefully, saying so; a second Ctrl-C exits at once."""
    interrupted = False

    def on_interrupt() -> None:
        nonlocal interrupted
        if interrupted:
            print("rollout: aborted; unfinished prompts are redelivered", file=sys.stderr)
            os._exit(130)
        interrupted = True
        print(
            f"rollout: stopping: up to {grace_s:g} s for the prompts in flight "
            "(Ctrl-C again to abort)",
            file=sys.stderr,
        )
        worker.stop()

    return on_interrupt
