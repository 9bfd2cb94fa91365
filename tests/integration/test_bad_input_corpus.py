"""The bad-input corpus (`tests/corpus/bad_inputs.py`) through the real stages on the real broker.

Each stage run starts once over an input topic holding all of its bad cases interleaved with
valid messages, under a topic prefix of its own: the agent-loop worker in-process (a scripted
replica, the corpus' tools), three reward stages (`rollout worker reward`: rule scorer,
custom function in the process pool, custom function in a thread with `on_failure=score`) and
the replay stage (`rollout worker replay`) as subprocesses, started together so they
overlap, and the trainer's `TrajectoryConsumer` on `rl.replay`. Then every output, dead
letter and trajectory is read back and attributed to its case by key/uid:

- every valid message produced its output (valid traffic flows on around the bad cases);
- every case ended as its `Expect` says (`test_case[...]`; known bugs are strict xfails);
- nothing is unaccounted for; the per-case table is printed (`-s`) and written to a file.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from schemas.codec import decode
from schemas.deadletter import DeadLetter
from schemas.errors import DecodeError
from schemas.events import ScoredTrajectory, TrainingGroup, TurnEvent
from tests.conftest import REPO, ROLLOUT
from tests.corpus.bad_inputs import CASES, Case, Message, replica_script, valid_messages
from workers.kafka.clients import make_consumer, make_producer
from workers.kafka.config import KafkaConfig, TopicsConfig

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

RUNS = [
    ("agent-loop", "default"),
    ("reward", "rule"),
    ("reward", "process"),
    ("reward", "thread"),
    ("replay", "default"),
    ("trainer", "default"),
]
DEADLINE_S = 150.0  # every stage's results are in well before this, or something is stuck
QUIET_S = 12.0  # after the inputs are consumed: this long without news ends the wait
TOOLS = {
    "tools": [
        {"class_name": "workers.agent_loop.tools.calculator.CalculatorTool"},
        {
            "class_name": "workers.agent_loop.tools.code_interpreter.CodeInterpreterTool",
            "config": {"limits": {"wall_time_s": 2, "cpu_time_s": 2}},
        },
        {"function": "tests.corpus.tools:corpus_raises"},
        {"function": "tests.corpus.tools:corpus_sleeps"},
        {"function": "tests.corpus.tools:corpus_floods"},
        {"class_name": "tests.corpus.tools.BrokenTool"},
        {"class_name": "tests.corpus.tools.InfraTool"},
    ]
}


@dataclass
class Observed:
    """What became of one case (or one valid message): everything found for its key/uid."""

    letters: list[DeadLetter] = field(default_factory=list)
    scored: list[ScoredTrajectory] = field(default_factory=list)
    turns: list[TurnEvent] = field(default_factory=list)
    groups: list[TrainingGroup] = field(default_factory=list)
    undecodable: list[str] = field(default_factory=list)  # outputs no consumer can read
    tool_text: str = ""

    @property
    def completed(self) -> bool:
        return any(t.final for t in self.turns)

    def summary(self) -> str:
        parts = []
        for letter in self.letters:
            message = letter.error_message.replace("\n", " ")
            parts.append(f"dlq {letter.stage}/{letter.error_cause}: {message[:90]}")
        for s in self.scored:
            if s.reward_extra.get("reward_failed"):
                cause, error = (
                    s.reward_extra.get("reward_error_cause"),
                    s.reward_extra.get("reward_error"),
                )
                parts.append(f"failure_score {cause}: {str(error)[:80]}")
            else:
                parts.append(f"scored {s.reward_score:g}")
        if self.turns:
            state = "complete" if self.completed else "INCOMPLETE"
            said = self.tool_text.rsplit("<tool_response>", 1)[-1].split("</tool_response>")[0]
            tool = f", tool said {said.strip()[-70:]!r}" if self.tool_text else ""
            parts.append(f"trajectory {state} ({len(self.turns)} turns{tool})")
        parts += [f"{len(g.samples)}-sample group" for g in self.groups]
        parts += [f"UNDECODABLE output: {u[:80]}" for u in self.undecodable]
        return "; ".join(parts) or "NOTHING (silently dropped or stuck)"


@dataclass
class Verdict:
    case: Case
    observed: Observed
    ok: bool
    why: str


def judge(case: Case, seen: Observed) -> Verdict:
    """Does what was observed match what the case expects (and nothing else)?"""
    e = case.expect
    problems = []
    if e.outcome == "dlq":
        match = [x for x in seen.letters if x.error_cause == e.cause and x.stage == case.stage]
        if not match:
            problems.append(f"no {case.stage} dead letter with cause {e.cause!r}")
        elif e.contains and not any(e.contains in x.error_message for x in match):
            problems.append(f"reason lacks {e.contains!r}")
        if seen.scored or seen.completed or seen.groups:
            problems.append("also flowed on as output")
    elif e.outcome == "failure_score":
        tagged = [s for s in seen.scored if s.reward_extra.get("reward_failed")]
        if not tagged or tagged[0].reward_extra.get("reward_error_cause") != e.cause:
            problems.append(f"no failure score tagged {e.cause!r}")
        elif e.contains not in str(tagged[0].reward_extra.get("reward_error")):
            problems.append(f"reward_error lacks {e.contains!r}")
        if seen.letters:
            problems.append("also dead-lettered")
    elif e.outcome == "in_band":
        if not seen.completed:
            problems.append("trajectory did not complete")
        elif e.contains not in seen.tool_text:
            problems.append(f"tool response lacks {e.contains!r}")
        if seen.letters:
            problems.append("also dead-lettered")
    elif e.outcome == "output":
        if not (seen.completed or seen.scored or seen.groups) or seen.letters:
            problems.append("did not flow on as output")
    if seen.undecodable:
        problems.append("emitted an undecodable output")
    return Verdict(case, seen, not problems, "; ".join(problems) or "as expected")


# --- running the stages -------------------------------------------------------------------


def _interleave(bad: list[Message], valid: list[Message]) -> list[Message]:
    out = list(bad)
    for i, message in enumerate(valid):
        out.insert(min(len(out), (i * (len(bad) + len(valid))) // max(1, len(valid))), message)
    return out


def _produce(kafka: KafkaConfig, topic: str, messages: list[Message]) -> None:
    producer = make_producer(kafka)
    try:
        for m in messages:
            producer.send(topic, key=m.key, value=m.value, headers=m.headers)
        producer.flush(timeout=60)
    finally:
        producer.close()


def _read(
    kafka: KafkaConfig, topic: str, *, until: Callable[[list[Any]], bool], timeout_s: float
) -> list[Any]:
    consumer = make_consumer(kafka, topic, group_id=None)
    records: list[Any] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and not until(records):
            for batch in consumer.poll(timeout_ms=300).values():
                records.extend(batch)
    finally:
        consumer.close()
    return records


class StageProcess:
    """`rollout --config … worker reward|replay` with a config file of its own."""

    def __init__(
        self,
        name: str,
        section: dict[str, Any],
        kafka: KafkaConfig,
        topics: TopicsConfig,
        tmp: Path,
    ) -> None:
        config = tmp / f"{name}-{topics.prefix}json"
        config.write_text(
            json.dumps(
                {
                    "kafka": {"bootstrap_servers": kafka.bootstrap},
                    "topics": {"prefix": topics.prefix},
                    name: section,
                }
            )
        )
        self.log = tmp / f"{name}-{topics.prefix}log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                # niced: their start-up must not starve the in-process agent-loop worker
                ["nice", "-n", "10", *ROLLOUT, "--config", str(config), "worker", name],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def _stage_section(
    stage: str, run: str, topics: TopicsConfig, tmp: Path, model: Path
) -> dict[str, Any]:
    base = {
        "group_id": f"{topics.prefix}app",
        "session_timeout_s": 6,
        "commit_interval_s": 1.0,
        "batch_size": 64,
    }
    if stage == "replay":
        return {**base, "n": 2, "group_timeout_s": 300, "sweep_interval_s": 1.0}
    base |= {"tokenizer": str(model), "pool_workers": 1, "scorer_timeout_s": 2.0}
    custom = {"path": "tests.corpus.rewards", "name": "compute_score"}
    if run == "process":
        return {**base, "custom": {**custom, "executor": "process", "kwargs": {"hang_s": 60}}}
    if run == "thread":
        return {
            **base,
            "on_failure": "score",
            "custom": {**custom, "executor": "thread", "kwargs": {"hang_s": 5}},
        }
    return base


async def _run_agent_loop(
    kafka: KafkaConfig, topics: TopicsConfig, model: Path, expected: int
) -> tuple[dict[str, int], str]:
    from transformers import AutoTokenizer

    from tests.integration.agent_helpers import ScriptedReplica
    from workers.agent_loop.app import AgentLoopWorker
    from workers.agent_loop.config import AgentLoopConfig, AgentLoopWorkerConfig
    from workers.agent_loop.tools import load_tools
    from workers.llm.contract import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model)
    replica = await ScriptedReplica(tokenizer, replica_script).start()
    cfg = AgentLoopWorkerConfig(
        group_id=f"{topics.prefix}agent-loop",
        model=str(model),
        n=1,
        replicas=[replica.address],
        sampling=SamplingParams(max_tokens=128, temperature=0.0),
        commit_interval_s=0.5,
        grace_period_s=5.0,
        loops={
            "max_prompt_length": 2048,
            "max_response_length": 2048,
            "options": {**AgentLoopConfig().options, "tool_timeout_s": 2.5},
        },
    )
    worker = AgentLoopWorker(kafka, topics, cfg, tokenizer=tokenizer, tools=load_tools(TOOLS))
    task = asyncio.create_task(worker.run())
    c = worker.counters
    deadline = time.monotonic() + DEADLINE_S
    last, changed = None, time.monotonic()
    try:
        while not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            now = (c["prompts_started"], c["dead_letters"], c["trajectories"], c["turns"])
            if now != last:
                last, changed = now, time.monotonic()
            if c["dead_letters"] + c["trajectories"] >= expected:
                break
            if c["prompts_started"] >= expected and time.monotonic() - changed > QUIET_S:
                break
    finally:
        worker.stop()
        try:
            await asyncio.wait_for(task, timeout=60)
        except Exception as exc:  # judged by test_agent_loop_worker_survives, not hidden
            crash = f"{type(exc).__name__}: {str(exc)[:300]}"
        else:
            crash = ""
        await replica.close()
    return dict(c), crash


@dataclass
class CorpusRun:
    verdicts: dict[str, Verdict]
    valid: dict[str, tuple[str, Observed]]  # uid → (stage/run, observed)
    table: str
    seconds: float
    agent_loop_crash: str


def _letters(records: list[Any]) -> list[DeadLetter]:
    return [DeadLetter.from_message(list(r.headers or []), r.key, r.value) for r in records]


def _attribute(
    owner: dict[bytes, str], seen: dict[str, Observed], records: list[Any], what: str
) -> None:
    """File each output record under the case/valid id its key or uid belongs to."""
    for record in records:
        try:
            event = decode(record.value)
        except DecodeError as exc:
            key = owner.get(record.key or b"", f"?{record.key!r}")
            seen[key].undecodable.append(f"{what}: {exc}")
            continue
        uid = getattr(event, "uid", "") or ""
        target = uid if uid in seen else owner.get(record.key or b"", f"?{uid}")
        if isinstance(event, TurnEvent):
            seen[target].turns.append(event)
        elif isinstance(event, ScoredTrajectory):
            seen[target].scored.append(event)
        elif isinstance(event, TrainingGroup):
            seen[target].groups.append(event)


OUTPUTS = {
    "agent-loop": ["turns"],
    "reward": ["scored"],
    "replay": ["replay", "stale"],
    "trainer": [],
}


def _collect(
    kafka: KafkaConfig,
    topics: TopicsConfig,
    stage: str,
    mine: dict[str, Observed],
    owner: dict[bytes, str],
    proc: StageProcess | None,
    deadline: float,
) -> bool:
    """Read one run's outputs and dead letters back until every case and valid message is
    accounted for, the run has been quiet for QUIET_S (counted once it has answered: start-up
    can be slow), its process died, or the deadline passed. True if all are accounted for."""
    counts: dict[str, int] = {}
    quiet_until = time.monotonic() + QUIET_S
    while True:
        records = {
            role: _read(kafka, topics.name(role), until=lambda r: False, timeout_s=1.0)
            for role in [*OUTPUTS[stage], "dlq"]
        }
        now = {role: len(batch) for role, batch in records.items()}
        if not any(now.values()) or now != counts:
            counts, quiet_until = now, time.monotonic() + QUIET_S
        for obs in mine.values():
            obs.letters, obs.scored, obs.undecodable = [], [], []
            if stage != "trainer":  # the trainer's groups were handed out in-process
                obs.turns, obs.groups = [], []
        for letter in _letters(records["dlq"]):
            mine[owner.get(letter.key or b"", f"?{letter.key!r}")].letters.append(letter)
        for role in OUTPUTS[stage]:
            _attribute(owner, mine, records[role], role)
        done = all(
            o.letters or o.scored or o.completed or o.groups or o.undecodable for o in mine.values()
        )
        stopped = proc is not None and proc.proc.poll() is not None
        if done or stopped or time.monotonic() > min(deadline, quiet_until):
            return done


def _table(verdicts: list[Verdict], valid: dict[str, tuple[str, Observed]], seconds: float) -> str:
    rows = [("case", "stage/run", "input", "expected", "observed", "verdict")]
    for v in verdicts:
        c = v.case
        verdict = (
            ("ok" if v.ok else f"FAIL: {v.why}")
            if c.bug is None
            else (f"XFAIL (known bug): {v.why}" if not v.ok else "XPASS: bug fixed? drop the xfail")
        )
        rows.append(
            (c.id, f"{c.stage}/{c.run}", c.what, c.expect.describe(), v.observed.summary(), verdict)
        )
    for uid, (where, seen) in sorted(valid.items()):
        rows.append((uid, where, "valid traffic", "output", seen.summary(), ""))
    ok = sum(v.ok for v in verdicts if v.case.bug is None)
    known = sum(v.case.bug is not None for v in verdicts)
    lines = [" | ".join(row) for row in rows]
    lines.append(
        f"{len(verdicts)} cases: {ok} as expected, {known} known bugs (xfail), "
        f"{len(verdicts) - ok - known} failing; {len(valid)} valid messages; {seconds:.0f} s"
    )
    return "\n".join(lines)


@pytest.fixture(scope="module")
def corpus(
    kafka_bootstrap: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CorpusRun]:
    from transformers import AutoTokenizer

    from pipeline.topics import create_topics
    from workers.trainer.consumer import TrajectoryConsumer

    started = time.monotonic()
    tmp = tmp_path_factory.mktemp("corpus")
    kafka = KafkaConfig(bootstrap_servers=kafka_bootstrap)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tag = uuid.uuid4().hex[:8]
    topics: dict[tuple[str, str], TopicsConfig] = {}
    owner: dict[tuple[str, str], dict[bytes, str]] = {}  # run → record key → case/valid id
    seen: dict[tuple[str, str], dict[str, Observed]] = {}
    inputs = {"agent-loop": "prompts", "reward": "turns", "replay": "scored", "trainer": "replay"}
    for stage, run in RUNS:
        t = topics[stage, run] = TopicsConfig(prefix=f"corpus-{tag}-{stage}-{run}.")
        create_topics(kafka, t)
        cases = [c for c in CASES if (c.stage, c.run) == (stage, run)]
        bad = [c.build(tok) for c in cases]
        valid = valid_messages(stage, run, tok)  # type: ignore[arg-type]
        keys = owner[stage, run] = {}
        for case, message in zip(cases, bad, strict=True):
            for key in (message.key, case.id.encode(), f"{case.id}/0".encode()):
                keys.setdefault(key or b"", case.id)
        for uid, messages in valid.items():
            for m in messages:
                keys[m.key or b""] = uid
        seen[stage, run] = defaultdict(Observed)
        for name in [c.id for c in cases] + list(valid):
            seen[stage, run][name] = Observed()
        _produce(
            kafka, t.name(inputs[stage]), _interleave(bad, [m for ms in valid.values() for m in ms])
        )

    procs = {
        (stage, run): StageProcess(
            stage, _stage_section(stage, run, t, tmp, tiny_model), kafka, t, tmp
        )
        for (stage, run), t in topics.items()
        if stage in ("reward", "replay")
    }
    try:
        al = ("agent-loop", "default")
        counters, crash = asyncio.run(_run_agent_loop(kafka, topics[al], tiny_model, len(seen[al])))
        print(f"\nagent-loop counters: {counters}; crash: {crash or 'none'}")

        tr = ("trainer", "default")
        with TrajectoryConsumer(
            kafka, topics[tr], topic="replay", group_id=None, assign=True, name="trainer"
        ) as src:
            for item in iter(lambda: src.next_item(3.0), None):
                uid = item.event.uid
                seen[tr][
                    uid if uid in seen[tr] else owner[tr].get(item.key or b"", uid)
                ].groups.append(item.event)

        deadline = time.monotonic() + DEADLINE_S
        for (stage, run), t in topics.items():
            done = _collect(
                kafka,
                t,
                stage,
                seen[stage, run],
                owner[stage, run],
                procs.get((stage, run)),
                deadline,
            )
            if not done and (stage, run) in procs:
                print(f"--- {stage}/{run} log tail ---\n{procs[stage, run].tail()}")
    finally:
        for proc in procs.values():
            proc.stop()

    for obs in seen["agent-loop", "default"].values():  # what the tools answered, as text
        turns = sorted(obs.turns, key=lambda turn: turn.turn_index)
        tool_ids = [int(i) for turn in turns if turn.role == "tool" for i in turn.token_ids]
        obs.tool_text = tok.decode(tool_ids, skip_special_tokens=False) if tool_ids else ""

    verdicts = {c.id: judge(c, seen[c.stage, c.run][c.id]) for c in CASES}
    valid_ids = {
        uid: (f"{s}/{r}", obs)
        for (s, r), m in seen.items()
        for uid, obs in m.items()
        if uid.startswith("valid-")
    }
    strays = {
        f"{s}/{r}:{k}": o.summary()
        for (s, r), m in seen.items()
        for k, o in m.items()
        if k.startswith("?")
    }
    seconds = time.monotonic() - started
    table = _table(list(verdicts.values()), valid_ids, seconds)
    if strays:
        table += f"\nunattributed outputs: {strays}"
    (tmp / "outcomes.txt").write_text(table + "\n")
    print(f"\n{table}\n(written to {tmp / 'outcomes.txt'})")
    yield CorpusRun(verdicts, valid_ids, table, seconds, crash)


def test_valid_traffic_flows_on(corpus: CorpusRun) -> None:
    missing = {
        uid: f"{where}: {obs.summary()}"
        for uid, (where, obs) in corpus.valid.items()
        if not (
            obs.completed
            or obs.groups
            or any(not s.reward_extra.get("reward_failed") for s in obs.scored)
        )
        or obs.letters
    }
    assert not missing, missing
    assert "unattributed outputs" not in corpus.table, corpus.table


def test_agent_loop_worker_survives(corpus: CorpusRun) -> None:
    """The worker must shut down cleanly after the corpus (it raised out of run() once, when
    CPU starvation made the group rebalance: AgentLoopWorker._commit lets CommitFailedError out)."""
    assert not corpus.agent_loop_crash, corpus.agent_loop_crash


def test_corpus_is_large_and_every_case_accounted_for(corpus: CorpusRun) -> None:
    assert len(corpus.verdicts) >= 30
    silent = [
        cid
        for cid, v in corpus.verdicts.items()
        if v.observed.summary().startswith("NOTHING") and v.case.bug is None
    ]
    assert not silent, f"cases with no outcome at all: {silent}"


@pytest.mark.parametrize(
    "case_id",
    [
        pytest.param(c.id, marks=pytest.mark.xfail(strict=True, reason=c.bug)) if c.bug else c.id
        for c in CASES
    ],
)
def test_case(corpus: CorpusRun, case_id: str) -> None:
    verdict = corpus.verdicts[case_id]
    assert verdict.ok, f"{case_id}: {verdict.why}; observed: {verdict.observed.summary()}"
