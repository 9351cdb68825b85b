"""The Anthropic Messages API (`/v1/messages`), translated onto the chat pipeline."""
