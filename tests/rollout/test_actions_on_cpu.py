"""Action parsers: hand-worked replies, including the malformed ones a random model writes."""

from __future__ import annotations

import json

import pytest

from beyond_agent.actions import (
    ACTION_PARSERS,
    ParsedAction,
    PlainActionParser,
    TaggedActionParser,
    ToolCallActionParser,
    get_action_parser,
    register_action_parser,
)


def test_registry_builds_parsers_by_name_and_lists_valid_names_on_error():
    assert isinstance(get_action_parser("plain"), PlainActionParser)
    assert get_action_parser("tagged", tag="move").tag == "move"
    assert get_action_parser("tool_call", tools=["calculator"]).tools == ["calculator"]
    with pytest.raises(ValueError, match=r"'json' is not registered.*\['plain', 'raw', 'react', 'tagged', 'tool_call'\]"):
        get_action_parser("json")


def test_registering_a_name_twice_is_refused_and_new_parsers_become_available():
    with pytest.raises(ValueError, match="'plain' is already registered"):
        register_action_parser("plain")(PlainActionParser)

    @register_action_parser("upper_for_test")
    class UpperParser:
        def parse(self, text: str) -> ParsedAction:
            return ParsedAction(text.upper(), None)

    try:
        assert get_action_parser("upper_for_test").parse("go") == ParsedAction("GO", None)
    finally:
        del ACTION_PARSERS["upper_for_test"]


def test_parsed_action_holds_exactly_one_of_action_and_error():
    assert ParsedAction("go north", None).ok
    assert not ParsedAction(None, "no action").ok
    with pytest.raises(ValueError, match="exactly one"):
        ParsedAction(None, None)
    with pytest.raises(ValueError, match="exactly one"):
        ParsedAction("go", "and an error")


@pytest.mark.parametrize(
    "text, action",
    [
        ("go north", "go north"),
        ("  \n  pick up the red ball  \nbecause it is close\n", "pick up the red ball"),
        ("open door<|im_end|>", "open door<|im_end|>"),  # special tokens are the decoder's job, not ours
    ],
)
def test_plain_takes_the_first_non_blank_line(text, action):
    assert PlainActionParser().parse(text) == ParsedAction(action, None)


@pytest.mark.parametrize("text", ["", "   ", "\n\t\n"])
def test_plain_empty_reply_is_an_error_for_the_model(text):
    parsed = PlainActionParser().parse(text)
    assert parsed.action is None and "empty" in parsed.error


@pytest.mark.parametrize(
    "text, action",
    [
        ("<action>go north</action>", "go north"),
        ("I see a door.\n<action>\n  open door \n</action>", "open door"),
        ("<action>go west</action> no wait <action>go east</action>", "go east"),  # the last block wins
        ("<action>craft 1 stick\nusing 2 planks</action>", "craft 1 stick\nusing 2 planks"),
    ],
)
def test_tagged_takes_the_last_block_stripped(text, action):
    assert TaggedActionParser().parse(text) == ParsedAction(action, None)


@pytest.mark.parametrize(
    "text, message",
    [
        ("go north", "No <action>...</action> block found"),
        ("<action>go north", "No <action>...</action> block found"),  # never closed
        ("<ACTION>go</ACTION>", "No <action>...</action> block found"),  # tags are case-sensitive
        ("<action>  </action>", "block was empty"),
        ("<action>go</action><action></action>", "block was empty"),  # the last one counts, even if empty
    ],
)
def test_tagged_malformed_replies_give_a_message_with_an_example(text, message):
    parsed = TaggedActionParser().parse(text)
    assert parsed.action is None
    assert message in parsed.error and "<action>go north</action>" in parsed.error


def test_tagged_with_a_custom_tag_and_a_bad_tag_name():
    assert TaggedActionParser(tag="answer").parse("<answer>42</answer>") == ParsedAction("42", None)
    with pytest.raises(ValueError, match="TaggedActionParser.tag must be a plain tag name"):
        TaggedActionParser(tag="a>b")


def test_tool_call_as_our_chatml_template_renders_it(chatml_tokenizer, tools):
    messages = [
        {"role": "user", "content": "what is 1+2?"},
        {"role": "assistant", "content": "Let me compute.",
         "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expr": "1+2"}}}]},
    ]
    rendered = chatml_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assistant_turn = rendered.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    parsed = ToolCallActionParser(tools=["calculator"]).parse(assistant_turn)
    assert parsed == ParsedAction('{"name": "calculator", "arguments": {"expr": "1+2"}}', None)
    assert json.loads(parsed.action) == {"name": "calculator", "arguments": {"expr": "1+2"}}


@pytest.mark.parametrize(
    "text, action",
    [
        ('<tool_call>{"name": "search", "arguments": {"query": "Paris"}}</tool_call>',
         '{"name": "search", "arguments": {"query": "Paris"}}'),
        # extra keys are dropped, key order is canonical, missing arguments become {}
        ('<tool_call>{"arguments": {"q": "é"}, "name": "search", "id": 7}</tool_call>',
         '{"name": "search", "arguments": {"q": "é"}}'),
        ('<tool_call>{"name": "look"}</tool_call>', '{"name": "look", "arguments": {}}'),
    ],
)
def test_tool_call_is_re_serialised_canonically(text, action):
    assert ToolCallActionParser().parse(text) == ParsedAction(action, None)


@pytest.mark.parametrize(
    "text, message",
    [
        ("I will search for Paris.", "found no <tool_call> blocks"),
        ('<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>', "found 2 <tool_call> blocks"),
        ('<tool_call>{"name": "search", "arguments": {</tool_call>', "is not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "must be an object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'needs a "name" string'),
        ('<tool_call>{"name": "", "arguments": {}}</tool_call>', 'needs a "name" string'),
        ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', 'needs a "name" string'),
        ('<tool_call>{"name": "search", "arguments": "Paris"}</tool_call>', "must be a JSON object"),
    ],
)
def test_tool_call_malformed_replies_give_a_message(text, message):
    parsed = ToolCallActionParser().parse(text)
    assert parsed.action is None and message in parsed.error


def test_tool_call_unknown_tool_names_the_available_ones():
    parsed = ToolCallActionParser(tools=["calculator", "search"]).parse(
        '<tool_call>{"name": "browse", "arguments": {}}</tool_call>')
    assert parsed == ParsedAction(None, "Unknown tool 'browse'; available tools: calculator, search.")


@pytest.mark.parametrize("text, action", [
    ("Thought:\nI should look for shoes.\n\nAction:\nsearch[red shoes]", "search[red shoes]"),
    ("Thought: click it\nAction: click[Buy Now]\n", "click[Buy Now]"),
    ("Action: go north\nThought: wait, no\naction:   go south  \nmore text", "go south"),  # the last Action: wins
])
def test_react_takes_the_first_line_after_the_last_action_marker(text, action):
    assert get_action_parser("react").parse(text) == ParsedAction(action, None)


@pytest.mark.parametrize("text, message", [
    ("I think I will search.", "No 'Action:' found"),
    ("Thought: hm\nAction:\n   \n", "Nothing followed 'Action:'"),
])
def test_react_malformed_replies_tell_the_model_the_format(text, message):
    assert message in get_action_parser("react").parse(text).error


def test_raw_sends_the_whole_reply_for_servers_that_parse_it_themselves():
    reply = "Let me think.\nIn summary, the next action I will perform is ```click [1234]```\n"
    assert get_action_parser("raw").parse(reply) == ParsedAction(reply.strip(), None)
    assert "empty" in get_action_parser("raw").parse(" \n").error
