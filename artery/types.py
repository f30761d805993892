"""ART's type aliases (``art.Messages``, ``art.MessagesAndChoices``, ``art.Tools``).

For a type checker they are the OpenAI SDK's types, as in ART. At run time they are the plain
shapes those types have (dicts, and a ``Choice`` object), so that ``import artery`` — which every
service process does — never loads the OpenAI SDK: the collector's image does not even have it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from openai.types.chat.chat_completion import Choice
    from openai.types.chat.chat_completion_message_param import ChatCompletionMessageParam
    from openai.types.chat.chat_completion_tool_param import ChatCompletionToolParam

    Message: TypeAlias = ChatCompletionMessageParam
    MessageOrChoice: TypeAlias = ChatCompletionMessageParam | Choice
    Tool: TypeAlias = ChatCompletionToolParam
else:
    Message = dict[str, Any]
    MessageOrChoice = dict[str, Any] | Any  # a dict, or an openai ``Choice``
    Tool = dict[str, Any]

Messages: TypeAlias = list[Message]
MessagesAndChoices: TypeAlias = list[MessageOrChoice]
Tools: TypeAlias = list[Tool]

__all__ = ["Message", "MessageOrChoice", "Messages", "MessagesAndChoices", "Tool", "Tools"]
