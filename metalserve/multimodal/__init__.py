"""Images in a request: decoding and limits (images.py), what a request carries (inputs.py), the model's
processing of pixels into placeholder tokens (processor.py) and M-RoPE positions (mrope.py).

Nothing here imports MLX: the scheduler and the API read these types; the arrays a vision tower makes
live in the executor (metalserve/executor/encoders/).
"""
