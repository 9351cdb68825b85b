"""POST /v1/responses and GET /v1/responses/{id} on the chat pipeline's engine call."""

from __future__ import annotations

from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse

from metalserve.api.deltas import ChoiceDelta, FinalOutput
from metalserve.api.errors import OpenAIError
from metalserve.api.responses import render
from metalserve.api.responses.events import ResponseEvents, response_events
from metalserve.api.responses.protocol import ResponsesRequest
from metalserve.api.responses.store import ResponseStore, StoredResponse
from metalserve.api.responses.translate import conversation, namespaces, to_chat
from metalserve.api.serving_chat import ChatServing, Generation
from metalserve.api.serving_common import cancel_on_disconnect, collect, now


class ResponsesServing:
    """Translates a Responses request (with its stored history) to chat form and renders the answer."""

    def __init__(self, chat: ChatServing, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    async def create(self, req: ResponsesRequest, raw: HTTPRequest) -> Response:
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise OpenAIError(
                    f"Previous response with id '{req.previous_response_id}' not found.",
                    400,
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            history = previous.history()
        items = conversation(req, history)
        gen = await self.chat.start(to_chat(req, items, reasoning=self.chat.reasoning_parser is not None), "resp")
        rid, created = gen.request_id, now()
        model = self.chat.ctx.model_id(req.model)

        def finish(finish_reason: str | None, output: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
            status = "incomplete" if finish_reason == "length" else "completed"
            cause = _incomplete_cause(gen, req, usage["output_tokens"]) if status == "incomplete" else None
            body = render.response_object(
                rid, created, req, model, status=status, output=output, usage=usage, cause=cause
            )
            if req.store:
                self.store.put(rid, StoredResponse(body, items))
            return body

        summary = bool(req.reasoning and req.reasoning.summary)
        if req.stream:
            shell = render.response_object(rid, created, req, model, status="in_progress", output=[], usage=None)

            def finish_stream(delta: ChoiceDelta, output: list[dict[str, Any]], reasoning: str) -> dict[str, Any]:
                usage = self._usage(
                    delta.num_prompt_tokens, delta.num_cached_tokens, delta.num_output_tokens, reasoning
                )
                return finish(delta.finish_reason, output, usage)

            events = response_events(gen, ResponseEvents(shell, summary, namespaces(req)), finish_stream)
            return EventSourceResponse(events, sep="\n")
        [state] = await cancel_on_disconnect(raw, lambda: collect(gen.streams))
        final = gen.parsing.final(state.text, state.finish_reason)
        usage = self._usage(state.num_prompt_tokens, state.num_cached_tokens, state.num_tokens, final.reasoning or "")
        output = _output(final, summary, namespaces(req))
        return JSONResponse(finish(final.finish_reason, output, usage))

    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self.retrieve_from(self.store, response_id)

    def delete(self, response_id: str) -> dict[str, Any]:
        return self.delete_from(self.store, response_id)

    @staticmethod
    def retrieve_from(store: ResponseStore, response_id: str) -> dict[str, Any]:
        """A stored response (the store is the server's, shared by every model)."""
        stored = store.get(response_id)
        if stored is None:
            raise OpenAIError(f"Response with id '{response_id}' not found.", 404, param="response_id")
        return stored.body

    @staticmethod
    def delete_from(store: ResponseStore, response_id: str) -> dict[str, Any]:
        if not store.delete(response_id):
            raise OpenAIError(f"Response with id '{response_id}' not found.", 404, param="response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    def _usage(self, prompt: int, cached: int, output: int, reasoning: str) -> dict[str, Any]:
        tokenizer = self.chat.ctx.engine.tokenizer
        reasoning_tokens = len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return render.usage(prompt, cached, output, min(reasoning_tokens, output))


def _incomplete_cause(gen: Generation, req: ResponsesRequest, num_output_tokens: int) -> str:
    """Which budget ended the output: the context window, the client's max_output_tokens, or the server's
    --default-max-tokens (for a request that set none)."""
    if gen.length_reason(num_output_tokens) == "context_length":
        return "context_window"
    return "max_output_tokens" if req.max_output_tokens is not None else "default_max_tokens"


def _output(final: FinalOutput, summary: bool, namespaces: dict[str, str]) -> list[dict[str, Any]]:
    """Output items in the order the model wrote them: reasoning, the message, then function calls."""
    output = []
    if final.reasoning:
        output.append(render.reasoning_item(render.item_id("rs"), final.reasoning, summary))
    if final.content:
        output.append(render.message_item(render.item_id("msg"), final.content))
    for call in final.tool_calls:
        fid, namespace = render.item_id("fc"), namespaces.get(call.name)
        output.append(render.function_call_item(fid, call.id, call.name, call.arguments, namespace=namespace))
    return output
