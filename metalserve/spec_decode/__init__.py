"""Speculative decoding: drafts proposed per request, verified in the packed step by the target model.

`config.py` parses `--speculative-config`; `ngram.py` proposes prompt-lookup drafts and `draft_model.py`
a second model's (the one module here that runs MLX); `proposer.py` is the runner's drafting side,
`backoff.py` turns drafting off for requests whose drafts keep failing; `verify.py` turns a window's
logits into the accepted tokens (exact for greedy and for sampling), `grammar.py` masks each window
position of a grammar-constrained request; `stats.py` counts drafts for the metrics.
"""
