"""From a chat request to engine input, and from engine output to OpenAI's response shapes.

The prompt is rendered once, with the engine's own tokenizer and chat template, and its ids are
returned to the client (``prompt_token_ids``) beside the sampled ids and their logprobs (always,
asked or not: ``Choice.token_logprobs``), so that training never has to re-tokenise text that may
not round-trip.
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

from artery.services.inference.engine.base import Completion, SamplingParams
from artery.services.inference.openai_types import (
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    LogprobEntry,
    ResponseMessage,
    TopLogprob,
    invalid_request,
)
from artery.services.inference.tools import parse_tool_calls
from artery.shared.chat_template import ChatInput, ChatTemplateError, UnsupportedContent
from artery.shared.codec import NestedTooDeeply, check_json, json_leaves
from artery.shared.errors import InvalidMessage

#: OpenAI's stand-in for a logprob of minus infinity (JSON has no infinities).
MIN_LOGPROB = -9999.0
#: More characters of rendered prompt than this many per token of context cannot fit, so such a
#: prompt is refused without tokenising it (which takes seconds for megabytes). Real text averages
#: 2-5 characters a token; only long runs of one character (spaces, dashes) reach tens. A heuristic
#: bound, not a proof: it errs far on the side of letting a prompt through to be counted exactly.
MAX_CHARS_PER_TOKEN = 32

# msgspec names the place at fault as `$.a[0].b`, `$.a[...]` (a value in an object) or
# `key` in `$.a` (a key of an object); the param is the path without `$.` and `[...]`.
_ERROR_PATH = re.compile(r" - at (?:`key` in )?`\$\.?(.*)`$")


def decode_request(body: bytes) -> ChatCompletionRequest:
    """Decode a request body; any problem becomes a 400 naming the JSON path at fault."""
    try:
        check_json(body)  # nesting and UTF-8 the typed decode does not look at (unknown keys)
    except InvalidMessage as exc:
        code = "nested_too_deeply" if isinstance(exc, NestedTooDeeply) else None
        raise invalid_request(f"The request body is refused: {exc.reason}", code=code) from None
    try:
        return msgspec.json.decode(body, type=ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        message = str(exc)
        path = _ERROR_PATH.search(message)
        param = path.group(1).replace("[...]", "") if path else ""
        raise invalid_request(message, param or None) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise invalid_request(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:  # raised outside DecodeError for absurdly deep nesting
        raise invalid_request("The request body is nested too deeply") from None


# --------------------------------------------------------------------------- the prompt


def render_prompt(tokenizer: Any, request: ChatCompletionRequest, max_context: int) -> list[int]:
    """The prompt's token ids, rendered by ``shared.chat_template`` as the trainer renders each
    turn's prompt; one whose text obviously exceeds ``max_context`` is a 400 before it is
    tokenised (see ``MAX_CHARS_PER_TOKEN``)."""
    try:
        chat = ChatInput.of(request.messages, request.tools, request.chat_template_kwargs)
        limit = max_context * MAX_CHARS_PER_TOKEN
        # What goes in is a cheap first measure; a template may drop some of it (earlier turns'
        # reasoning), so only the rendered text, rendered once more without tokenising, decides.
        if _text_length([chat.messages, chat.tools]) > limit:
            text = chat.text(tokenizer, add_generation_prompt=True)
            if isinstance(text, str) and len(text) > limit:
                raise _too_long(
                    f"This model's maximum context length is {max_context} tokens, and your messages "
                    f"render to {len(text)} characters, more than {max_context} tokens can hold. "
                    "Please reduce the length of the messages."
                )
        return chat.prompt_token_ids(tokenizer)
    except UnsupportedContent as exc:
        raise invalid_request(str(exc), f"messages[{exc.index}]") from None
    except ChatTemplateError as exc:  # a template that raises (roles must alternate...) rejects this request
        raise invalid_request(f"could not apply the chat template: {exc}", "messages") from None


def _text_length(value: Any) -> int:
    """Characters in every string of a template input (keys aside): a floor on the rendered text
    when the template writes everything it is given."""
    return sum(len(leaf) for leaf in json_leaves(value) if isinstance(leaf, str))


def check_logit_bias(request: ChatCompletionRequest, tokenizer: Any) -> None:
    """``logit_bias`` keys must be ids in the tokenizer's vocabulary (the decoder checked the rest)."""
    if not request.logit_bias:
        return
    try:
        vocabulary = len(tokenizer)
    except TypeError:  # a tokenizer that cannot say its size: the decoder's range check stands
        return
    outside = sorted(token for token in request.logit_bias if token >= vocabulary)
    if outside:
        raise invalid_request(
            f"`logit_bias` names token id {outside[0]}, outside the vocabulary (ids 0 to {vocabulary - 1})",
            "logit_bias",
        )


