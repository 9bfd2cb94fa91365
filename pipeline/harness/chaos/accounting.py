"""Where every sample ended: trained (how often), stale, dead-lettered, or lost.

Pure logic over what the run left behind (the trainer's step log, the records on the stale
and dead-letter topics), in the manner of Kafka's own transactions system tests: seed a
known input, drain the outputs, and account for every record. A sample is
`(uid, sample_index)`, named by its trajectory id `uid/sample_index`.

    trained      in a step the final weights reflect (`effective_trajectory_ids`)
    stale        in a group on the stale topic, never trained
    dead_letter  named by a dead letter (its trajectory, or its prompt's uid), never trained
    lost         none of the above
    duplicated   trained more than once, or trained and also dropped as stale

A run passes when `lost == 0 and duplicated == 0`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Accounting", "account", "expected_ids"]


def expected_ids(uids: Iterable[str], n: int) -> set[str]:
    return {f"{uid}/{i}" for uid in uids for i in range(n)}


@dataclass
class Accounting:
    expected: int
    trained: int
    stale: int
    dead_letter: int
    lost: int
    duplicated: int
    trained_twice: list[str] = field(default_factory=list)
    stale_and_trained: list[str] = field(default_factory=list)
    lost_ids: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    stale_reasons: dict[str, int] = field(default_factory=dict)  # "who: why" -> samples

    @property
    def accounted(self) -> int:
        return self.trained + self.stale + self.dead_letter

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and not self.unexpected

    def table(self) -> str:
        rows = [
            ("expected samples", self.expected),
            ("trained once", self.trained - len(self.trained_twice)),
            ("trained more than once", len(self.trained_twice)),
            ("stale (rl.stale)", self.stale),
            ("dead-lettered (rl.dlq)", self.dead_letter),
            ("stale and also trained", len(self.stale_and_trained)),
            ("unexpected ids trained", len(self.unexpected)),
            ("lost", self.lost),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"{name:<{width}}  {value:>7}" for name, value in rows]
        for label, ids in (("trained twice", self.trained_twice), ("lost", self.lost_ids)):
            if ids:
                lines.append(f"{label} (first 10): {', '.join(sorted(ids)[:10])}")
        lines.append(f"lost={self.lost} duplicated={self.duplicated}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, object]:
        return {
            "expected": self.expected,
            "trained": self.trained,
            "stale": self.stale,
            "dead_letter": self.dead_letter,
            "lost": self.lost,
            "duplicated": self.duplicated,
            "trained_twice": sorted(self.trained_twice)[:50],
            "stale_and_trained": sorted(self.stale_and_trained)[:50],
            "lost_ids": sorted(self.lost_ids)[:50],
            "unexpected": sorted(self.unexpected)[:50],
        }


def account(
    expected: set[str],
    trained: Iterable[str],
    stale: Iterable[str],
    dead_letter_keys: Iterable[str],
) -> Accounting:
    """Classify every expected sample.

    `dead_letter_keys`: the keys of dead letters; a trajectory id names one sample, a uid
    (a prompt's key) names all of its samples.
    """
    counts = Counter(trained)
    stale_ids = set(stale)
    letters = set(dead_letter_keys)
    trained_ids = {t for t in counts if t in expected}
    twice = [t for t in trained_ids if counts[t] > 1]
    both = [t for t in trained_ids if t in stale_ids]
    rest = expected - trained_ids
    stale_only = {t for t in rest if t in stale_ids}
    rest -= stale_only
    lettered = {t for t in rest if t in letters or t.rsplit("/", 1)[0] in letters}
    lost = rest - lettered
    return Accounting(
        expected=len(expected),
        trained=len(trained_ids),
        stale=len(stale_only),
        dead_letter=len(lettered),
        lost=len(lost),
        duplicated=len(twice) + len(both),
        trained_twice=twice,
        stale_and_trained=both,
        lost_ids=sorted(lost),
        unexpected=sorted(t for t in counts if t not in expected),
    )
