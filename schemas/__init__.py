"""Artery's wire contract: every event that crosses NATS, as msgspec Structs.

``artery.schemas``, installed from the top-level ``schemas/`` folder (the README's "Repository
layout" maps every folder).

This package depends on msgspec alone, so that services without torch (collector, reward,
publisher) and publishers in other languages share one source of truth. The JSON Schema and
AsyncAPI documents under ``generated/`` are produced from these types by ``make schemas``.

Evolution rules (checked by review, and by the drift test for the generated documents):
- a new field always gets a default, so older publishers stay valid;
- a field is never retyped or renamed;
- a breaking change is a new tag (``"trajectory_group.v2"``), decoded side by side with the old.
"""

from artery.schemas.base import SCHEMA_VERSION, Event, new_event_id, utcnow
from artery.schemas.checkpoints import (
    CheckpointDeleted,
    CheckpointPublished,
    CheckpointSaved,
    CheckpointStaged,
    RetentionApplied,
    RetentionRequested,
)
from artery.schemas.control import PauseAck, PauseInference, ReplicaInfo, ResumeAck, ResumeInference
from artery.schemas.deadletter import DeadLetter
from artery.schemas.groups import GroupReady, GroupScored, JudgeUsage, TrajectoryScore
from artery.schemas.models import (
    LoraSpec,
    ModelRecord,
    ModelRegistered,
    ModelRegistrationRequested,
    ReplicasListed,
    ReplicasRequested,
)
from artery.schemas.training import (
    TrainCompleted,
    TrainConfig,
    TrainFailed,
    TrainRequest,
    TrainRequested,
    TrainSFTConfig,
    TrainSFTRequested,
)
from artery.schemas.trajectory import (
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    History,
    ImagePart,
    ImageURL,
    Message,
    RewardSpec,
    RulerSpec,
    Sample,
    TextPart,
    Tool,
    ToolCall,
    TopLogprob,
    Trajectory,
    TrajectoryException,
    TrajectoryGroupSubmitted,
)

__all__ = [
    "SCHEMA_VERSION",
    "CheckpointDeleted",
    "CheckpointPublished",
    "CheckpointSaved",
    "CheckpointStaged",
    "ContentPart",
    "DeadLetter",
    "Event",
    "FunctionCall",
    "FunctionDefinition",
    "GroupReady",
    "GroupScored",
    "History",
    "ImagePart",
    "ImageURL",
    "JudgeUsage",
    "LoraSpec",
    "Message",
    "ModelRecord",
    "ModelRegistered",
    "ModelRegistrationRequested",
    "PauseAck",
    "PauseInference",
    "ReplicaInfo",
    "ReplicasListed",
    "ReplicasRequested",
    "ResumeAck",
    "ResumeInference",
    "RetentionApplied",
    "RetentionRequested",
    "RewardSpec",
    "RulerSpec",
    "Sample",
    "TextPart",
    "Tool",
    "ToolCall",
    "TopLogprob",
    "TrainCompleted",
    "TrainConfig",
    "TrainFailed",
    "TrainRequest",
    "TrainRequested",
    "TrainSFTConfig",
    "TrainSFTRequested",
    "Trajectory",
    "TrajectoryException",
    "TrajectoryGroupSubmitted",
    "TrajectoryScore",
    "new_event_id",
    "utcnow",
]
