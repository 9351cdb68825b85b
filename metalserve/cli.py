"""`metalserve serve | generate | bench serve`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import TYPE_CHECKING

from metalserve import __version__
from metalserve.config import WeightsMode

if TYPE_CHECKING:
    from metalserve.api.settings import ServerSettings


def _generate_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for prompts or chat messages (no server)")
    p.add_argument("model", nargs="?", default=None, help="GGUF file, model directory or hub id (default: embedded)")
    p.add_argument("--prompt", action="append", default=[], help="a raw prompt (repeatable)")
    p.add_argument("--chat", action="append", default=[], help="a user message, sent through the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop id before this many tokens")
    p.add_argument("--stop-token-id", type=int, action="append", default=[], help="stop at this id (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--max-model-len", type=int, default=None, help="the context limit (default: the model's)")
    p.add_argument("--weights", choices=[mode.value for mode in WeightsMode], default=WeightsMode.AUTO.value)


def run_generate(args: argparse.Namespace) -> int:
    from metalserve.config import ConfigError, EngineConfig
    from metalserve.executor.models.families import check_supported
    from metalserve.generate import encode_chat, generate
    from metalserve.loader import ModelLoadError, load_model
    from metalserve.sampling_params import SamplingParams

    if not args.prompt and not args.chat:
        print("metalserve generate: give at least one --prompt or --chat", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            max_tokens=args.max_tokens,
            min_tokens=args.min_tokens,
            stop_token_ids=args.stop_token_id,
            ignore_eos=args.ignore_eos,
        )
        config = EngineConfig(model=args.model, weights=args.weights, max_model_len=args.max_model_len)
        loaded = load_model(args.model, weights=args.weights, check_model_type=check_supported)
        prompts = [loaded.tokenizer.encode(p) for p in args.prompt] + [encode_chat(loaded, m) for m in args.chat]
        results = generate(loaded, prompts, params, config)
    except (ConfigError, ModelLoadError, ValueError) as e:
        print(f"metalserve generate: error: {e}", file=sys.stderr)
        return 1
    for text, result in zip(args.prompt + args.chat, results, strict=True):
        print(f"### {text}\n{result.text}\n")
    return 0


def _serve_args(sub: argparse._SubParsersAction) -> None:
    from metalserve.api.server import add_cli_args

    add_cli_args(sub.add_parser("serve", help="serve a model over the OpenAI API"))


def run_serve(args: argparse.Namespace) -> int:
    from metalserve.api.server import config_from_args, run_server
    from metalserve.config import ConfigError
    from metalserve.loader import ModelLoadError

    try:
        config, settings = config_from_args(args)
        run_server(config, packaged_defaults(config.model, settings))
    except (ConfigError, ModelLoadError, ValueError) as e:
        print(f"metalserve serve: error: {e}", file=sys.stderr)
        return 1
    return 0


def packaged_defaults(model: str | None, settings: ServerSettings) -> ServerSettings:
    """A packaged model (`serve qwen2.5-coder-0.5b`) is served for tools: tool_choice "auto" on, as its name
    promises (its parser is detected from its chat template, or named by the flag); unless the flag says
    `none`. Other models keep the flags as given."""
    from metalserve.loader.packaged import PACKAGED_MODELS

    if (model or "").lower() not in PACKAGED_MODELS or settings.tool_call_parser == "none":
        return settings
    return dataclasses.replace(settings, enable_auto_tool_choice=True)


def _models_args(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="the packaged models (PyPI wheels): list them, or assemble and verify them")
    p.add_argument("names", nargs="*", help="assemble and verify these (default: list every one and its state)")


def run_models(args: argparse.Namespace) -> int:
    from metalserve.loader import ModelLoadError
    from metalserve.loader.packaged import PACKAGED_MODELS, assemble, cache_dir

    if not args.names:
        for model in PACKAGED_MODELS.values():
            parts = len(model.part_sha256)
            installed = sum(model.part_path(n) is not None for n in range(1, parts + 1))
            assembled = (cache_dir() / model.file_name).is_file()
            print(f"{model.name}\t{model.title}\t{installed}/{parts} wheels\tassembled: {'yes' if assembled else 'no'}")
        return 0
    for name in args.names:
        wanted = PACKAGED_MODELS.get(name.lower())
        if wanted is None:
            print(
                f"metalserve models: unknown model {name!r}; choose from {', '.join(PACKAGED_MODELS)}", file=sys.stderr
            )
            return 2
        try:
            print(f"{wanted.name}: {assemble(wanted)} (sha256 {wanted.sha256})")
        except ModelLoadError as e:
            print(f"metalserve models: error: {e}", file=sys.stderr)
            return 1
    return 0


def _bench_args(sub: argparse._SubParsersAction) -> None:
    from metalserve.benchmarks.serve import add_cli_args

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    add_cli_args(bench.add_parser("serve", help="load-test an OpenAI-compatible server"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metalserve", description="An OpenAI-compatible LLM server on MLX.")
    parser.add_argument("--version", action="version", version=f"metalserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_args(sub)
    _generate_args(sub)
    _models_args(sub)
    _bench_args(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "models":
        return run_models(args)
    from metalserve.benchmarks.serve import run_from_args

    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
