"""What one served model is: its names, its engine options and whether it stays loaded; and the
`--models FILE` format (a YAML or JSON list of such entries). No MLX here: nothing is loaded."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
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
    "runner",
    "pooling_type",
    "hf_overrides",
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

    @classmethod
    def of(cls, config: EngineConfig, names: Sequence[str] = ()) -> ModelSpec:
        """The spec of `config`'s model under `names` (none: its default names, `served_names`)."""
        return cls(served_names(config.model, names), config)

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def aliases(self) -> tuple[str, ...]:
        return self.names[1:]


def served_names(model: str | None, given: Sequence[str] = ()) -> tuple[str, ...]:
    """A model's served names, its id first: the names `given` (--served-model-name, a models file's
    `served_model_name`), else an id a person can read (a GGUF file's stem, a model directory's name, a hub
    id as written, the embedded default's file stem) and, as aliases, the argument as written and its full
    path (the ids earlier versions served it under)."""
    if given:
        return tuple(dict.fromkeys(given))
    if model is None:
        return (Path(DEFAULT_FILE).stem,)
    path = Path(model).expanduser()
    if not path.exists():
        return (model,)  # a hub id
    full = path.resolve()
    readable = full.stem if full.is_file() else full.name
    return tuple(dict.fromkeys((readable, model, str(full))))


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
        config = dataclasses.replace(base, model=model, **options)
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
    aliases = entry.get("aliases", [])
    words = [*_as_list(given), *_as_list(aliases)]
    if (given is not None and not _as_list(given)) or not all(isinstance(n, str) and n for n in words):
        raise ConfigError(f"{where}: names and aliases must be non-empty strings")
    return tuple(dict.fromkeys([*served_names(model, _as_list(given)), *_as_list(aliases)]))


def _as_list(value: Any) -> list[Any]:
    return (
        []
        if value is None
        else [value]
        if isinstance(value, str)
        else list(value)
        if isinstance(value, list)
        else [value]
    )


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
