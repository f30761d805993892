"""Artery's Python SDK, in OpenPipe ART's shape: ``import artery as art``.

Agents run in their own code; each finished rollout becomes a ``Trajectory`` with a reward,
rollouts of one input form a ``TrajectoryGroup``, and ``model.publish(groups)`` hands them to
the services (collector → reward → trainer).
"""

from artery import rewards
from artery.backend import Backend, LocalBackend, TrainingFailed, TrainResult
from artery.gather import TooManyExceptions, gather_trajectories, gather_trajectory_groups
from artery.model import Model, TrainableModel
from artery.retry import retry
from artery.schemas import RewardSpec, RulerSpec, TrainConfig
from artery.trajectories import History, Trajectory, TrajectoryGroup

__all__ = [
    "Backend",
    "History",
    "LocalBackend",
    "Model",
    "RewardSpec",
    "RulerSpec",
    "TooManyExceptions",
    "TrainConfig",
    "TrainResult",
    "TrainableModel",
    "TrainingFailed",
    "Trajectory",
    "TrajectoryGroup",
    "gather_trajectories",
    "gather_trajectory_groups",
    "retry",
    "rewards",
]
