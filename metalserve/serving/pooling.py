"""Whether a model is served as a pooling model (embeddings, score, rerank), and its defaults: from
`--runner` / `--pooling-type`, else from its sentence-transformers files (modules.json and the Pooling
module's config.json)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from metalserve.config import EngineConfig
from metalserve.pooling_params import PoolingModel, PoolingType

_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
# sentence-transformers' pooling modes, in the order it checks them.
_MODES: tuple[tuple[str, PoolingType], ...] = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_lasttoken", "last"),
)


def sentence_transformers_pooling(model_dir: Path) -> tuple[PoolingType, bool] | None:
    """(pooling type, normalise) from a sentence-transformers directory; None: it is not one."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    modules: list[dict[str, Any]] = json.loads(modules_file.read_text())
    kinds = {m.get("type"): m.get("path", "") for m in modules}
    pooling: PoolingType = "mean"  # sentence-transformers' own default
    if _POOLING_MODULE in kinds:
        settings_file = model_dir / kinds[_POOLING_MODULE] / "config.json"
        settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
        found = [kind for key, kind in _MODES if settings.get(key)]
        if len(found) > 1 or (settings and not found):
            modes = [k for k, v in settings.items() if k.startswith("pooling_mode") and v]
            raise ValueError(f"{settings_file}: pooling {modes} is not one of cls, mean, last token")
        pooling = found[0] if found else pooling
    return pooling, _NORMALIZE_MODULE in kinds


# Qwen3-Reranker's prompt (its model card's format): the answer's first token is "yes" or "no".
QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n"
    "<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def reranker_of(model: PoolingModel, overrides: Mapping[str, Any] | None, tokenizer: Any) -> PoolingModel:
    """A decoder reranker from vLLM's hf overrides: `classifier_from_token` (two tokens: the "false" one,
    then the "true" one) and `is_original_qwen3_reranker` (Qwen3-Reranker's prompt)."""
    tokens = (overrides or {}).get("classifier_from_token")
    if tokens is None:
        return model
    if len(tokens) != 2 or tokenizer is None:
        raise ValueError('classifier_from_token takes two tokens (false, true), e.g. ["no", "yes"]')
    ids = []
    for token in tokens:
        found = tokenizer.encode(token, add_special_tokens=False)
        if len(found) != 1:
            raise ValueError(f"classifier_from_token: {token!r} is not one token of this tokenizer")
        ids.append(int(found[0]))
    template = QWEN3_RERANKER_TEMPLATE if (overrides or {}).get("is_original_qwen3_reranker") else model.score_template
    return replace(model, pooling_type="last", score_token_ids=(ids[0], ids[1]), score_template=template)


def pooling_model_of(config: EngineConfig, source: str, hidden_size: int, encoder: bool = False) -> PoolingModel | None:
    """The model's pooling defaults, or None for a generating model. `source`: what was loaded (a
    directory is read for sentence-transformers files); `encoder`: a BERT-family model (it can only pool)."""
    if config.runner == "generate":
        if encoder:
            raise ValueError("an encoder model cannot generate: leave --runner at auto or pooling")
        return None
    found = sentence_transformers_pooling(Path(source)) if Path(source).is_dir() else None
    if config.runner == "auto" and found is None and not encoder:
        if config.pooling_type is not None:
            raise ValueError("--pooling-type needs --runner pooling (or a sentence-transformers model)")
        return None
    pooling, normalize = found if found is not None else ("cls" if encoder else "last", True)
    return PoolingModel(config.pooling_type or pooling, normalize, hidden_size)
