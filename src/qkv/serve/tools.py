"""Tool calls as a model writes them: one ToolFormat per chat-template family, which says how a call looks
(the grammar that constrains it under tool_choice "required" or a named function) and reads the calls back
out of the generated text into OpenAI's `tool_calls`.

    fmt = tool_format(chat_template)              # "hermes" (Qwen, Hermes: <tool_call> tags), "llama3_json"
    grammar = fmt.grammar(functions, many=True)   # Lark text for GenerationConfig.grammar
    content, calls = fmt.parse(text)              # calls: [{"name": ..., "arguments": {...}}, ...]

The family is read off the template itself (the tags it writes when it renders an assistant's tool calls), as
vLLM's --tool-call-parser names it by hand; a template that renders tools in no known way gets Hermes' tags,
the most common.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qkv.generate.grammar import lark_json, lark_string

Call = dict[str, Any]  # {"name": str, "arguments": dict}
NO_ARGUMENTS = {"type": "object", "properties": {}}


def call_schema(functions: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one call object {"name": <one of functions>, arguments_key: <its parameters>}."""
    options = [{"type": "object",
                "properties": {"name": {"const": f["name"]},
                               arguments_key: f.get("parameters") or NO_ARGUMENTS},
                "required": ["name", arguments_key], "additionalProperties": False} for f in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _calls_of(values: list[Any], arguments_key: str) -> list[Call] | None:
    """Call objects, each {"name": str, arguments_key: object}; None when any is not one."""
    calls = []
    for v in values:
        if not (isinstance(v, dict) and isinstance(v.get("name"), str)):
            return None
        args = v.get(arguments_key, v.get("arguments", {}))
        if not isinstance(args, dict):
            return None
        calls.append({"name": v["name"], "arguments": args})
    return calls


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[Call]]:
    """Qwen / Hermes: each call a JSON object {"name", "arguments"} between <tool_call> tags; the text
    around them is the content."""
    found = _HERMES_CALL.findall(text)
    if not found:
        return text, []
    try:
        calls = _calls_of([json.loads(f) for f in found], "arguments")
    except ValueError:
        calls = None
    if calls is None:
        return text, []
    rest = _HERMES_CALL.sub("", text).strip()
    return rest or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[Call]]:
    """Llama 3.x's JSON tool calling: the whole answer is {"name", "parameters"} (several joined by ";"),
    after an optional <|python_tag|>; anything else is content."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    try:
        values = [json.loads(part) for part in _split_objects(body)]
    except ValueError:
        return text, []
    calls = _calls_of(values, "parameters")
    return (None, calls) if calls else (text, [])


def _split_objects(body: str) -> list[str]:
    """`{...}; {...}` -> the objects' texts (a ";" inside a string is not a separator: json's decoder finds
    each object's end)."""
    decoder, parts, i = json.JSONDecoder(), [], 0
    while i < len(body):
        _, end = decoder.raw_decode(body, i)
        parts.append(body[i:end])
        i = end
        while i < len(body) and body[i] in " \n\t;":
            i += 1
    return parts


@dataclass(frozen=True)
class ToolFormat:
    name: str
    arguments_key: str  # the call object's key for the arguments
    before: str  # the text around one call object
    after: str
    separator: str  # between two calls
    parse: Callable[[str], tuple[str | None, list[Call]]]

    def grammar(self, functions: list[dict[str, Any]], many: bool) -> str:
        """Lark text: one call (many: one or more) of one of `functions`, arguments by their schemas."""
        call = " ".join(p for p in (lark_string(self.before) if self.before else "",
                                    lark_json(call_schema(functions, self.arguments_key)),
                                    lark_string(self.after) if self.after else "") if p)
        start = f"call ({lark_string(self.separator)} call)*" if many else "call"
        return f"start: {start}\ncall: {call}\n"


TOOL_FORMATS = {
    "hermes": ToolFormat("hermes", "arguments", "<tool_call>\n", "\n</tool_call>", "\n", parse_hermes),
    "llama3_json": ToolFormat("llama3_json", "parameters", "", "", "; ", parse_llama3_json),
}


def tool_format(template: str | None) -> ToolFormat:
    """The family of a chat template's tool calls (see the module doc)."""
    t = template or ""
    if "<|python_tag|>" in t or ('"parameters"' in t and "ipython" in t):
        return TOOL_FORMATS["llama3_json"]
    return TOOL_FORMATS["hermes"]


def renders_tools(template: str | None) -> bool:
    """Whether a chat template reads the `tools` variable at all (else tools would be dropped unseen)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def openai_tool_calls(calls: list[Call]) -> list[dict[str, Any]]:
    """OpenAI's message.tool_calls: ids made here, arguments as a JSON string."""
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in calls]


def template_message(message: Any) -> dict[str, Any]:
    """A request's message as chat templates read it: role, text content (None left out by the renderer),
    and an assistant's tool_calls with their arguments as objects (templates write `arguments | tojson`;
    OpenAI sends them as JSON strings), a tool message's tool_call_id and name."""
    out: dict[str, Any] = {"role": message.role, "content": None if message.content is None else message.text}
    extra = message.model_extra or {}
    calls = extra.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_template_call(c) for c in calls]
    for key in ("tool_call_id", "name"):
        if isinstance(extra.get(key), str):
            out[key] = extra[key]
    return out


def _template_call(call: Any) -> Any:
    if not (isinstance(call, dict) and isinstance(call.get("function"), dict)):
        return call
    fn = dict(call["function"])
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass  # the template writes the string as it came
    # Qwen's template reads tool_call.function's fields; Llama's tool_call.function.arguments: both see them
    return {**call, "function": fn, "name": fn.get("name"), "arguments": fn.get("arguments")}
