"""Hermes-style tool calls parsed out of generated text (pure functions, no server)."""

from __future__ import annotations

import json

import msgspec

from artery.services.inference.openai_types import NamedToolChoice
from artery.services.inference.tools import parse_tool_calls


def _named(name: str) -> NamedToolChoice:
    return msgspec.convert({"type": "function", "function": {"name": name}}, NamedToolChoice)


def test_plain_text_is_left_alone():
    assert parse_tool_calls("Hello there.") == ("Hello there.", [])
    assert parse_tool_calls("") == ("", [])


def test_one_call_with_object_arguments():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content is None
    assert len(calls) == 1
    call = calls[0]
    assert call.type == "function"
    assert call.id.startswith("call_") and len(call.id) > len("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}


def test_arguments_as_a_json_string_are_kept_as_written():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    _, calls = parse_tool_calls(text)
    assert calls[0].function.arguments == '{"x": 1}'


def test_missing_arguments_become_an_empty_object_and_unicode_is_kept():
    _, calls = parse_tool_calls('<tool_call>{"name": "ping"}</tool_call>')
    assert calls[0].function.arguments == "{}"
    _, calls = parse_tool_calls('<tool_call>{"name": "say", "arguments": {"text": "héllo"}}</tool_call>')
    assert json.loads(calls[0].function.arguments) == {"text": "héllo"}
    assert "héllo" in calls[0].function.arguments


def test_several_calls_in_a_row_with_prose_before():
    text = (
        "Let me look both up.\n"
        '<tool_call>\n{"name": "a", "arguments": {"i": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"i": 2}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me look both up."
    assert [c.function.name for c in calls] == ["a", "b"]
    assert [json.loads(c.function.arguments) for c in calls] == [{"i": 1}, {"i": 2}]
    assert calls[0].id != calls[1].id


def test_malformed_json_stays_text_without_breaking_the_good_calls():
    bad = '<tool_call>\n{"name": "a", "arguments": {oops}\n</tool_call>'
    assert parse_tool_calls(bad) == (bad, [])
    good = '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(bad + "\n" + good)
    assert content == bad
    assert [c.function.name for c in calls] == ["b"]


def test_json_that_is_not_a_call_stays_text():
    for body in ('["a"]', '{"arguments": {}}', '{"name": ""}', '{"name": 3}'):
        text = f"<tool_call>{body}</tool_call>"
        assert parse_tool_calls(text) == (text, [])


def test_unterminated_call_at_the_end_is_accepted_when_its_json_is_complete():
    content, calls = parse_tool_calls('Sure. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n')
    assert content == "Sure."
    assert calls[0].function.name == "f"
    truncated = '<tool_call>\n{"name": "f", "argu'
    assert parse_tool_calls(truncated) == (truncated, [])


def test_tool_choice_none_never_parses():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, "none") == (text, [])


def test_named_tool_choice_accepts_only_that_name():
    text = (
        '<tool_call>{"name": "wanted", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "other", "arguments": {}}</tool_call>'
    )
    content, calls = parse_tool_calls(text, _named("wanted"))
    assert [c.function.name for c in calls] == ["wanted"]
    assert content == '<tool_call>{"name": "other", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, "required")[1][1].function.name == "other"
