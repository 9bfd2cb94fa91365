"""Every `rollout bench X` lives in `pipeline/harness/bench/X.py` (dashes as underscores)."""

from __future__ import annotations

from pipeline.cli.bench import BENCHES
from pipeline.cli.main import build_parser
from tests import ROOT


def test_every_bench_command_is_the_module_of_its_name() -> None:
    assert BENCHES
    for bench in BENCHES:
        module = ROOT / "pipeline" / "harness" / "bench" / f"{bench.name.replace('-', '_')}.py"
        assert module.is_file(), f"rollout bench {bench.name}: no {module.relative_to(ROOT)}"


def test_every_bench_module_is_a_command() -> None:
    names = {bench.name.replace("-", "_") for bench in BENCHES}
    shared = {"__init__", "common"}
    for path in (ROOT / "pipeline" / "harness" / "bench").glob("*.py"):
        assert path.stem in names | shared, f"{path.name} is no `rollout bench` command"


def test_the_parser_offers_every_bench() -> None:
    bench = build_parser().parse_args(["bench", BENCHES[0].name])
    assert callable(bench.handler)
