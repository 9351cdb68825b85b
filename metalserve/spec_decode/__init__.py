"""Speculative decoding: drafts proposed per request, verified in the packed step by the target model.

`config.py` parses `--speculative-config`; `ngram.py` proposes prompt-lookup drafts; `backoff.py` turns
drafting off for requests whose drafts keep failing; `verify.py` turns a window's logits into the
accepted tokens (exact for greedy and for sampling); `stats.py` counts drafts for the metrics.
Nothing here imports MLX: the runner hands the verifier its sampler.
"""
