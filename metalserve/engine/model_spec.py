"""What one served model is: its names, its engine options and whether it stays loaded; and the
`--models FILE` format (a YAML or JSON list of such entries). No MLX here: nothing is loaded."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metalserve.config import ConfigError, EngineConfig
from metalserve.loader.embedded import DEFAULT_FILE
from metalserve.speculative_config import SpeculativeConfig

# Per-model engine options a models file may set (EngineConfig's fields of the same names).
ENGINE_KEYS = (
    "max_model_len",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "long_prefill_token_threshold",
    "enable_prefix_caching",
    "scheduling_policy",
    "kv_cache_memory",
    "weights",
    "attention_backend",
    "chat_template",
    "tool_call_parser",
    "seed",
    "speculative_config",
)
# Per-model serving options (what ServerSettings holds for one model).
SERVING_KEYS = ("reasoning_parser", "enable_auto_tool_choice")
_NAME_KEYS = ("model", "path", "served_model_name", "name", "aliases", "pinned")
KNOWN_KEYS = frozenset(ENGINE_KEYS + SERVING_KEYS + _NAME_KEYS)


@dataclass(frozen=True)
class ModelSpec:
    """One served model: `names[0]` is its id in responses and /v1/models, the rest are aliases."""

    names: tuple[str, ...]
    config: EngineConfig
    pinned: bool = False  # never unloaded (neither when idle nor to make room)
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def aliases(self) -> tuple[str, ...]:
        return self.names[1:]


def default_names(model: str | None) -> tuple[str, ...]:
    """A model's names when none are given: the argument as written and, for a path, its file stem."""
    if model is None:
        return (Path(DEFAULT_FILE).stem,)
    stem = Path(model).stem if Path(model).exists() else None
    return (model,) if stem in (None, model) else (model, stem)


def spec_from_entry(entry: Any, base: EngineConfig, index: int) -> ModelSpec:
    """One entry of a models file over the command line's engine options; errors name the entry."""
    where = f"--models entry {index}"
    if isinstance(entry, str):
        entry = {"model": entry}
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a path or a mapping, got {type(entry).__name__}")
    unknown = sorted(set(entry) - KNOWN_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {', '.join(unknown)} (known: {', '.join(sorted(KNOWN_KEYS))})")
    if "model" in entry and "path" in entry:
        raise ConfigError(f"{where}: give `model` or `path`, not both")
    model = entry.get("model", entry.get("path"))
    if model is not None and not isinstance(model, str):
        raise ConfigError(f"{where}: `model` must be a path, a GGUF file or a hub id")
    names = _names(entry, model, where)
    options = {k: entry[k] for k in ENGINE_KEYS if k in entry}
    if isinstance(options.get("speculative_config"), dict):
        options["speculative_config"] = SpeculativeConfig.from_dict(options["speculative_config"])
    if isinstance(options.get("chat_template"), str) and Path(options["chat_template"]).is_file():
        options["chat_template"] = Path(options["chat_template"]).read_text()
    try:
        config = dataclasses.replace(base, model=model, served_model_name=names[0], **options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where} ({names[0]}): {exc}") from None
    pinned = entry.get("pinned", False)
    auto = entry.get("enable_auto_tool_choice", False)
    if not isinstance(pinned, bool) or not isinstance(auto, bool):
        raise ConfigError(f"{where}: `pinned` and `enable_auto_tool_choice` take true or false")
    if auto and not config.tool_call_parser:
        raise ConfigError(f"{where}: enable_auto_tool_choice needs tool_call_parser")
    return ModelSpec(names, config, pinned, entry.get("reasoning_parser"), auto)


def _names(entry: dict[str, Any], model: str | None, where: str) -> tuple[str, ...]:
    given = entry.get("served_model_name", entry.get("name"))
    names = list(default_names(model)) if given is None else [given] if isinstance(given, str) else list(given)
    aliases = entry.get("aliases", [])
    names += [aliases] if isinstance(aliases, str) else list(aliases)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{where}: names and aliases must be non-empty strings")
    return tuple(dict.fromkeys(names))


def read_models_file(path: str) -> list[Any]:
    """The entries of a YAML or JSON models file (YAML also reads JSON; .json files get JSON's errors)."""
    text = Path(path).read_text()
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml  # PyYAML

            data = yaml.safe_load(text)
    except Exception as exc:
        raise ConfigError(f"--models {path}: not valid YAML or JSON ({exc})") from None
    if isinstance(data, dict) and "models" in data:
        data = data["models"]
    if not isinstance(data, list) or not data:
        raise ConfigError(f"--models {path}: expected a non-empty list of models")
    return data


def build_specs(entries: list[Any], base: EngineConfig) -> list[ModelSpec]:
    """Every entry's spec; a name or alias used twice is an error (a request could not choose)."""
    specs = [spec_from_entry(e, base, i) for i, e in enumerate(entries)]
    seen: dict[str, str] = {}
    for spec in specs:
        for name in spec.names:
            if name in seen:
                raise ConfigError(f"the name {name!r} is used by two models ({seen[name]} and {spec.name})")
            seen[name] = spec.name
    return specs