def sampling_params(
    request: ChatCompletionRequest, prompt_tokens: int, max_context: int, default_max_tokens: int
) -> SamplingParams:
    """The engine's parameters; a prompt that leaves no room for the completion is a 400."""
    room = max_context - prompt_tokens
    limit = request.completion_limit
    if limit is None:
        if room < 1:
            raise _too_long(
                f"This model's maximum context length is {max_context} tokens, and your messages "
                f"take {prompt_tokens} tokens, which leaves no room for a completion. "
                "Please reduce the length of the messages."
            )
        limit = min(room, default_max_tokens)
    elif limit > room:
        raise _too_long(
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{prompt_tokens + limit} tokens ({prompt_tokens} in the messages, {limit} in the "
            "completion). Please reduce the length of the messages or completion."
        )
    return SamplingParams(
        max_tokens=limit,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        n=request.n or 1,
        stop=request.stop_strings,
        seed=request.seed,
        logprobs=bool(request.logprobs),
        top_logprobs=(request.top_logprobs or 0) if request.logprobs else 0,
    )


def _too_long(message: str):
    return invalid_request(message, "messages", "context_length_exceeded")


# --------------------------------------------------------------------------- tokens as text


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character (used by Qwen, Llama 3...)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


_BYTE_OF_CHAR = {char: byte for byte, char in _bytes_to_unicode().items()}
_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenPieces:
    """Each token id's own text and exact bytes, for logprob entries (``token``, ``bytes``).

    A token may hold part of a UTF-8 character; its ``bytes`` are then exact and its ``token`` text
    shows the replacement character, as OpenAI's do.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        try:
            space = tokenizer.convert_ids_to_tokens(tokenizer.encode(" ", add_special_tokens=False))
        except Exception:
            space = None
        self._byte_level = space == ["Ġ"]

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            raw = self._raw(token_id)
            found = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return found

    def _raw(self, token_id: int) -> bytes:
        token = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(token, str):
            if self._byte_level and all(char in _BYTE_OF_CHAR for char in token):
                return bytes(_BYTE_OF_CHAR[char] for char in token)
            if match := _HEX_BYTE.fullmatch(token):  # SentencePiece byte fallback
                return bytes([int(match.group(1), 16)])
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def entries(
        self, token_ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]]
    ) -> list[LogprobEntry]:
        return [
            self.entry(token_id, logprob, top[i] if i < len(top) else [])
            for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=False))
        ]

    def entry(self, token_id: int, logprob: float, top: list[tuple[int, float]]) -> LogprobEntry:
        text, raw = self.piece(token_id)
        alternatives = []
        for alt_id, alt_logprob in top:
            alt_text, alt_raw = self.piece(alt_id)
            alternatives.append(
                TopLogprob(token=alt_text, logprob=_finite(alt_logprob), bytes=alt_raw, token_id=alt_id)
            )
        return LogprobEntry(
            token=text, logprob=_finite(logprob), bytes=raw, top_logprobs=alternatives, token_id=token_id
        )


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def finite_logprobs(logprobs: list[float]) -> list[float]:
    """The sampled tokens' logprobs for ``token_logprobs``, as the ``logprobs`` entries write them.

    Every engine computes them whether or not the client asked (the sampled token's own logprob
    costs one gather on logits it already has), so no request changes for a completion to be
    trainable."""
    return [_finite(logprob) for logprob in logprobs]


# --------------------------------------------------------------------------- the answer


def build_choice(completion: Completion, request: ChatCompletionRequest, pieces: TokenPieces) -> Choice:
    content, calls = parse_tool_calls(completion.text, request.effective_tool_choice)
    logprobs = None
    if request.logprobs:
        logprobs = ChoiceLogprobs(
            content=pieces.entries(completion.token_ids, completion.logprobs, completion.top_logprobs)
        )
    finish = "tool_calls" if calls and completion.finish_reason == "stop" else completion.finish_reason
    return Choice(
        index=completion.index,
        message=ResponseMessage(role="assistant", content=content, refusal=None, tool_calls=calls or None),
        logprobs=logprobs,
        finish_reason=finish,
        token_ids=list(completion.token_ids),
        token_logprobs=finite_logprobs(completion.logprobs),
    )
