"""Trajectory groups as ART's Parquet files: ``trajectories/{split}/{step:04d}.parquet``.

``model.log`` writes one file per split and step beside ``history.jsonl``. The columns are ART
0.5.18's (``art.utils.trajectory_logging``), one row per trajectory, so ART's readers, its
benchmarking helpers, pandas, polars and DuckDB read them as they read ART's:

- ``group_index`` (int64), ``group_metadata``/``group_metrics`` (JSON text), ``group_logs``;
- ``reward`` (float64), ``metrics``/``metadata``/``tools`` (JSON text, null when empty), ``logs``;
- ``messages``: a list of structs ``role, content, tool_calls`` (JSON text), ``tool_call_id,
  trainable`` (true for what the model sampled: ART's ``Choice``).

Artery adds columns after ART's, which ART's readers ignore: ``trajectory_index``,
``initial_policy_version``, ``final_policy_version``, ``additional_histories`` (JSON text) and
``group_exceptions`` (JSON text). A group without trajectories (every rollout raised) is one row
with a null ``reward``, ``messages`` and ``trajectory_index``, which ART's reader skips.

pyarrow is needed to write or read (``pip install 'artery[log]'``); it is imported only then.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from artery import convert
from artery.schemas import Message, TrajectoryException
from artery.trajectories import History, Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    import pyarrow as pa

#: The key of the file's schema metadata that names Artery's layout and its version.
LAYOUT_KEY = b"artery.trajectory_parquet"
LAYOUT_VERSION = b"1"


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(
            "trajectory Parquet files (model.log's trajectories/{split}/{step:04d}.parquet) need "
            "pyarrow: pip install 'artery[log]'"
        ) from exc
    return pa, pq


def _enc_hook(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):  # openai's pydantic types
        return obj.model_dump(mode="json", exclude_none=True)
    raise TypeError(f"cannot store a {type(obj).__name__} in a trajectory file")


def _json(value: Any) -> str:
    return json.dumps(msgspec.to_builtins(value, enc_hook=_enc_hook), ensure_ascii=False)


def _json_or_none(value: Any) -> str | None:
    return _json(value) if value else None


def _message_row(message: Message) -> dict[str, Any]:
    content = message.content
    if content is not None and not isinstance(content, str):
        content = _json(content)  # content parts (text, images): JSON text in ART's string column
    trainable = message.trainable if message.trainable is not None else message.sample is not None
    return {
        "role": message.role,
        "content": content,
        "tool_calls": _json_or_none(message.tool_calls),
        "tool_call_id": message.tool_call_id,
        "trainable": bool(trainable),
    }


def _messages(items: list[Any]) -> list[dict[str, Any]]:
    return [_message_row(convert.to_message(item)) for item in items]


def _unflatten(row: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": row["role"], "content": row["content"]}
    if row.get("tool_calls"):
        message["tool_calls"] = json.loads(row["tool_calls"])
    if row.get("tool_call_id"):
        message["tool_call_id"] = row["tool_call_id"]
    return message


def _histories(histories: Sequence[Any]) -> str | None:
    """Additional histories, or a captured trajectory's other conversations (same fields)."""
    if not histories:
        return None
    return _json(
        [
            {
                "messages_and_choices": [_unflatten(m) for m in _messages(h.messages_and_choices)],
                "tools": h.tools,
            }
            for h in histories
        ]
    )


def schema() -> pa.Schema:
    pa, _ = _pyarrow()
    message = pa.struct(
        [
            ("role", pa.string()),
            ("content", pa.string()),
            ("tool_calls", pa.string()),
            ("tool_call_id", pa.string()),
            ("trainable", pa.bool_()),
        ]
    )
    return pa.schema(
        [
            # ART's columns, in ART's order.
            ("group_index", pa.int64()),
            ("group_metadata", pa.string()),
            ("group_metrics", pa.string()),
            ("group_logs", pa.list_(pa.string())),
            ("reward", pa.float64()),
            ("metrics", pa.string()),
            ("metadata", pa.string()),
            ("tools", pa.string()),
            ("logs", pa.list_(pa.string())),
            ("messages", pa.list_(message)),
            # Artery's.
            ("trajectory_index", pa.int64()),
            ("initial_policy_version", pa.int64()),
            ("final_policy_version", pa.int64()),
            ("additional_histories", pa.string()),
            ("group_exceptions", pa.string()),
        ],
        metadata={LAYOUT_KEY: LAYOUT_VERSION},
    )


