"""The import graph of the source tree, read from every file's AST, keeps the layering.

Layers, lowest first: `schemas` (the contract: events, codec, header names) → `workers`
(`workers.kafka`, `workers.metrics` and the like the shared plumbing; then the two shared
flows, `workers.weights` — a policy from the trainer to the replicas — and `workers.llm` — the
client, router and engines; then one package per stage) → `pipeline` (config, CLI, launchers,
observation; the harness apart). An import goes down or sideways within a package, never up:

- a stage imports no other stage; it reaches the others only through `llm` and `weights`
  (the agent loop and the reward stage's judge drive the LLM client; the trainer publishes
  through `weights` and lends its model as an `hf` engine);
- `llm` may use `weights` (an engine loads and receives weights), `weights` uses neither `llm`
  nor a stage;
- nothing under `workers/` imports `pipeline/`, and nothing of the product imports the
  harness (`pipeline.harness`: bench, demo, chaos, load, the tiny models): only the CLI,
  which calls it, and the harness itself;
- no two files import each other, directly or round a loop.

Every `import` counts, those inside functions too: a lazy import hides a loop from the
interpreter, not from the design. Each rule is also run on a graph with a planted import that
breaks it, so a rule that stopped seeing anything would fail.

Every Kafka client of both libraries (kafka-python's producer, consumer and admin client,
aiokafka's) is constructed in `workers.kafka.clients` only, and topics are created by
`workers.kafka.admin` only: no other module calls a client class or `NewTopic`, binds it to
another name or passes it on; naming a client class in an annotation is fine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from schemas import headers

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "workers", "pipeline")
STAGES = ("agent_loop", "replay", "reward", "trainer")
#: The shared flows under `workers/`, and what each may import of the other.
FLOWS = ("llm", "weights")
ALLOWED_FLOW_EDGES = {("llm", "weights")}
HARNESS = "pipeline.harness"
#: The part of `pipeline` that may call the harness: the command line.
HARNESS_CALLERS = ("pipeline.cli", HARNESS)
HEAVY = ("torch", "transformers")


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str:
    """The longest prefix of a dotted name that is one of our modules ('' if none)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return ""


