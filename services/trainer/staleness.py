"""How far behind the policy each trajectory was sampled, and which are too stale to train on.

Asynchronous (off-policy) mode: inference keeps serving step N while the trainer computes N+1, so
a step trains on trajectories sampled by older policies. The step that sampled a trajectory is
read from its samples (each assistant turn's ``served_model``, ``<model>@<step>``, which the
inference service stamps on every choice); a trajectory whose turns came from several steps
counts from the oldest. Without any (an agent that built its messages by hand, another engine),
the trajectory's ``initial_policy_version`` stands in; with neither, its staleness is unknown.

Pure functions: the trainer service calls ``drop_stale`` and reports its counts under
``offpolicy/``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from artery.schemas import Trajectory
from artery.shared.served_name import step_of

#: Staleness histogram buckets reported one by one; staler ones are added into the last.
HISTOGRAM_BUCKETS = 4


def sampled_step(trajectory: Trajectory, model: str) -> int | None:
    """The oldest policy step among the trajectory's samples, else the trajectory's own claim."""
    steps = []
    for message in trajectory.messages:
        served = message.sample.served_model if message.sample is not None else None
        if served:
            step = step_of(served, model)
            if step is not None:
                steps.append(step)
    if steps:
        return min(steps)
    return trajectory.initial_policy_version


@dataclass
class StalenessReport:
    """What ``drop_stale`` saw: staleness per kept trajectory, and how many it dropped."""

    staleness: list[int] = field(default_factory=list)
    dropped: int = 0
    unknown: int = 0

    def metrics(self) -> dict[str, float]:
        seen = len(self.staleness) + self.dropped
        out = {
            "offpolicy/trajectories_dropped": float(self.dropped),
            "offpolicy/dropped_fraction": self.dropped / seen if seen else 0.0,
            "offpolicy/staleness_unknown": float(self.unknown),
        }
        if self.staleness:
            out["offpolicy/staleness_mean"] = sum(self.staleness) / len(self.staleness)
            out["offpolicy/staleness_max"] = float(max(self.staleness))
            counts = Counter(min(s, HISTOGRAM_BUCKETS - 1) for s in self.staleness)
            for bucket in range(HISTOGRAM_BUCKETS):
                label = str(bucket) if bucket < HISTOGRAM_BUCKETS - 1 else f"{bucket}+"
                out[f"offpolicy/staleness_{label}"] = float(counts.get(bucket, 0))
        return out


def drop_stale(
    groups: Sequence[Sequence[Trajectory]],
    *,
    model: str,
    current_step: int,
    max_steps_off_policy: int,
) -> tuple[list[list[Trajectory]], StalenessReport]:
    """Keep the trajectories sampled at most ``max_steps_off_policy`` steps before ``current_step``
    (the policy this step starts from); count the rest. A trajectory whose step is unknown is kept
    and counted as such: dropping it would make hand-built trajectories untrainable."""
    if max_steps_off_policy < 0:
        raise ValueError("max_steps_off_policy must be >= 0")
    report = StalenessReport()
    kept: list[list[Trajectory]] = []
    for group in groups:
        fresh = []
        for trajectory in group:
            step = sampled_step(trajectory, model)
            if step is None:
                report.unknown += 1
                fresh.append(trajectory)
                continue
            staleness = max(current_step - step, 0)
            if staleness > max_steps_off_policy:
                report.dropped += 1
            else:
                report.staleness.append(staleness)
                fresh.append(trajectory)
        kept.append(fresh)
    return kept, report
