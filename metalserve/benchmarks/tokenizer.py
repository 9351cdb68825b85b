"""Token counting for the bench client: a local HF tokenizer, or the server's own `POST /tokenize`."""

from __future__ import annotations

from typing import Any, Protocol

import httpx


class TokenizerError(RuntimeError):
    """No way to count tokens: the message says which flag to pass."""


class TokenCounter(Protocol):
    """Anything that turns text into token ids (no special tokens added)."""

    def encode(self, text: str) -> list[int]: ...


class LocalTokenizer:
    """A transformers tokenizer loaded from a local path (never from a hub)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer  # heavy: only when a local tokenizer is asked for

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many types; one clear message
            raise TokenizerError(f"cannot load a tokenizer from --tokenizer {path!r}: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))


class ServerTokenizer:
    """`POST {base_url}/tokenize` of the server under test (vLLM, metalserve and llama.cpp shapes)."""

    def __init__(
        self, base_url: str, model: str | None, timeout: float = 30.0, transport: httpx.BaseTransport | None = None
    ) -> None:
        self._client = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout, transport=transport)
        self._model = model

    def encode(self, text: str) -> list[int]:
        body: dict[str, Any] = {"prompt": text, "add_special_tokens": False}
        if self._model:
            body["model"] = self._model
        resp = self._client.post("/tokenize", json=body)
        # llama.cpp's server names the text `content`: older builds refuse `prompt`, newer ones answer 200
        # with no tokens for it.
        if resp.status_code >= 400 or (text and resp.json().get("tokens") == []):
            resp = self._client.post("/tokenize", json={"content": text, "add_special": False})
        if resp.status_code >= 400:
            raise TokenizerError(
                f"the server has no usable /tokenize ({resp.status_code}); pass --tokenizer <local path>"
            )
        tokens = resp.json().get("tokens")
        if not isinstance(tokens, list):
            raise TokenizerError("the server's /tokenize answered without a 'tokens' list")
        return [t if isinstance(t, int) else int(t["id"]) for t in tokens]

    def close(self) -> None:
        self._client.close()


def make_tokenizer(path: str | None, base_url: str, model: str | None) -> TokenCounter:
    """A local tokenizer when `path` is given, else the server's `/tokenize` (checked once here)."""
    if path:
        return LocalTokenizer(path)
    tok = ServerTokenizer(base_url, model)
    try:
        tok.encode("hello")
    except httpx.HTTPError as exc:
        raise TokenizerError(f"cannot reach {base_url}/tokenize ({exc}); pass --tokenizer") from exc
    return tok
