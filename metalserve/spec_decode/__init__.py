"""Speculative decoding: drafts proposed per request, verified in the packed step by the target model.

`--speculative-config` is parsed by metalserve/speculative_config.py (a config, below this package).
`ngram.py` proposes prompt-lookup drafts (a second model's are the executor's: executor/draft_model.py
runs that model); `proposer.py` is the runner's drafting side. Nothing here imports the executor: the
runner calls into this package, never the other way.
`controller.py` says how many drafts each request gets: `backoff.py` pauses requests whose drafts keep
failing, `cost.py` gives the batch only the drafts that pay for their share of the step. `verify.py`
turns a window's logits into the accepted tokens (exact for greedy and for sampling), `grammar.py`
masks each window position of a grammar-constrained request; `rollback.py` says how many window
positions the scheduler and the runner roll back; `stats.py` counts drafts for the metrics.
"""
