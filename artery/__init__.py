"""Artery's Python SDK, in OpenPipe ART's shape: ``import artery as art``.

Agents run in their own code; each finished rollout becomes a ``Trajectory`` with a reward,
rollouts of one input form a ``TrajectoryGroup``, and ``model.publish(groups)`` hands them to
the services (collector → reward → trainer).

The ``artery`` folder is the SDK, the embedded stack and the ``artery`` command; the services,
their plumbing and the wire contract install beside it as ``artery.services``,
``artery.shared`` and ``artery.schemas`` from the top-level ``services/``, ``shared/`` and
``schemas/`` folders (docs/architecture/layout.md maps every folder).
"""

from artery import dev, local, rewards, utils
from artery.auto_trajectory import auto_trajectory, capture_auto_trajectory
from artery.backend import Backend
from artery.backend_api import TrainingFailed, TrainResult
from artery.batches import trajectory_group_batches
from artery.capture.api import (
    current_trajectory,
    current_trajectory_group,
    no_capture,
    trajectory,
    trajectory_group,
)
from artery.errors import LocalServingUnavailableError
from artery.gather import TooManyExceptions, gather_trajectories, gather_trajectory_groups
from artery.local import LocalBackend
from artery.local.train_result import LocalTrainResult
from artery.megatron import (
    MegatronRuntimeConfig,
    MegatronTopologyConfig,
    get_megatron_runtime_config,
    init_megatron_runtime_config,
)
from artery.metrics import (
    PIPELINE_RL_DASHBOARD_DEFAULT_METRICS,
    PIPELINE_RL_METRIC_DEFINITIONS,
    PIPELINE_RL_SCORE_METRICS,
    MetricDefinition,
)
from artery.model import Model, TrainableModel
from artery.pipeline_config import PipelineAutotuneConfig, PipelineRuntimeConfig
from artery.retry import retry
from artery.schemas import RewardSpec, RulerSpec, TrainConfig, TrainSFTConfig
from artery.serverless import ServerlessBackend, ServerlessTrainResult
from artery.trajectories import History, Trajectory, TrajectoryGroup
from artery.types import Messages, MessagesAndChoices, Tools
from artery.yield_trajectory import capture_yielded_trajectory, yield_trajectory

LoRAConfig = dev.LoRAConfig

__all__ = [
    "PIPELINE_RL_DASHBOARD_DEFAULT_METRICS",
    "PIPELINE_RL_METRIC_DEFINITIONS",
    "PIPELINE_RL_SCORE_METRICS",
    "Backend",
    "History",
    "LoRAConfig",
    "LocalBackend",
    "LocalServingUnavailableError",
    "LocalTrainResult",
    "MegatronRuntimeConfig",
    "MegatronTopologyConfig",
    "Messages",
    "MessagesAndChoices",
    "MetricDefinition",
    "Model",
    "PipelineAutotuneConfig",
    "PipelineRuntimeConfig",
    "RewardSpec",
    "RulerSpec",
    "ServerlessBackend",
    "ServerlessTrainResult",
    "TooManyExceptions",
    "Tools",
    "TrainConfig",
    "TrainResult",
    "TrainSFTConfig",
    "TrainableModel",
    "TrainingFailed",
    "Trajectory",
    "TrajectoryGroup",
    "auto_trajectory",
    "capture_auto_trajectory",
    "capture_yielded_trajectory",
    "current_trajectory",
    "current_trajectory_group",
    "dev",
    "gather_trajectories",
    "gather_trajectory_groups",
    "get_megatron_runtime_config",
    "init_megatron_runtime_config",
    "local",
    "no_capture",
    "retry",
    "rewards",
    "trajectory",
    "trajectory_group",
    "trajectory_group_batches",
    "utils",
    "yield_trajectory",
]
