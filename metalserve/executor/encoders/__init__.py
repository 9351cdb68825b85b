"""Vision towers on the engine thread, and the encoder outputs they leave for the language model's steps."""
