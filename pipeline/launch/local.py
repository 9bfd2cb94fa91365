"""Launch the whole pipeline on one machine, every stage its own process.

`LocalPipeline(cfg, run_dir, replicas=2)` writes the run's resolved config to
`run_dir/config.yaml` (secrets masked; they reach the children through the environment),
then starts, as real subprocesses of the same `rollout` CLI a user would run:

    hf replicas (+ a weight-sync controller beside each)   rollout replica serve / replica sync
    the judge's hf replicas (`reward.judge`; no sync)      rollout replica serve --role judge
    the agent-loop worker                                  rollout worker agent-loop
    the reward worker                                      rollout worker reward
    the replay stage                                       rollout worker replay
    the trainer                                            rollout train

Each process runs in the working directory `LocalPipeline` was made in (a relative path of
the config means there what it means in the user's shell; the checkout is put on PYTHONPATH)
and logs to `run_dir/logs/<name>.log`. Each sees only its own GPUs (`CUDA_VISIBLE_DEVICES`,
`pipeline.launch.devices`): a replica its TP x DP x PP, the trainer one per rank from what the
replicas leave, every other process none; what does not fit is refused before anything
starts. `stop()` (and leaving the context manager, also on Ctrl-C) sends SIGTERM to every
process group it started, waits a grace period (`STOP_GRACE_S`, longer than an adapter gives
its engine), and SIGKILLs what is left, in the sessions its processes began too (vLLM's:
`pipeline.launch.reap`) — it never touches a process it did not start.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipeline.config import RunConfig
from pipeline.launch.devices import VISIBLE, assign, visible_gpus
from pipeline.launch.reap import alive_in, kill_sessions, sessions_under
from schemas.errors import RolloutError
from workers.ports import free_port

__all__ = [
    "STAGES",
    "STOP_GRACE_S",
    "LocalPipeline",
    "StageExitedError",
    "StagePlan",
    "StageProcess",
    "child_env",
    "judge_plan",
    "log_tail",
    "secret_env",
    "serves_http",
    "spawn_logged",
]

log = logging.getLogger("rollout.launch")


class StageExitedError(RolloutError):
    """A stage of the local pipeline exited; the message ends with its log's last lines."""

    def __init__(self, name: str, code: int, tail: str) -> None:
        super().__init__(f"stage {name} exited with {code}:\n{tail}")
        self.name = name
        self.code = code


REPO = Path(__file__).resolve().parents[2]
STAGES = ("agent-loop", "reward", "replay", "train")
#: A stop's wait between SIGTERM and SIGKILL: longer than a replica's adapter gives its
#: engine (vLLM, SGLang) to stop (`child_server.KILL_GRACE_S`, 30 s; a test holds them in
#: that order), so the adapter is never killed while it stops the engine.
STOP_GRACE_S = 45.0


def spawn_logged(
    argv: list[str], log_path: Path, env: dict[str, str], cwd: str | Path = REPO
) -> subprocess.Popen[bytes]:
    """Start `argv` with its output appended to `log_path` and no stdin, as the leader of its
    own process group, so a stop can signal it together with whatever it started."""
    with log_path.open("ab") as log_file:
        return subprocess.Popen(
            argv,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )


def log_tail(log_path: Path, chars: int = 2000) -> str:
    """The last `chars` characters of a process's log ('' before it wrote one)."""
    try:
        return log_path.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return ""


def child_env(*extra: dict[str, str]) -> dict[str, str]:
    """This process's environment with `extra` over it, unbuffered output, and the checkout
    first on PYTHONPATH (the children run `-m pipeline.cli.main` from the user's directory)."""
    env = {**os.environ}
    for more in extra:
        env.update(more)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *paths])
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class StageProcess:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    cwd: Path = REPO

    def start(self, env: dict[str, str]) -> None:
        self.proc = spawn_logged(self.argv, self.log_path, env, self.cwd)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.proc is not None
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def tail(self, chars: int = 2000) -> str:
        return log_tail(self.log_path, chars)


