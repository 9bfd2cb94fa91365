"""The trainer's placement group: where colocated replicas (the LLM judge's) share its resources.

`rollout up --ray` with a judge pool (`reward.judge`) reserves one bundle for the trainer and
the judge's replicas together, `<run>/trainer` in the launcher's namespace (detached, so it
outlives `rollout up`): the trainer's CPU and GPU plus every judge replica's threads. The train
actor and each `judge-<i>` actor are scheduled into that bundle, so Ray places them on one
node and counts them against one reservation: a judge serves on the trainer's resources, as
the `colocated` rollout mode says (`pipeline.launch.placement`), never on the policy
replicas'. `rollout down` removes the group after its actors are gone. Without a judge pool
there is no group and the trainer is placed as before. `ray` is imported only inside the
functions here.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["GROUP_SUFFIX", "bundle_options", "remove_groups", "reserve"]

log = logging.getLogger("rollout.ray_launch")

GROUP_SUFFIX = "/trainer"


def reserve(run: str, cpus: float, gpus: float) -> Any:
    """Create the run's trainer bundle (`cpus` CPUs, `gpus` GPUs); the placement group."""
    from ray.util.placement_group import placement_group

    bundle = {"CPU": float(cpus)}
    if gpus > 0:
        bundle["GPU"] = float(gpus)
    return placement_group(
        [bundle], strategy="STRICT_PACK", name=run + GROUP_SUFFIX, lifetime="detached"
    )


def bundle_options(group: Any) -> dict[str, Any]:
    """The actor options that put an actor into `group`'s one bundle."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    return {"scheduling_strategy": strategy}


def remove_groups(run: str | None) -> list[str]:
    """Remove the trainer bundles of `run` (of every run: None); the names removed."""
    from ray.util.placement_group import (
        get_placement_group,
        placement_group_table,
        remove_placement_group,
    )

    removed = []
    for entry in placement_group_table().values():
        name = entry.get("name", "")
        if entry.get("state") == "REMOVED" or not name.endswith(GROUP_SUFFIX):
            continue
        if run is not None and name != run + GROUP_SUFFIX:
            continue
        try:
            remove_placement_group(get_placement_group(name))
        except ValueError:  # removed, or of another namespace, since the table was read
            continue
        log.info("removed placement group %s", name)
        removed.append(name)
    return removed
