"""What a hostile or sloppy client sends: a huge `model` name is not echoed whole, base64 images as MIME
and URL-safe encoders write them decode, and the docs name every route that is open without the key."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from metalserve.api.app import _OPEN_PATHS, _OPEN_PREFIXES
from metalserve.multimodal.images import ImageError, decode_base64
from tests.api.conftest import MODEL, Served, live, make_served

ROOT = Path(__file__).resolve().parents[2]
HUGE = "m" * 100_000


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    with live(make_served()) as served:
        yield served


@pytest.mark.parametrize("anthropic", [False, True])
def test_a_huge_model_name_is_cut_in_the_404(server: Served, anthropic: bool) -> None:
    headers = {"anthropic-version": "2023-06-01"} if anthropic else {}
    chat = httpx.post(
        f"{server.url}/v1/messages" if anthropic else f"{server.url}/v1/chat/completions",
        headers=headers,
        json={"model": HUGE, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    card = httpx.get(f"{server.url}/v1/models/{HUGE[:50_000]}", headers=headers, timeout=30)  # httpx's URL cap
    for response, size in ((chat, 100_000), (card, 50_000)):
        assert response.status_code == 404
        assert len(response.content) < 1_000  # before: the whole name came back
        assert f"{size} characters" in response.text


def test_wrapped_and_url_safe_base64_decode_to_the_same_bytes() -> None:
    data = bytes(range(256)) * 3 + b"\xfb\xff"  # bytes whose base64 holds "+" and "/"
    plain = base64.b64encode(data).decode()
    wrapped = "\r\n".join(plain[i : i + 76] for i in range(0, len(plain), 76))
    url_safe = base64.urlsafe_b64encode(data).decode().rstrip("=")
    assert "-" in url_safe and "_" in url_safe
    for text in (plain, wrapped, url_safe, base64.encodebytes(data).decode()):
        assert decode_base64(text, "image/png") == data  # before: wrapped and URL-safe were refused
    with pytest.raises(ImageError, match="not valid base64"):
        decode_base64(plain[:10] + "*" + plain[10:], "image/png")


def test_the_docs_name_every_route_open_without_the_key() -> None:
    serving = (ROOT / "docs" / "serving.md").read_text()
    flag_row = next(line for line in serving.splitlines() if line.startswith("| `--api-key`"))
    for path in sorted(_OPEN_PATHS) + [p + "*" for p in _OPEN_PREFIXES]:
        assert f"`{path}`" in flag_row, path  # before: the docs said only /health was open


STRICT_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("route", ["responses", "chat/completions"])
def test_strict_true_reaches_the_grammar_without_extra_keys(server: Served, route: str) -> None:
    if route == "responses":
        fmt = {"type": "json_schema", "name": "a", "schema": STRICT_SCHEMA, "strict": True}
        body: dict[str, object] = {"input": "say:{}", "text": {"format": fmt}, "max_output_tokens": 8}
    else:
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": STRICT_SCHEMA, "strict": True}}
        body = {"messages": [{"role": "user", "content": "say:{}"}], "response_format": fmt, "max_tokens": 8}
    response = httpx.post(f"{server.url}/v1/{route}", json={"model": MODEL, **body}, timeout=30)
    assert response.status_code == 200, response.text
    schema = server.core.added[-1].sampling_params.structured_outputs.json
    assert schema == {**STRICT_SCHEMA, "additionalProperties": False}  # before: the schema as sent