@dataclass(frozen=True)
class StagePlan:
    """What decides the processes of one run, but the replicas' ports.

    Both launchers take these fields as keywords (`LocalPipeline(cfg, run_dir, model_dir=...,
    backend="vllm")`, `launch.ray.stages.up`) and start the same `processes`, so both run
    exactly the commands a user would type.
    """

    model_dir: str
    replica_threads: int = 1
    stages: tuple[str, ...] = STAGES
    agent_loop_workers: int = 1
    host: str = "127.0.0.1"
    backend: str = "hf"
    replica_args: tuple[str, ...] = ()  # appended to every `replica serve`
    # TP x DP x PP of one replica (a GPU backend's `--tp/--dp/--pp`; the hf backend: 1 each)
    parallel: tuple[int, int, int] = (1, 1, 1)
    # The LLM judge's pool (`reward.judge`, `judge_plan`): hf replicas of another model, on
    # the trainer's resources (colocated), registered with role judge and never synced.
    judge_model: str = ""
    judge_replicas: int = 0
    judge_threads: int = 1

    def processes(
        self,
        replica_ports: list[int],
        metrics_ports: dict[str, int] | None = None,
        judge_ports: list[int] | None = None,
    ) -> list[tuple[str, list[str]]]:
        """The processes as `(name, rollout CLI arguments)`, in start order.

        With more than one agent-loop worker they are named `agent-loop-0`, `agent-loop-1`,
        ... (one consumer group; Kafka shares the partitions). `metrics_ports` maps process
        names (not replicas: they serve `/metrics` on their own port) to the
        `--metrics-port` each gets. The judge's replicas, `judge-0`, ..., listen on
        `judge_ports` (one each); none has a sync controller.
        """
        judge_ports = judge_ports or []
        if len(judge_ports) != self.judge_replicas:
            raise ValueError(f"{self.judge_replicas} judge replicas, {len(judge_ports)} ports")
        plan: list[tuple[str, list[str]]] = []
        sizes = zip(("--tp", "--dp", "--pp"), self.parallel, strict=True)
        parallel = [a for flag, n in sizes for a in (flag, str(n))] if self.backend != "hf" else []
        for i, port in enumerate(replica_ports):
            url = f"http://{self.host}:{port}"
            plan.append((f"replica-{i}", [
                "replica", "serve",
                "--backend", self.backend,
                "--model", self.model_dir,
                "--port", str(port),
                "--replica-id", f"replica-{i}",
                "--threads", str(self.replica_threads),
                "--register",
                *parallel,
                *self.replica_args,
            ]))  # fmt: skip
            plan.append((f"sync-{i}", ["replica", "sync", "--replica", url]))
        for i, port in enumerate(judge_ports):
            plan.append((f"judge-{i}", [
                "replica", "serve",
                "--backend", "hf",
                "--model", self.judge_model,
                "--port", str(port),
                "--replica-id", f"judge-{i}",
                "--threads", str(self.judge_threads),
                "--register",
                "--role", "judge",
            ]))  # fmt: skip
        commands = {
            "agent-loop": ["worker", "agent-loop", "--model", self.model_dir],
            "reward": ["worker", "reward"],
            "replay": ["worker", "replay"],
            "train": ["train"],
        }
        for stage in self.stages:
            if stage not in commands:
                raise ValueError(f"unknown stage {stage!r}; known: {', '.join(commands)}")
            if stage == "agent-loop" and self.agent_loop_workers > 1:
                workers = range(self.agent_loop_workers)
                plan.extend((f"agent-loop-{i}", commands[stage]) for i in workers)
            else:
                plan.append((stage, commands[stage]))
        return _with_metrics_ports(plan, metrics_ports or {})


def judge_plan(cfg: RunConfig) -> dict[str, Any]:
    """The `StagePlan` fields of the run's judge pool (none when `reward.judge` is off)."""
    judge = cfg.reward.judge
    if not judge.enable or not judge.replicas:
        return {}
    assert judge.model is not None  # JudgeConfig checks it
    return {
        "judge_model": judge.model,
        "judge_replicas": judge.replicas,
        "judge_threads": judge.threads,
    }


def serves_http(name: str) -> bool:
    """Whether the process `name` is a replica (policy or judge): it serves `/metrics` on its
    own HTTP port and takes no `--metrics-port`."""
    return name.startswith(("replica-", "judge-"))


def _with_metrics_ports(
    plan: list[tuple[str, list[str]]], ports: dict[str, int]
) -> list[tuple[str, list[str]]]:
    names = {name for name, _ in plan if not serves_http(name)}
    if unknown := sorted(set(ports) - names):
        raise ValueError(f"no process takes --metrics-port: {', '.join(unknown)}")
    return [
        (name, [*argv, "--metrics-port", str(ports[name])] if name in ports else argv)
        for name, argv in plan
    ]


def secret_env(cfg: RunConfig) -> dict[str, str]:
    """Secrets travel to the children by environment, never in the config file on disk."""
    env: dict[str, str] = {}
    kafka = cfg.kafka
    if kafka.sasl_password is not None:
        env["ROLLOUT_KAFKA__SASL_PASSWORD"] = kafka.sasl_password.get_secret_value()
    if kafka.ssl_password is not None:
        env["ROLLOUT_KAFKA__SSL_PASSWORD"] = kafka.ssl_password.get_secret_value()
    return env