def _rows(groups: Iterable[TrajectoryGroup]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for group_index, group in enumerate(groups):
        common: dict[str, Any] = {
            "group_index": group_index,
            "group_metadata": _json_or_none(group.metadata),
            "group_metrics": _json_or_none(group.metrics),
            "group_logs": list(group.logs) or None,
            "group_exceptions": _json_or_none(group.exceptions),
        }
        if not group.trajectories:
            rows.append(common)  # the group is kept (its exceptions); ART's reader skips the row
            continue
        for index, trajectory in enumerate(group.trajectories):
            # A captured trajectory's messages are its exchanges, rebuilt as conversations.
            main, *others = trajectory.sent_conversations()
            rows.append(
                {
                    **common,
                    "reward": float(trajectory.reward),
                    "metrics": _json_or_none(trajectory.metrics),
                    "metadata": _json_or_none(trajectory.metadata),
                    "tools": _json_or_none(main.tools),
                    "logs": list(trajectory.logs) or None,
                    "messages": _messages(main.messages_and_choices),
                    "trajectory_index": index,
                    "initial_policy_version": trajectory.initial_policy_version,
                    "final_policy_version": trajectory.final_policy_version,
                    "additional_histories": _histories(others),
                }
            )
    return rows


def write_trajectory_groups_parquet(groups: Iterable[TrajectoryGroup], path: str | Path) -> Path:
    """Write the groups to ``path`` (Zstd-compressed, as ART), replacing it whole; return it.

    The file appears complete or not at all: it is written beside and renamed into place.
    """
    pa, pq = _pyarrow()
    path = Path(path)
    table = pa.Table.from_pylist(_rows(groups), schema=schema())
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        pq.write_table(table, partial, compression="zstd")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def _load(text: str | None, empty: Any) -> Any:
    return json.loads(text) if text else empty


def read_trajectory_groups_parquet(path: str | Path) -> list[TrajectoryGroup]:
    """The groups of a file written by ``write_trajectory_groups_parquet`` (or by ART 0.5).

    Messages come back as OpenAI message dicts (``role``, ``content``, ``tool_calls``,
    ``tool_call_id``), as ART's reader returns them; sampled token ids and logprobs are not
    stored, so a restored trajectory is for reading and scoring, not for training on.
    """
    _, pq = _pyarrow()
    rows = pq.read_table(path).to_pylist()
    groups: dict[int, dict[str, Any]] = {}
    for row in rows:
        index = row.get("group_index") or 0
        group = groups.get(index)
        if group is None:
            group = groups[index] = {
                "trajectories": [],
                "metadata": _load(row.get("group_metadata"), {}),
                "metrics": _load(row.get("group_metrics"), {}),
                "logs": list(row.get("group_logs") or []),
                "exceptions": [
                    msgspec.convert(e, TrajectoryException) for e in _load(row.get("group_exceptions"), [])
                ],
            }
        if row.get("reward") is None and row.get("messages") is None:
            continue  # a group without trajectories
        histories = [
            History(messages_and_choices=h.get("messages_and_choices") or [], tools=h.get("tools"))
            for h in _load(row.get("additional_histories"), [])
        ]
        trajectory = Trajectory(
            messages_and_choices=[_unflatten(m) for m in row.get("messages") or []],
            tools=_load(row.get("tools"), None),
            additional_histories=histories,
            reward=row["reward"],
            initial_policy_version=row.get("initial_policy_version"),
            final_policy_version=row.get("final_policy_version"),
            metrics=_load(row.get("metrics"), {}),
            metadata=_load(row.get("metadata"), {}),
            logs=list(row.get("logs") or []),
        )
        group["trajectories"].append((row.get("trajectory_index") or 0, trajectory))
    result = []
    for index in sorted(groups):
        data = groups[index]
        trajectories = [t for _, t in sorted(data.pop("trajectories"), key=lambda item: item[0])]
        result.append(TrajectoryGroup(trajectories, **data))
    return result
