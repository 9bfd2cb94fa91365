"""Where the local broker's files live, and what `rollout kafka up` records about it.

`rollout_home()` ($ROLLOUT_HOME, default ~/.rollout) holds one `kafka-<port>.json` per
broker started (`BrokerState`) and the default data directories; `cache_home()` the resolved
jars; `INFRA` is the broker's build and config files in the project. Below both
`broker.local` (plain broker) and `broker.secure` (its SASL_SSL variant), so neither needs the
other to find a broker.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["INFRA", "BrokerState", "cache_home", "rollout_home"]

INFRA = Path(__file__).resolve().parents[2] / "infra" / "kafka"


def rollout_home() -> Path:
    return Path(os.environ.get("ROLLOUT_HOME", Path.home() / ".rollout")).expanduser()


def cache_home() -> Path:
    base = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    return Path(base).expanduser() / "rollout-pipeline"


@dataclass
class BrokerState:
    """What `up` records so that `status` and `down` find the broker again."""

    pid: int
    port: int
    controller_port: int
    data_dir: str
    bootstrap: str
    started_at: float
    reused: bool = False
    secure: bool = False  # SASL_SSL + ACLs (pipeline/broker/secure.py); creds in data_dir

    @classmethod
    def path_for(cls, port: int) -> Path:
        return rollout_home() / f"kafka-{port}.json"

    def save(self) -> None:
        path = self.path_for(self.port)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, port: int) -> BrokerState | None:
        try:
            return cls(**json.loads(cls.path_for(port).read_text()))
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            return None
