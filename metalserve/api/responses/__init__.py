"""The OpenAI Responses API (`/v1/responses`), translated onto the chat pipeline."""
