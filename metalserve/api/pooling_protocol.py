"""Request bodies of the pooling APIs: OpenAI's /v1/embeddings, vLLM's /score, and /v1/rerank, /v2/rerank in
the Jina / Cohere shape. Unknown fields are refused (never silently ignored)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# One input of an embeddings request: a text or token ids.
EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None  # accepted as OpenAI's is: it names the end user, nothing is done with it
    # vLLM's: keep the last k tokens of a longer input (-1: max_model_len); None: refuse a longer input.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool = True
    normalize: bool | None = None  # vLLM's: None: the model's default


class ScoreRequest(BaseModel):
    """vLLM's /score: `text_1` against each of `text_2` (one to many), or pairwise (equal lists)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)


class RerankRequest(BaseModel):
    """Jina's and Cohere's rerank: the documents in order of relevance to the query."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=0)  # None or 0: all
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling for an embedding model: the body of /v1/embeddings, each input's vector answered
    as `{"object": "pooling", "data": [...]}`."""
