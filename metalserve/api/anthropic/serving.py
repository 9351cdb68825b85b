"""POST /v1/messages and /v1/messages/count_tokens on the chat pipeline's engine call."""

from __future__ import annotations

from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse

from metalserve.api.anthropic.events import message_events
from metalserve.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from metalserve.api.anthropic.render import message_body
from metalserve.api.anthropic.translate import to_chat
from metalserve.api.serving_chat import ChatServing
from metalserve.api.serving_common import cancel_on_disconnect, collect


class MessagesServing:
    """Translates a Messages request to chat form, runs it through ChatServing.start, renders Anthropic's."""

    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    async def create(self, req: MessagesRequest, raw: HTTPRequest) -> Response:
        chat_req = to_chat(req, reasoning=self.chat.reasoning_parser is not None)
        gen = await self.chat.start(chat_req, id_prefix="msg")
        model = self.chat.ctx.model_id(req.model)
        omit = req.thinking is not None and req.thinking.display == "omitted"
        if req.stream:
            return EventSourceResponse(message_events(gen, model, omit), sep="\n")
        [state] = await cancel_on_disconnect(raw, lambda: collect(gen.streams))
        final = gen.parsing.final(state.text, state.finish_reason)
        return JSONResponse(message_body(gen.request_id, model, final, state, omit))

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, Any]:
        chat_req = to_chat(req, reasoning=self.chat.reasoning_parser is not None)
        self.chat.ctx.check_model(chat_req.model, chat_req.lora_scale)
        return {"input_tokens": len((await self.chat.render_off_loop(chat_req)).token_ids)}
