"""`knobs_of`: a run's options reach `local_run_config` by field name, none dropped."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.harness.load.options import LoadOptions
from pipeline.harness.local_run import knobs_of


def test_the_soak_passes_every_knob_it_has() -> None:
    opts = LoadOptions(n=3, max_tokens=9, in_flight=12, train_batch_size=5, sync_every=4)
    assert knobs_of(opts) == {
        "n": 3,
        "max_tokens": 9,
        "in_flight": 12,
        "train_batch_size": 5,
        "sync_every": 4,
        "max_staleness": 8,
    }


def test_fields_that_are_no_knob_stay_behind() -> None:
    @dataclass
    class Options:
        n: int = 2
        run_dir: str = "/r"  # a positional argument of local_run_config, not a knob
        overrides: dict[str, int] | None = None

    assert knobs_of(Options()) == {"n": 2}
