"""Custom reward functions for the corpus (`reward.custom: {path: tests.corpus.rewards}`).

`compute_score` misbehaves on purpose when the ground truth names a fault, and otherwise
scores like gsm8k's strict rule (`#### <ground truth>` in the response → 1.0, else 0.0):

    RAISE         raises ValueError
    HANG          sleeps `hang_s` seconds (past the stage's scorer timeout)
    CRASH         kills its own process (only meaningful with `executor: process`)
    NOT_A_NUMBER  returns a string
    NAN           returns float("nan")
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

__all__ = ["compute_score"]


def compute_score(
    solution_str: str,
    ground_truth: str | None,
    data_source: str,
    extra_info: dict[str, Any] | None = None,
    hang_s: float = 30.0,
) -> Any:
    if ground_truth == "RAISE":
        raise ValueError("corpus reward exploded")
    if ground_truth == "HANG":
        time.sleep(hang_s)
        return 1.0
    if ground_truth == "CRASH":
        os._exit(3)
    if ground_truth == "NOT_A_NUMBER":
        return "very good"
    if ground_truth == "NAN":
        return math.nan
    return 1.0 if f"#### {ground_truth}" in solution_str else 0.0