class LocalPipeline:
    """Every stage of one run as subprocesses; a context manager that always cleans up."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: str | Path,
        *,
        replicas: int = 2,
        extra_env: dict[str, str] | None = None,
        metrics: bool = False,
        gpus: Sequence[str] | None = None,
        grace_s: float = STOP_GRACE_S,
        **plan: Any,
    ) -> None:
        """`plan`: the fields of `StagePlan` (`model_dir`, `backend`, `agent_loop_workers`, ...);
        the judge's pool comes from `cfg` (`judge_plan`) unless `plan` says otherwise. `gpus`:
        the GPU ids to share out (None: `devices.visible_gpus()`, this machine's)."""
        self.cfg = cfg
        self.plan = StagePlan(**{**judge_plan(cfg), **plan})
        self.run_dir = Path(run_dir)
        self.replicas = replicas
        self.extra_env = extra_env or {}
        self.processes: list[StageProcess] = []
        self.replica_urls: list[str] = []
        self.judge_urls: list[str] = []
        self.metrics = metrics  # each non-replica process serves /metrics on a free port
        self.metrics_ports: dict[str, int] = {}
        self.gpus = gpus
        self.grace_s = grace_s  # a stop's wait between SIGTERM and SIGKILL
        # each process's CUDA_VISIBLE_DEVICES (`devices.assign`); empty: no GPU here, none set
        self.devices: dict[str, str] = {}
        self.cwd = Path.cwd()  # where the stages run: relative paths mean what they meant here

    # --- lifecycle --------------------------------------------------------------------

    def start(self) -> LocalPipeline:
        self.devices = self._devices()  # refused before anything starts
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        config_path = self.run_dir / "config.yaml"
        config_path.write_text(yaml.safe_dump(self.cfg.redacted(), sort_keys=False))
        env = child_env(self._secret_env(), self.extra_env)
        base = [sys.executable, "-m", "pipeline.cli.main", "--config", str(config_path)]
        ports = [free_port() for _ in range(self.replicas)]
        self.replica_urls = [f"http://127.0.0.1:{port}" for port in ports]
        judge_ports = [free_port() for _ in range(self.plan.judge_replicas)]
        self.judge_urls = [f"http://127.0.0.1:{port}" for port in judge_ports]
        plan = self.plan.processes(ports, judge_ports=judge_ports)
        if self.metrics:
            names = [name for name, _ in plan if not serves_http(name)]
            self.metrics_ports = {name: free_port() for name in names}
            plan = _with_metrics_ports(plan, self.metrics_ports)
        for name, argv in plan:
            self._add(name, [*base, *argv], env)
        return self

    def _devices(self) -> dict[str, str]:
        gpus = visible_gpus() if self.gpus is None else list(self.gpus)
        if not gpus:
            return {}
        train = "train" in self.plan.stages
        return assign(
            gpus,
            backend=self.plan.backend,
            replicas=self.replicas,
            parallel=self.plan.parallel,
            trainer_device=self.cfg.trainer.device if train else None,
            trainer_ranks=self.cfg.trainer.nproc,
        )

    def _env_of(self, name: str, env: dict[str, str]) -> dict[str, str]:
        """`env` with the process's own GPUs (none for all but replicas and the trainer)."""
        return {**env, VISIBLE: self.devices.get(name, "")} if self.devices else env

    def _add(self, name: str, argv: list[str], env: dict[str, str]) -> StageProcess:
        stage = StageProcess(name, argv, self.run_dir / "logs" / f"{name}.log", cwd=self.cwd)
        stage.start(self._env_of(name, env))
        self.processes.append(stage)
        log.info("started %s (pid %s)", name, stage.proc.pid if stage.proc else "?")
        return stage

    def _secret_env(self) -> dict[str, str]:
        return secret_env(self.cfg)

    def check(self) -> None:
        """Raise if any stage died (with the end of its log)."""
        for stage in self.processes:
            if stage.proc is not None and stage.proc.poll() is not None:
                raise StageExitedError(stage.name, stage.proc.returncode, stage.tail())

    def process(self, name: str) -> StageProcess:
        return next(p for p in self.processes if p.name == name)

    def restart(self, name: str) -> StageProcess:
        """Start a stage again with the same command (after it was killed)."""
        old = self.process(name)
        env = child_env(self._secret_env(), self.extra_env)
        old.start(self._env_of(name, env))
        return old

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM every stage's group, wait `grace_s` (default `self.grace_s`) for them and
        for every process of their sessions (`reap`: vLLM's own), then SIGKILL what is left."""
        grace_s = self.grace_s if grace_s is None else grace_s
        sessions = self._sessions()
        # Producers first, so downstream stages can drain what is already on the topics.
        for stage in reversed(self.processes):
            stage.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            sessions |= self._sessions()
            if not any(s.alive for s in self.processes) and not alive_in(sessions):
                break
            time.sleep(0.2)
        sessions |= self._sessions()
        for stage in self.processes:
            if stage.alive:
                log.warning("%s did not stop within %.0fs; killing it", stage.name, grace_s)
                stage.signal(signal.SIGKILL)
        if left := kill_sessions(sessions):
            log.warning("killed %d process(es) the stages left behind: %s", len(left), left)
        for stage in self.processes:
            if stage.proc is not None:
                try:
                    stage.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass

    def _sessions(self) -> set[int]:
        """The sessions of the live stages and of every process under them."""
        return sessions_under(p.proc.pid for p in self.processes if p.alive and p.proc)

    def __enter__(self) -> LocalPipeline:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def summary(self) -> dict[str, Any]:
        return {
            p.name: {
                "pid": p.proc.pid if p.proc else None,
                "alive": p.alive,
                "log": str(p.log_path),
            }
            for p in self.processes
        }
