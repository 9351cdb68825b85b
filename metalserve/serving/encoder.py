"""Encoder pooling models (BERT family: bidirectional attention, no KV): found by their config's model
type, and built into an EngineCore whose scheduler runs whole prompts in steps of their own. A BERT runs
on the host (executor/bert_host.py) on MLX's CPU backend, and a BERT cross-encoder everywhere; other
encoders, and a BERT embedder on Metal, through mlx-embeddings' classes (executor/encoder_runner.py)."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.nn as nn

from metalserve.config import ConfigError, EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.executor.bert_host import load_host_bert
from metalserve.executor.encoder_runner import Encoder, EncoderRunner, MlxEncoder
from metalserve.executor.models.families import is_encoder
from metalserve.kvcache.block_pool import NUM_RESERVED_BLOCKS
from metalserve.loader import LoadedModel
from metalserve.loader.weights_mode import parameter_bytes
from metalserve.platform import current_platform
from metalserve.pooling_params import PoolingModel
from metalserve.scheduler.scheduler import Scheduler
from metalserve.serving.pooling import pooling_model_of

logger = logging.getLogger("metalserve.engine")


def encoder_model_type(model: str | None) -> str | None:
    """The model type of an encoder model directory; None for anything else (decoders, GGUF files, ids)."""
    if model is None or not (Path(model) / "config.json").is_file():
        return None
    model_type = json.loads((Path(model) / "config.json").read_text()).get("model_type")
    return model_type if is_encoder(model_type) else None


def is_cross_encoder(hf: dict[str, Any]) -> bool:
    """A sequence classifier (a cross-encoder's head over BERT, as sentence-transformers' CrossEncoder)."""
    return any(str(a).endswith("ForSequenceClassification") for a in hf.get("architectures") or ())


def runs_on_host(hf: dict[str, Any]) -> bool:
    """Whether the encoder runs on the host BERT: a BERT on MLX's CPU backend (its GELU and softmax are
    slow there) or a BERT cross-encoder (mlx-embeddings has no classification head)."""
    return hf.get("model_type") == "bert" and (current_platform().on_cpu or is_cross_encoder(hf))


def load_encoder(config: EngineConfig) -> LoadedModel:
    """The encoder and its tokenizer; max_model_len is sentence-transformers' max_seq_length when given.
    A host BERT's weights are read by `build_encoder_core` (`model` is then an empty MLX module)."""
    from transformers import AutoTokenizer

    assert config.model is not None
    path = Path(config.model)
    hf: dict[str, Any] = json.loads((path / "config.json").read_text())
    if is_cross_encoder(hf) and hf.get("model_type") != "bert":
        raise ConfigError(f"{path}: cross-encoders are served for BERT only, not {hf.get('model_type')!r}")
    if runs_on_host(hf):
        model, desc = nn.Module(), f"{hf.get('torch_dtype', 'float32')} -> float32 (host BERT: NumPy + numba)"
    else:
        from mlx_embeddings.utils import load_model as load_embedding_model

        model, desc = load_embedding_model(path), f"{hf.get('torch_dtype', 'float32')} (mlx-embeddings)"
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
        weights_desc=desc,
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
    encoder, weight_bytes, pooling = _encoder_of(loaded, pooling)
    max_model_len = loaded.max_model_len if config.max_model_len is None else config.max_model_len
    if max_model_len > loaded.max_model_len:
        raise ConfigError(f"--max-model-len {max_model_len} is more than the encoder's {loaded.max_model_len}")
    # A prompt must fit one step: the budget is at least one whole prompt.
    budget = max(config.max_num_batched_tokens, max_model_len)
    steps = replace(config, enable_prefix_caching=False, max_num_batched_tokens=budget, kv_disk_dir=None)
    per_request = -(-max_model_len // config.block_size)
    scheduler = Scheduler(steps, config.max_num_seqs * per_request + NUM_RESERVED_BLOCKS, max_model_len)
    scheduler.whole_prompts = True
    kind = "cross-encoder" if pooling.cross_encoder else f"{pooling.pooling_type} pooling"
    logger.info("encoder %s (%s): %s, whole prompts, no KV", loaded.model_type, loaded.weights_desc, kind)
    runner = EncoderRunner(encoder, loaded.tokenizer.sep_token_id)
    return EngineCore(scheduler, runner, max_model_len, current_platform(), weight_bytes=weight_bytes, pooling=pooling)


def _encoder_of(loaded: LoadedModel, pooling: PoolingModel) -> tuple[Encoder, int, PoolingModel]:
    """The forward, its weight bytes, and the pooling defaults (a cross-encoder scores pairs)."""
    if not runs_on_host(loaded.config):
        pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
        return MlxEncoder(loaded.model, pad), parameter_bytes(loaded.model), pooling
    bert = load_host_bert(Path(loaded.source))
    if not is_cross_encoder(loaded.config):
        return bert, bert.nbytes, pooling
    if bert.num_labels != 1:
        raise ConfigError(
            f"{loaded.source}: a classifier with {bert.num_labels} labels; a cross-encoder for /score and "
            "/rerank has one"
        )
    # sentence-transformers' CrossEncoder names its activation; vLLM's default is a sigmoid for one label.
    activation = str(loaded.config.get("sbert_ce_default_activation_function") or "")
    raw = activation.endswith("Identity")
    return (
        bert,
        bert.nbytes,
        replace(pooling, pooling_type="cls", normalize=False, cross_encoder=True, score_sigmoid=not raw),
    )