def _imports(module: str, path: Path) -> set[str]:
    """Every dotted name the file imports: our modules resolved, others as written."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                drop = node.level - 1 if is_package else node.level
                anchor = anchor[: len(anchor) - drop] if drop else anchor
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                names.add(full if full in MODULES else base)
    return {_resolve(n) or n for n in names} - {module}


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _room(module: str) -> str | None:
    """The stage or flow a module of `workers` belongs to (None: the plumbing)."""
    parts = module.split(".")
    if parts[0] == "workers" and len(parts) > 1 and parts[1] in (*STAGES, *FLOWS):
        return parts[1]
    return None


def _top(name: str) -> str:
    return name.split(".")[0]


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _workers_into_pipeline(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} → {n}"
        for m, deps in graph.items()
        if _top(m) == "workers"
        for n in deps
        if _top(n) == "pipeline"
    )


def _across_rooms(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, deps in graph.items():
        own = _room(module)
        for name in deps:
            other = _room(name)
            if not own or not other or other == own:
                continue
            if own in STAGES and other in FLOWS:
                continue  # a stage reaches the others through the flows
            if (own, other) not in ALLOWED_FLOW_EDGES:
                bad.append(f"{module} → {name}")
    return sorted(bad)


def _into_the_harness(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} → {n}"
        for m, deps in graph.items()
        if not any(_within(m, caller) for caller in HARNESS_CALLERS)
        for n in deps
        if _within(n, HARNESS)
    )


def _planted(module: str, name: str) -> dict[str, set[str]]:
    """The graph with one more import, of `name` by `module`."""
    return {m: deps | {name} if m == module else deps for m, deps in GRAPH.items()}


def test_workers_never_import_pipeline() -> None:
    bad = _workers_into_pipeline(GRAPH)
    assert not bad, "workers import pipeline:\n" + "\n".join(bad)
    planted = _planted("workers.weights.sync", "pipeline.observe.status")
    assert _workers_into_pipeline(planted) == ["workers.weights.sync → pipeline.observe.status"]


def test_stages_meet_only_through_the_flows() -> None:
    bad = _across_rooms(GRAPH)
    assert not bad, "a stage or flow imports another it may not:\n" + "\n".join(bad)
    for module, name in (
        ("workers.reward.app", "workers.replay.config"),  # a stage into another stage
        ("workers.weights.sync", "workers.llm.client"),  # weights into llm
        ("workers.llm.client", "workers.trainer.config"),  # a flow into a stage
    ):
        assert _across_rooms(_planted(module, name)) == [f"{module} → {name}"]


def test_nothing_of_the_product_imports_the_harness() -> None:
    bad = _into_the_harness(GRAPH)
    assert not bad, "the harness is imported by the product:\n" + "\n".join(bad)
    for module in ("workers.reward.app", "pipeline.observe.watch", "pipeline.launch.local"):
        planted = _planted(module, "pipeline.harness.bench.common")
        assert _into_the_harness(planted) == [f"{module} → pipeline.harness.bench.common"]


def test_schemas_import_only_schemas_and_light_libraries() -> None:
    bad = sorted(
        f"{m} → {n}"
        for m, deps in GRAPH.items()
        if _top(m) == "schemas"
        for n in deps
        if _top(n) in ("workers", "pipeline", *HEAVY)
    )
    assert not bad, "schemas import a stage or a heavy library:\n" + "\n".join(bad)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in GRAPH:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_no_import_loops() -> None:
    loops = _cycles()
    assert not loops, "import loops:\n" + "\n".join(" ↔ ".join(c) for c in loops)


def _strings(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if id(node) not in docstrings
    ]


HEADER_NAMES = {v for k, v in vars(headers).items() if k.isupper() and isinstance(v, str)}
PREFIXES = tuple(v for v in HEADER_NAMES if v.endswith((".", ":")))


@pytest.mark.parametrize("package", [*PACKAGES[1:], "tests"])
def test_header_names_are_spelled_only_in_schemas(package: str) -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, text in _strings(path)
        if text in HEADER_NAMES or text.startswith(PREFIXES)
    ]
    assert not bad, "import the name from schemas.headers instead:\n" + "\n".join(bad)


# --- Kafka clients are made in one place --------------------------------------------------

CLIENT_FACTORY = "workers.kafka.clients"
CLIENT_LIBRARIES = ("kafka", "aiokafka")
CLIENT_CLASSES = frozenset(
    {
        "KafkaProducer",
        "KafkaConsumer",
        "KafkaAdminClient",
        "AIOKafkaProducer",
        "AIOKafkaConsumer",
        "AIOKafkaAdminClient",
    }
)
TOPIC_CREATOR = "workers.kafka.admin"


def _annotation_nodes(tree: ast.AST) -> set[int]:
    """Ids of every node inside an annotation (a client class may be named there)."""
    roots: list[ast.expr | None] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            args = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
            roots += [arg.annotation for arg in args if arg is not None]
            roots.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
    return {id(n) for root in roots if root is not None for n in ast.walk(root)}


def _library_names(source: str, names: frozenset[str]) -> list[tuple[int, str]]:
    """(line, name) of every use of one of `names` from the client libraries outside an
    annotation: a call, or the class passed on or bound to another name (construction by
    other means). `from kafka import KafkaProducer as P` then `P(...)` counts; so does
    `aiokafka.AIOKafkaConsumer(...)` after `import aiokafka`."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name → class name
    modules: set[str] = set()  # local names bound to a client library (or a module of one)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _top(node.module or "") in CLIENT_LIBRARIES:
            aliases |= {(a.asname or a.name): a.name for a in node.names if a.name in names}
        elif isinstance(node, ast.Import):
            modules |= {
                a.asname or a.name.split(".")[0]
                for a in node.names
                if _top(a.name) in CLIENT_LIBRARIES
            }
    skip = _annotation_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in aliases:
            found.append((node.lineno, aliases[node.id]))
        elif isinstance(node, ast.Attribute) and node.attr in names:
            root: ast.expr = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in modules:
                found.append((node.lineno, node.attr))
    return found


def test_the_use_detector_sees_calls_aliases_and_module_attributes() -> None:
    source = (
        "import aiokafka\n"
        "from kafka import KafkaProducer as P\n"
        "from aiokafka.admin import AIOKafkaAdminClient\n"
        "from kafka import KafkaConsumer\n"
        "def f(c: KafkaConsumer) -> KafkaConsumer:\n"
        "    x: AIOKafkaAdminClient | None = None\n"
        "    return P(bootstrap_servers='b:1')\n"
        "g = aiokafka.AIOKafkaConsumer\n"
        "h = AIOKafkaAdminClient()\n"
    )
    assert sorted(_library_names(source, CLIENT_CLASSES)) == [
        (7, "KafkaProducer"),
        (8, "AIOKafkaConsumer"),
        (9, "AIOKafkaAdminClient"),
    ]


def _uses_outside(owner: str, names: frozenset[str]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for module, path in MODULES.items()
        if module != owner
        for line, name in _library_names(path.read_text(), names)
    ]


def test_kafka_clients_are_constructed_only_by_the_factory() -> None:
    bad = _uses_outside(CLIENT_FACTORY, CLIENT_CLASSES)
    assert not bad, f"make Kafka clients through {CLIENT_FACTORY}:\n" + "\n".join(sorted(bad))


def test_topics_are_created_only_by_the_admin_module() -> None:
    bad = _uses_outside(TOPIC_CREATOR, frozenset({"NewTopic"}))
    assert not bad, f"create topics through {TOPIC_CREATOR}.ensure_topics:\n" + "\n".join(
        sorted(bad)
    )
