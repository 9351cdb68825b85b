"""Record the reference scores of the tiny random cross-encoder (tests/api/tiny_cross_encoder.py) with
sentence-transformers' CrossEncoder on torch, for tests/api/test_cross_encoder.py. Run it with an
interpreter that has sentence-transformers and torch (not this project's environment):

    PYTHONPATH=$PWD /work/venvs/st/bin/python tools/cross_encoder_reference.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from sentence_transformers import CrossEncoder
from transformers import AutoTokenizer, BertForSequenceClassification

from tests.api.tiny_cross_encoder import DOCUMENTS, QUERY, write_tiny_cross_encoder

OUT = Path(__file__).parent.parent / "tests" / "data" / "cross_encoder_reference.npz"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_cross_encoder(Path(tmp) / "tiny")
        pairs = [(QUERY, d) for d in DOCUMENTS]
        scores = CrossEncoder(str(path), device="cpu").predict(pairs)  # sigmoid of the one logit
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = BertForSequenceClassification.from_pretrained(str(path)).eval()
        batch = tokenizer([q for q, _ in pairs], [d for _, d in pairs], padding=True, return_tensors="pt")
        with torch.no_grad():
            logits = model(**batch).logits[:, 0].numpy()
    np.savez(OUT, documents=np.array(DOCUMENTS), query=np.array(QUERY), scores=scores, logits=logits)
    print(OUT, scores, logits)


if __name__ == "__main__":
    main()
