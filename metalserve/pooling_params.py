"""What a pooling request asks for (embeddings, rerank scores): no MLX, so the scheduler and the KV
manager can read it. vLLM's PoolingParams, reduced to what the engine itself computes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PoolingType = Literal["last", "mean", "cls"]
POOLING_TYPES: tuple[PoolingType, ...] = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingModel:
    """A pooling model's defaults (its sentence-transformers config, or the flags): what a request that
    does not say otherwise gets, and the width of its vectors."""

    pooling_type: PoolingType = "last"
    normalize: bool = True
    hidden_size: int = 0
    # A decoder reranker (vLLM's hf override `classifier_from_token`, e.g. Qwen3-Reranker's ["no", "yes"]):
    # the two token ids whose last-token logits score a (query, document) prompt; None: an embedder.
    score_token_ids: tuple[int, int] | None = None
    score_template: str = "{query}\n{document}"  # how a pair becomes the reranker's prompt
    # A cross-encoder (BertForSequenceClassification with one label): a pair is scored by its classifier,
    # through a sigmoid unless the model says its scores are raw (sentence-transformers' Identity).
    cross_encoder: bool = False
    score_sigmoid: bool = True

    def params(self, dimensions: int | None = None, logit_token_ids: tuple[int, ...] | None = None) -> PoolingParams:
        """A request's pooling: ValueError for a `dimensions` the model cannot give."""
        if dimensions is not None and self.hidden_size and not 1 <= dimensions <= self.hidden_size:
            raise ValueError(f"dimensions must be between 1 and the model's {self.hidden_size}")
        return PoolingParams(self.pooling_type, self.normalize, dimensions, logit_token_ids)


@dataclass(frozen=True)
class PoolingParams:
    """`pooling_type`: which hidden states make the vector (the last token's, the mean of all, the first);
    `normalize`: to unit length; `dimensions`: Matryoshka truncation to the first n (before normalising,
    as sentence-transformers and vLLM do); `logit_token_ids`: instead of the hidden state, the last
    token's logits of these vocabulary ids (a decoder reranker's yes/no); `classify`: a cross-encoder's
    classifier logits over the prompt (a tokenizer pair encoding: its second segment after the first
    [SEP])."""

    pooling_type: PoolingType = "last"
    normalize: bool = True
    dimensions: int | None = None
    logit_token_ids: tuple[int, ...] | None = None
    classify: bool = False

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling type must be one of {', '.join(POOLING_TYPES)}, not {self.pooling_type!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError("dimensions must be at least 1")
        if self.logit_token_ids is not None and self.pooling_type != "last":
            raise ValueError("logit scores are read at the last token only")
        if self.classify and self.logit_token_ids is not None:
            raise ValueError("a request is scored by a classifier or by token logits, not both")

    @property
    def reuses_prefix(self) -> bool:
        """Whether a prefix-cache hit can serve this request: only the last token's hidden state is
        needed (it is always recomputed); mean and CLS pooling need every prompt row's."""
        return self.pooling_type == "last" and not self.classify
