"""A tool call's arguments in the lazy call grammar: an object valid for the tool's schema, its properties in
any order the model writes them.

llguidance's JSON schema grammar fixes the order of an object's properties to the schema's, and a model
writes them in its own: the 1.5B coder wrote Bash's `command`, `description`, then `timeout`, where
Claude Code's schema lists `timeout` before `description`; held to the schema's order, the grammar left it
the later properties to choose from and it chose `"run_in_background": true`, a different call. Here a
plain object schema of up to MAX_ANY_ORDER properties becomes one rule per set of properties written so
far: any property not yet written may come next, each at most once, and the object may close once every
required one is there. Each value is its property's own schema (`%json`). An open object's extra keys are
not offered (what the rules allow is still valid for the schema). Other schemas (more properties, `$ref`,
combinators, pattern or schema-valued additional properties) keep llguidance's whole-object grammar and
its order.
"""

from __future__ import annotations

import json
from typing import Any

# 2^n rules of up to n alternatives for n properties: Claude Code's tools have 3-5, Codex's exec_command 10.
MAX_ANY_ORDER = 6
# Keywords of an object schema the any-order rules honour (annotations are ignored, as llguidance does).
_OBJECT_KEYWORDS = frozenset(
    {"type", "properties", "required", "additionalProperties", "description", "title", "$schema", "x-guidance"}
)


def argument_rules(index: int, schema: dict[str, Any], options: dict[str, Any]) -> list[str]:
    """Lark lines defining `args_{index}`: the arguments object of `schema`; `options` its x-guidance
    (whitespace and leniency, with the schema's own x-guidance over them; its `whitespace_pattern` also
    goes between the members)."""
    given = schema.get("x-guidance")
    options = {**options, **(given if isinstance(given, dict) else {})}
    properties = _any_order_properties(schema)
    if properties is None:
        whole = {"type": "object", **schema, "x-guidance": options}
        return [f"args_{index}: %json {json.dumps(whole, ensure_ascii=False)}"]
    names = list(properties)
    required = {names.index(name) for name in schema.get("required", [])}
    prefix = f"args_{index}"
    lines = [f"{prefix}_ws: /{options['whitespace_pattern']}/"]
    for k, name in enumerate(names):
        value = {**properties[name], "x-guidance": options}
        lines.append(f"{prefix}_value_{k}: %json {json.dumps(value, ensure_ascii=False)}")
        key = json.dumps(json.dumps(name, ensure_ascii=False), ensure_ascii=False)  # "name" as a Lark literal
        lines.append(f'{prefix}_member_{k}: {key} {prefix}_ws ":" {prefix}_ws {prefix}_value_{k}')
    close = f'{prefix}_ws "}}"'
    first = [f"{prefix}_ws {prefix}_member_{k} {prefix}_after_{1 << k}" for k in range(len(names))]
    if not required:
        first.append(close)
    lines.append(f'{prefix}: "{{" ' + "(" + " | ".join(first) + ")")
    for written in range(1, 1 << len(names)):
        options_after = [
            f'{prefix}_ws "," {prefix}_ws {prefix}_member_{k} {prefix}_after_{written | 1 << k}'
            for k in range(len(names))
            if not written & 1 << k
        ]
        if all(written & 1 << k for k in required):
            options_after.append(close)
        lines.append(f"{prefix}_after_{written}: " + " | ".join(options_after))
    return lines


def _any_order_properties(schema: dict[str, Any]) -> dict[str, Any] | None:
    """The schema's properties where the any-order rules express it exactly, else None."""
    properties = schema.get("properties")
    if not isinstance(properties, dict) or not 0 < len(properties) <= MAX_ANY_ORDER:
        return None
    if set(schema) - _OBJECT_KEYWORDS or schema.get("type", "object") != "object":
        return None
    if schema.get("additionalProperties", False) not in (False, True):
        return None  # extra keys held to a schema of their own: llguidance's grammar has them
    required = schema.get("required", [])
    if not isinstance(required, list) or any(name not in properties for name in required):
        return None
    if "$ref" in json.dumps(schema) or not all(isinstance(v, dict) for v in properties.values()):
        return None
    return properties
