"""What every serving class is handed: the engine, the public model name, and the tokenizer thread
(with the checks that run before tokenizing)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from metalserve.api.errors import ContextLengthError, OpenAIError
from metalserve.api.request_log import RequestRecorder
from metalserve.engine.async_engine import AsyncEngine
from metalserve.engine.errors import shown_name
from metalserve.lora.request import LoraRequest
from metalserve.multimodal.limits import ImageLimits

T = TypeVar("T")
# Engine requests one call may start (prompts x n): each holds KV blocks and a slot in the batch.
MAX_SEQUENCES_PER_CALL = 128


def _tokenizer_thread() -> ThreadPoolExecutor:
    # One thread: HF fast tokenizers are not safe to call from several threads at once.
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="metalserve-tokenizer")


@dataclass
class ServingContext:
    """The engine, the names a serving class needs, and the thread that tokenizes off the event loop."""

    engine: AsyncEngine
    served_model_name: str
    image_limits: ImageLimits = field(default_factory=ImageLimits)  # ServerSettings' --max-image* flags
    default_max_tokens: int = 0  # --default-max-tokens: the output cap when a request sets none; 0: none
    # --override-generation-config: sampling fields for requests that leave them unset.
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    tokenizer_thread: ThreadPoolExecutor = field(default_factory=_tokenizer_thread)
    aliases: tuple[str, ...] = ()  # other names a request may give for this model
    recorder: RequestRecorder | None = None  # the status page's recent requests

    def check_model(self, model: str | None, lora_scale: float | None = None) -> None:
        """404 for a `model` that is neither this model nor a loaded adapter; 400 for a `lora_scale` given
        with the base model (a scale has nothing to scale there, and is never dropped silently)."""
        base = model is None or model == self.served_model_name or model in self.aliases
        if model is not None and not base and self.lora_for(model) is None:
            message = f"The model `{shown_name(model)}` does not exist."
            raise OpenAIError(message, 404, param="model", code="model_not_found")
        if base and lora_scale is not None:
            message = f"lora_scale scales a LoRA adapter's delta; `model` names the base model {self.served_model_name}"
            raise OpenAIError(message, 400, param="lora_scale")

    def model_id(self, model: str | None) -> str:
        """The `model` an answer names: the adapter the request chose, else the served name."""
        return model if model is not None and self.lora_for(model) is not None else self.served_model_name

    def lora_for(self, model: str | None, lora_scale: float | None = None) -> LoraRequest | None:
        """The LoRA adapter a request's `model` names (served like a model, as vLLM does), at the request's
        `lora_scale` (default 1); None: the base."""
        if model is None or model == self.served_model_name or model in self.aliases:
            return None
        lora = self.engine.lora_requests().get(model)
        return replace(lora, scale=lora_scale) if lora is not None and lora_scale is not None else lora

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer or template work in the tokenizer thread, so a huge prompt never stalls HTTP."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, fn, *args)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The longest vocabulary entry in UTF-8 bytes: no token covers more of the input text."""
        return max((len(str(t).encode("utf-8")) for t in self.engine.tokenizer.get_vocab()), default=1)

    async def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuse before tokenizing a text whose length alone proves it exceeds the context.

        Each token covers at most `max_token_bytes` bytes and each character is at least one byte (for
        tokenizers whose normalizer removes no characters), so the text has at least this many tokens."""
        limit = self.engine.max_model_len
        if num_chars <= limit:
            return
        least = num_chars // await self.off_loop(lambda: self.max_token_bytes)
        if least >= limit:
            error = ContextLengthError(least, limit, at_least=True)
            error.param = param
            raise error


def check_sequence_count(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_SEQUENCES_PER_CALL:
        raise OpenAIError(
            f"this call asks for {num_prompts} prompts x n={n} = {num_prompts * n} sequences; "
            f"at most {MAX_SEQUENCES_PER_CALL} per call",
            400,
            param="n",
        )
