"""`metalserve bench serve`: a load client for any OpenAI-compatible server, like `vllm bench serve`.

Entry points: `add_cli_args(parser)` and `run_from_args(args) -> int` (in serve.py). They are looked up
lazily so that `python -m metalserve.benchmarks.serve` does not import serve.py twice.
"""

from __future__ import annotations

from typing import Any

__all__ = ["add_cli_args", "main", "run_from_args"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from metalserve.benchmarks import serve

        return getattr(serve, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
