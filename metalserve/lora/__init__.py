"""LoRA adapters served per request over one base model (docs/lora.md).

request.py: an adapter's identity as the scheduler and the prefix cache see it (no MLX);
files.py: reading mlx-lm's and PEFT's adapter directories; layers.py: the linear layers that add each
token's adapter delta, and the loaded adapters' slots.
"""
