"""Tool-call parsers: the registry, choosing one by name, by import path or by the template."""

from __future__ import annotations

import pytest

from workers.agent_loop.exceptions import ParserError
from workers.agent_loop.parsers import (
    BUILTIN,
    DeepSeekV3ToolParser,
    FunctionCall,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    Qwen3CoderToolParser,
    ToolCallParser,
    get_parser,
    parser_for_template,
    register_parser,
    registered_parsers,
    resolve_parser,
)


class UpperParser(ToolCallParser):
    """A user's parser, named in config by import path: `CALL name` lines."""

    stop_strings = ("END",)

    def parse(self, text: str) -> tuple[str, list[FunctionCall]]:
        calls = [FunctionCall(line[5:], {}) for line in text.splitlines() if line[:5] == "CALL "]
        return text, calls


NOT_A_PARSER = object()


def test_builtin_parsers_under_vllm_names() -> None:
    names = {"deepseek_v3", "hermes", "llama3_json", "mistral", "qwen3_coder"}
    assert {cls.name for cls in BUILTIN} == names
    assert names <= set(registered_parsers())  # a test below registers a user's parser too
    assert isinstance(get_parser("hermes"), HermesToolParser)
    assert get_parser("hermes").stop_strings == ("</tool_call>",)
    assert get_parser("qwen3_coder").stop_strings == ("</tool_call>",)
    assert get_parser("deepseek_v3").stop_strings == ("<｜tool▁calls▁end｜>",)
    # These two end a call turn on the model's own end of turn: no stop string of their own.
    assert get_parser("llama3_json").stop_strings == get_parser("mistral").stop_strings == ()


def test_unknown_name_and_bad_paths_are_one_line_errors() -> None:
    with pytest.raises(
        ParserError, match=r"unknown tool-call parser 'nope' \(known: .*hermes"
    ) as e:
        resolve_parser("nope", None)
    assert "\n" not in str(e.value) and e.value.cause == "config"
    with pytest.raises(ParserError, match=r"cannot load tool-call parser 'no_such_pkg\.mod:P'"):
        resolve_parser("no_such_pkg.mod:P", None)
    with pytest.raises(ParserError, match="is not a ToolCallParser subclass"):
        resolve_parser(f"{__name__}:NOT_A_PARSER", None)
    with pytest.raises(ParserError, match="registered twice"):

        @register_parser("hermes")
        class Other(HermesToolParser):
            pass


def test_a_users_parser_by_path_or_registration() -> None:
    cls = resolve_parser(f"{__name__}:UpperParser", "<tool_call> in the template")
    assert cls is UpperParser
    assert cls().parse("CALL lookup\n") == ("CALL lookup\n", [FunctionCall("lookup", {})])

    @register_parser("test_upper")
    class Registered(UpperParser):
        pass

    assert resolve_parser("test_upper", None) is Registered
    assert "test_upper" in registered_parsers()


# Fragments of the families' real templates (and the project's own ones): what each says.
REAL_TEMPLATES = {
    # Qwen2.5-Instruct
    "hermes": '<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}',
    # Llama-3.1-Instruct
    "llama3_json": '{"name": function name, "parameters": dictionary of argument name}'
    "{{- '<|python_tag|>' + tool_call.name + '.call(' }}",
    # Mistral-Small-3.2
    "mistral": "{{- '[TOOL_CALLS]' + tool.function.name + '[ARGS]' + arguments }}",
    # Qwen3-Coder: holds `<tool_call>` too, and is not hermes
    "qwen3_coder": "<tool_call>\\n<function=example_function_name>\\n<parameter=example_p>",
    # DeepSeek-V3-0324
    "deepseek_v3": "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + "
    "'<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' }}",
}


@pytest.mark.parametrize("name", sorted(REAL_TEMPLATES))
def test_the_parser_is_recognised_from_the_template(name: str) -> None:
    assert parser_for_template(REAL_TEMPLATES[name]) == name
    assert resolve_parser(None, REAL_TEMPLATES[name]).name == name


def test_the_project_templates_are_recognised() -> None:
    from pipeline.harness.models.templates import FAMILIES
    from pipeline.harness.models.tiny import HERMES

    for family in (HERMES, *FAMILIES.values()):
        assert parser_for_template(family.chat_template) == family.parser


def test_an_unrecognised_template_falls_back_to_hermes(caplog: pytest.LogCaptureFixture) -> None:
    assert parser_for_template("{{ messages[0].content }}") is None
    assert parser_for_template(None) is None
    assert resolve_parser(None, "{{ messages[0].content }}") is HermesToolParser
    assert "no tool-call format recognised" in caplog.text


def test_the_schemas_offered_reach_the_parser() -> None:
    schema = {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
    parser = get_parser("qwen3_coder", tools=[schema])
    assert parser.parameters == {"add": {"a": {"type": "integer"}}}
    assert isinstance(parser, Qwen3CoderToolParser)
    for cls in (Llama3JsonToolParser, MistralToolParser, DeepSeekV3ToolParser):
        assert cls([schema, {"no": "function"}]).parameters == {"add": {"a": {"type": "integer"}}}
