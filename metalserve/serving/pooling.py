"""Whether a model is served as a pooling model (embeddings, score, rerank), and its defaults: from
`--runner` / `--pooling-type`, else from its sentence-transformers files (modules.json and the Pooling
module's config.json)."""

from __future__ import annotations

import json
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
