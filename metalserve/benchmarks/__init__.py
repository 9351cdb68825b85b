"""`metalserve bench serve`: a load client for any OpenAI-compatible server, like `vllm bench serve`.

Entry points: `add_cli_args(parser)` and `run_from_args(args) -> int` (see serve.py).
"""

from __future__ import annotations

from metalserve.benchmarks.serve import add_cli_args, main, run_from_args

__all__ = ["add_cli_args", "main", "run_from_args"]
