"""Encoder pooling models (BERT family: bidirectional attention, no KV): found by their config's model
type, loaded through mlx-embeddings' classes, and built into an EngineCore whose scheduler runs whole
prompts in steps of their own (executor/encoder_runner.py says why padded batches)."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from metalserve.config import ConfigError, EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.executor.encoder_runner import EncoderRunner
from metalserve.executor.models.families import is_encoder
from metalserve.kvcache.block_pool import NUM_RESERVED_BLOCKS
from metalserve.loader import LoadedModel
from metalserve.loader.weights_mode import parameter_bytes
from metalserve.platform import current_platform
from metalserve.scheduler.scheduler import Scheduler
from metalserve.serving.pooling import pooling_model_of

logger = logging.getLogger("metalserve.engine")


def encoder_model_type(model: str | None) -> str | None:
    """The model type of an encoder model directory; None for anything else (decoders, GGUF files, ids)."""
    if model is None or not (Path(model) / "config.json").is_file():
        return None
    model_type = json.loads((Path(model) / "config.json").read_text()).get("model_type")
    return model_type if is_encoder(model_type) else None


def load_encoder(config: EngineConfig) -> LoadedModel:
    """The encoder and its tokenizer; max_model_len is sentence-transformers' max_seq_length when given."""
    from mlx_embeddings.utils import load_model as load_embedding_model
    from transformers import AutoTokenizer

    assert config.model is not None
    path = Path(config.model)
    hf: dict[str, Any] = json.loads((path / "config.json").read_text())
    model = load_embedding_model(path)
    st_file = path / "sentence_bert_config.json"
    st = json.loads(st_file.read_text()) if st_file.is_file() else {}
    max_len = int(st.get("max_seq_length") or hf.get("max_position_embeddings", 512))
    return LoadedModel(
        model=model,
        tokenizer=AutoTokenizer.from_pretrained(str(path)),
        model_type=hf["model_type"],
        config=hf,
        max_model_len=max_len,
        eos_token_ids=frozenset(),
        chat_template=None,
        source=str(path),
        weights_desc=f"{hf.get('torch_dtype', 'float32')} (mlx-embeddings)",
        blas_desc="-",
    )


def build_encoder_core(config: EngineConfig, loaded: LoadedModel) -> EngineCore:
    """The core of an encoder: the same scheduler (its token budget, `max_num_seqs`, no prefix cache, whole
    prompts only) over block ids that hold nothing, and the encoder runner."""
    try:
        pooling = pooling_model_of(config, loaded.source, int(loaded.config.get("hidden_size", 0)), encoder=True)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    assert pooling is not None
    max_model_len = loaded.max_model_len if config.max_model_len is None else config.max_model_len
    if max_model_len > loaded.max_model_len:
        raise ConfigError(f"--max-model-len {max_model_len} is more than the encoder's {loaded.max_model_len}")
    # A prompt must fit one step: the budget is at least one whole prompt.
    budget = max(config.max_num_batched_tokens, max_model_len)
    steps = replace(config, enable_prefix_caching=False, max_num_batched_tokens=budget, kv_disk_dir=None)
    per_request = -(-max_model_len // config.block_size)
    scheduler = Scheduler(steps, config.max_num_seqs * per_request + NUM_RESERVED_BLOCKS, max_model_len)
    scheduler.whole_prompts = True
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    logger.info("encoder %s: %s pooling, whole prompts, no KV", loaded.model_type, pooling.pooling_type)
    return EngineCore(
        scheduler,
        EncoderRunner(loaded.model, pad),
        max_model_len,
        current_platform(),
        weight_bytes=parameter_bytes(loaded.model),
        pooling=pooling,
    )
