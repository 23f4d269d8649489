"""What a request's response_format and tools ask of the output, as the grammar the engine constrains it to
(GenerationConfig.grammar, generate/grammar.py), each schema compiled here so that one llguidance cannot take
is a 400 naming its field before the request reaches the engine.

    response_format {"type": "json_object"}                  -> any JSON object
    response_format {"type": "json_schema", "json_schema": {"schema": S}}   -> JSON valid against S
    tools + tool_choice "required" / {"type": "function", ...}  -> the template family's call syntax around
                                                                  {"name", arguments valid against the schema}
    tools + tool_choice "auto" (the default) / "none"          -> no grammar (auto: calls parsed if written)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qkv.generate.grammar import GrammarError, check_grammar, json_schema_grammar
from qkv.serve.errors import APIError
from qkv.serve.requests import ChatCompletionRequest, CompletionRequest
from qkv.serve.tools import NO_ARGUMENTS, ToolFormat


@dataclass
class ToolUse:
    """A chat request's tools as the handler needs them: what the template gets, how calls are read."""

    tools: list[dict[str, Any]]  # OpenAI's tool objects, for the template's `tools`
    format: ToolFormat


def tool_use(body: CompletionRequest | ChatCompletionRequest, fmt: ToolFormat) -> ToolUse | None:
    """The tools the template renders and whose calls are parsed; None without tools or with tool_choice
    "none" (the model is then not told of them). 400 for a tool_choice that names no given tool."""
    if not isinstance(body, ChatCompletionRequest):
        return None
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "'tool_choice' needs 'tools'", "tool_choice", "invalid_value")
        return None
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise APIError(400, f"'tools' names a function twice: {names}", "tools", "invalid_value")
    if not isinstance(choice, str) and choice is not None and choice.function.name not in names:
        raise APIError(400, f"'tool_choice' names the function '{choice.function.name}', which is not in "
                       f"'tools' ({', '.join(names)})", "tool_choice", "invalid_value")
    if choice == "none":
        return None
    return ToolUse([t.model_dump(exclude_none=True) for t in body.tools], fmt)


def grammar_of(body: CompletionRequest | ChatCompletionRequest, fmt: ToolFormat, table: Any) -> str | None:
    """The grammar of the request's output (None: unconstrained), checked against the model's vocabulary
    (`table`, grammar.token_table); a 400 naming the field whose schema does not compile."""
    tools = body.tools if isinstance(body, ChatCompletionRequest) else None
    choice = body.tool_choice if isinstance(body, ChatCompletionRequest) else None
    for i, t in enumerate(tools or []):  # every tool's schema, whether or not this request forces a call
        params = t.function.parameters if t.function.parameters is not None else NO_ARGUMENTS
        _compiled(json_schema_grammar_of(params, f"tools[{i}].function.parameters"),
                  table, f"tools[{i}].function.parameters")
    if tools and (choice == "required" or (choice is not None and not isinstance(choice, str))):
        functions = [t.function.model_dump(exclude_none=True) for t in tools
                     if isinstance(choice, str) or t.function.name == choice.function.name]
        many = choice == "required" and body.parallel_tool_calls is not False
        return _compiled(fmt.grammar(functions, many), table, "tools")
    fmt_ = body.response_format
    if fmt_ is None or fmt_.type == "text":
        return None
    if fmt_.type == "json_object":
        return _compiled(json_schema_grammar(None), table, "response_format")
    schema = fmt_.json_schema.schema_
    field = "response_format.json_schema.schema"
    return _compiled(json_schema_grammar_of(schema, field), table, field)


def json_schema_grammar_of(schema: dict[str, Any] | None, field: str) -> str:
    """json_schema_grammar (None: any JSON object), its refusal a 400 naming `field`."""
    try:
        return json_schema_grammar(schema)
    except GrammarError as e:
        raise APIError(400, f"'{field}' is not a JSON schema the grammar engine can compile: {e}", field,
                       "invalid_value") from None


def _compiled(grammar: str, table: Any, field: str) -> str:
    try:
        check_grammar(grammar, table)
    except GrammarError as e:
        raise APIError(400, f"'{field}' is not a JSON schema the grammar engine can compile: {e}", field,
                       "invalid_value") from None
    return grammar
