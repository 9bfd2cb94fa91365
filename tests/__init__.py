"""The test suite; `ROOT` is the repository's root, wherever a test module lies under it."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
