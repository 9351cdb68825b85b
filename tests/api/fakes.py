"""Test doubles: a tiny byte-level BPE tokenizer with a chat template, and a scripted engine core."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from metalserve.kvcache.connector.base import ConnectorStats
from metalserve.outputs import EngineCoreOutput, TokenLogprob
from metalserve.request import Request

CORPUS = [
    "Hello world! The capital of France is Paris. The weather in Paris is sunny today.",
    "user assistant system tool call get_weather city arguments name function",
    '{"name": "get_weather", "arguments": {"city": "Paris"}} {"location": "Berlin", "unit": "c"}',
    "One two three four five six seven eight nine ten. Stop here. STOP now. The end.",
    "caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e \U0001f600 \U0001f680 r\u00e9sum\u00e9",
]

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>tool\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@lru_cache(maxsize=1)
def tiny_tokenizer() -> Any:
    """A byte-level BPE (multi-byte characters span several tokens) trained on CORPUS; eos is id 2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|endoftext|>"
    )
    fast.add_tokens(["<tool_call>", "</tool_call>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


@dataclass
class FakeStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_free_blocks: int
    num_total_blocks: int
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    connector: ConnectorStats | None = None  # the disk tier's counters; none in the fake


@dataclass
class _Running:
    request: Request
    script: list[int]
    num_blocks: int


class FakeCore:
    """Emits a scripted reply, token by token, obeying max_tokens, eos, stop ids and the context limit.

    It keeps a block count per request (freed on finish, abort and finish_requests), a prefix cache of
    block-aligned prompt prefixes keyed by cache_salt, and records which threads called it.
    """

    def __init__(
        self,
        tokenizer: Any,
        reply: str | Callable[[Request], str] = "Hello world! caf\u00e9 \U0001f600 The end.",
        *,
        num_blocks: int = 256,
        block_size: int = 4,
        max_model_len: int = 256,
        step_delay: float = 0.0,
        fail_after_steps: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.reply = reply
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.step_delay = step_delay
        self.fail_after_steps = fail_after_steps
        self.running: dict[str, _Running] = {}
        self.added: list[Request] = []
        self.aborted: list[str] = []
        self.finished_by_frontend: list[str] = []
        self.cached_prefixes: set[tuple[str | None, tuple[int, ...]]] = set()
        self.queries = 0
        self.hits = 0
        self.steps = 0
        self.threads: set[int] = set()
        self.lock = threading.Lock()

    def _touch(self) -> None:
        self.threads.add(threading.get_ident())

    @property
    def used_blocks(self) -> int:
        return sum(r.num_blocks for r in self.running.values())

    def add_request(self, request: Request) -> None:
        self._touch()
        text = self.reply if isinstance(self.reply, str) else self.reply(request)
        script = self.tokenizer.encode(text, add_special_tokens=False) + [2]
        request.num_cached_tokens = self._lookup_prefix(request)
        blocks = -(-request.num_prompt_tokens // self.block_size)
        with self.lock:
            self.added.append(request)
            self.running[request.request_id] = _Running(request, script, blocks)

    def _lookup_prefix(self, request: Request) -> int:
        bs, prompt = self.block_size, request.prompt_token_ids
        full = (len(prompt) - 1) // bs
        hit = 0
        for i in range(1, full + 1):
            key = (request.cache_salt, tuple(prompt[: i * bs]))
            if key in self.cached_prefixes and hit == (i - 1) * bs:
                hit = i * bs
            self.cached_prefixes.add(key)
        self.queries += len(prompt)
        self.hits += hit
        return hit

    def abort_requests(self, request_ids: list[str]) -> None:
        self._touch()
        with self.lock:
            for rid in request_ids:
                if self.running.pop(rid, None) is not None:
                    self.aborted.append(rid)

    def finish_requests(self, request_ids: list[str]) -> None:
        self._touch()
        with self.lock:
            for rid in request_ids:
                self.running.pop(rid, None)
                self.finished_by_frontend.append(rid)

    def has_unfinished_requests(self) -> bool:
        self._touch()
        return bool(self.running)

    def step(self) -> list[EngineCoreOutput]:
        self._touch()
        self.steps += 1
        if self.fail_after_steps is not None and self.steps > self.fail_after_steps:
            raise RuntimeError("simulated core failure")
        if self.step_delay:
            time.sleep(self.step_delay)
        with self.lock:
            return [self._advance(r) for r in list(self.running.values())]

    def _advance(self, run: _Running) -> EngineCoreOutput:
        req, params = run.request, run.request.sampling_params
        index = req.num_output_tokens
        token = run.script[index % len(run.script)]
        req.output_token_ids.append(token)
        run.num_blocks = -(-req.num_tokens // self.block_size)
        reason, stop_reason = self._finish_reason(req, token)
        logprobs = None
        if params.logprobs is not None:
            top = [((token + j) % 300, -0.1 * (j + 1)) for j in range(params.logprobs)]
            logprobs = [TokenLogprob(token, -0.1, top)]
        if reason is not None:
            self.running.pop(req.request_id, None)
        return EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=[token],
            new_logprobs=logprobs,
            finish_reason=reason,
            stop_reason=stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
        )

    def _finish_reason(self, req: Request, token: int) -> tuple[str | None, int | None]:
        params = req.sampling_params
        if token in params.stop_token_ids:
            return "stop", token
        if token in req.eos_token_ids and not params.ignore_eos:
            return "stop", None
        if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
            return "length", None
        if req.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def make_stats(self) -> FakeStats:
        self._touch()
        used = self.used_blocks
        return FakeStats(
            num_running=len(self.running),
            num_waiting=0,
            kv_cache_usage=used / self.num_blocks,
            prefix_cache_queries=self.queries,
            prefix_cache_hits=self.hits,
            num_preemptions=0,
            num_free_blocks=self.num_blocks - used,
            num_total_blocks=self.num_blocks,
        )


DEFAULT_REPLY = "Hello world! caf\u00e9 \U0001f600 The end."


def say_reply(tokenizer: Any) -> Callable[[Request], str]:
    """Reply with what follows the last `say:` in the prompt (up to the turn's end), else DEFAULT_REPLY.

    A seed shows in the default reply, so seeded samples differ from each other and repeat.
    """

    def reply(request: Request) -> str:
        if any(t == tokenizer.convert_tokens_to_ids("<|endoftext|>") for t in request.prompt_token_ids):
            raise ValueError("prompt refused by the core")
        text = tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
        index = text.rfind("say:")
        if index >= 0:
            return text[index + 4 :].split("<|im_end|>")[0]
        seed = request.sampling_params.seed
        return DEFAULT_REPLY if seed is None else f"{DEFAULT_REPLY} #{seed}"

    return reply
