"""JSON schemas as clients write them, made ready for the grammar engine.

JSON Schema makes `format` an annotation unless a validator chooses to assert it; Pydantic and others
write many (`password`, `binary`, `int32`, ...). The grammar enforces the formats llguidance implements
and takes every other one as the annotation it is, as vLLM and OpenAI do, instead of refusing the schema.
"""

from __future__ import annotations

from typing import Any

# The formats llguidance compiles into the grammar (checked against llguidance 1.9: every other name is
# "Unknown format" there).
ENFORCED_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"}
)
# Keywords whose values are JSON data, not subschemas: a "format" key inside them is data to keep.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "example"})


def drop_annotation_formats(node: Any) -> Any:
    """A copy of the schema `node` without the `format` values the grammar cannot enforce."""
    if isinstance(node, list):
        return [drop_annotation_formats(v) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "format" and isinstance(value, str) and value not in ENFORCED_FORMATS:
            continue
        if key == "properties" and isinstance(value, dict):  # property names are names, never keywords
            out[key] = {name: drop_annotation_formats(sub) for name, sub in value.items()}
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = drop_annotation_formats(value)
    return out


def strict_schema(node: Any) -> Any:
    """A copy of the schema `node` as OpenAI's `strict: true` reads it: an object schema that does not say
    otherwise takes no keys beyond its `properties` (`additionalProperties: false`), at every depth."""
    if isinstance(node, list):
        return [strict_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
            out[key] = {name: strict_schema(sub) for name, sub in value.items()}
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = strict_schema(value)
    is_object = node.get("type") == "object" or (isinstance(node.get("type"), list) and "object" in node["type"])
    if (is_object or "properties" in node) and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out
