"""GRPO outcome advantages: the one definition every stage and client uses.

The advantages a `TrainingGroup` carries on `rl.replay` (computed by the replay stage) and
those `TrajectoryConsumer` computes for batches read from `rl.scored` come from this module,
so the two topics agree to the last bit for the same group (the consumer given the run's
replay settings, `batches(..., advantages=cfg.replay)`).

For the scores r_1 … r_n of one prompt (uid), verl's `compute_grpo_outcome_advantage`:

    A_i = (r_i − mean(r)) / (std(r) + eps)     with std the *sample* std (torch.std, n − 1)
    A_i =  r_i − mean(r)                       with `norm_by_std=False` (Dr. GRPO)

A group of one sample has no baseline: its advantage is 0 (verl's code gives it its raw
score, mean 0 and std 1, which turns a lone partial sample into a pure REINFORCE term with
no baseline; a pipeline that emits partial groups on timeout must not do that). A group
whose scores are all equal has std 0 and advantages 0: it carries no signal.

Pure Python (no torch), so the schemas package stays light.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

__all__ = ["EPS", "group_advantages", "grpo_advantages"]

EPS = 1e-6


def group_advantages(
    scores: Sequence[float], *, norm_by_std: bool = True, eps: float = EPS
) -> list[float]:
    """The advantages of one group's scores (see the module docstring)."""
    n = len(scores)
    if n < 2:
        return [0.0] * n
    mean = math.fsum(scores) / n
    centred = [s - mean for s in scores]
    if not norm_by_std:
        return centred
    std = math.sqrt(math.fsum(c * c for c in centred) / (n - 1))
    return [c / (std + eps) for c in centred]


def grpo_advantages(
    scores: Iterable[float], uids: Iterable[str], *, norm_by_std: bool = True, eps: float = EPS
) -> list[float]:
    """`group_advantages` of each uid's scores, returned in the order of `scores`."""
    scores, uids = list(scores), list(uids)
    if len(uids) != len(scores):
        raise ValueError("grpo_advantages: one uid per score")
    members: dict[str, list[int]] = defaultdict(list)
    for i, uid in enumerate(uids):
        members[uid].append(i)
    out = [0.0] * len(scores)
    for idx in members.values():
        values = group_advantages([scores[i] for i in idx], norm_by_std=norm_by_std, eps=eps)
        for i, a in zip(idx, values, strict=True):
            out[i] = a
    return out
