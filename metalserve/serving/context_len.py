"""The context a model is served with: --max-model-len against what the model was trained for."""

from __future__ import annotations

import logging

from metalserve.config import ConfigError, EngineConfig

logger = logging.getLogger("metalserve.engine")


def resolve_max_model_len(
    config: EngineConfig, model_len: int, scaled_len: int | None = None, *, warn: bool = False
) -> int:
    """The context to serve: --max-model-len, else the model's trained context (`model_len`). Longer than
    that only with --allow-long-max-model-len; `scaled_len` is what a RoPE scaling from --hf-overrides
    covers, and `warn` logs the start-up warning for a context past the trained one."""
    wanted = config.max_model_len
    if wanted is None:
        if scaled_len is not None and scaled_len > model_len and warn:
            logger.info(
                "RoPE scaling covers %d tokens; pass --max-model-len (and --allow-long-max-model-len) "
                "to serve more than the trained %d",
                scaled_len,
                model_len,
            )
        return model_len
    if wanted <= model_len:
        return wanted
    if not config.allow_long_max_model_len:
        hint = (
            f"RoPE scaling from --hf-overrides covers {scaled_len} tokens"
            if scaled_len is not None
            else 'a RoPE scaling stretches it, e.g. --hf-overrides \'{"rope_scaling": {"rope_type": "linear", '
            '"factor": 4.0}}\''
        )
        raise ConfigError(
            f"--max-model-len {wanted} is longer than the model's trained context ({model_len} tokens); add "
            f"--allow-long-max-model-len to serve it anyway ({hint})"
        )
    if warn:
        if scaled_len is not None and wanted <= scaled_len:
            logger.warning(
                "--max-model-len %d is past the trained context (%d tokens), within what the RoPE scaling "
                "covers (%d): expect some loss of quality",
                wanted,
                model_len,
                scaled_len,
            )
        else:
            logger.warning(
                "--max-model-len %d is past the trained context (%d tokens) and past what any RoPE "
                "scaling covers: positions beyond %d were never trained, expect degraded output",
                wanted,
                model_len,
                scaled_len or model_len,
            )
    return wanted
