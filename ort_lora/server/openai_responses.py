"""OpenAI's Responses API: POST /v1/responses, served on the chat completions path.

    request (openai_responses_protocol.py) -> a ChatCompletionRequest -> serving.start_chat
    (model or adapters, template, tools, structured outputs, the engine) -> the response
    object or its event stream (openai_responses_format.py)

Stateless: nothing is stored (`store` is false in every response), so GET and DELETE
/v1/responses/{id} are 404s that say so. Errors are the server's usual 4xx bodies, naming
the Responses field (`input`, `text.format`, `max_output_tokens`) where the chat path would
name its own.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ort_lora.server.bodies import json_body
from ort_lora.server.errors import APIError
from ort_lora.server.openai_responses_format import ResponseFormat, new_id
from ort_lora.server.openai_responses_protocol import (
    NO_STATE,
    ResponsesRequest,
    renamed,
    to_chat,
)

ResponsesBody = Annotated[ResponsesRequest, json_body(ResponsesRequest)]
_JSON_OR_EVENTS_200 = {
    200: {
        "description": "A response object, or a text/event-stream of its events with stream=true",
        "content": {"application/json": {}, "text/event-stream": {}},
    }
}


async def create_response(serving, req: ResponsesRequest, raw: Request):
    """The response to `req` (which passed the app's field check in bodies.py)."""
    chat = await run_in_threadpool(to_chat, req)
    response_id = new_id("resp")
    try:
        run = await serving.start_chat(chat, raw, response_id)
        reply = ResponseFormat(serving, req, run, response_id)
        if req.stream:
            return StreamingResponse(
                reply.stream(),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return JSONResponse(reply.full(await serving.finish_chat(raw, run)))
    except APIError as exc:
        raise renamed(exc) from exc.__cause__


def not_stored(response_id: str) -> APIError:
    return APIError(
        404,
        f"response {response_id[:80]!r} not found: {NO_STATE}",
        param="response_id",
        code="response_not_found",
    )


def responses_router(serving, auth: list) -> APIRouter:
    """POST /v1/responses, and GET / DELETE /v1/responses/{id} (404: nothing is stored)."""
    router = APIRouter(dependencies=auth)

    @router.post("/v1/responses", responses=_JSON_OR_EVENTS_200)
    async def responses(body: ResponsesBody, raw: Request):
        """OpenAI's Responses API, stateless (docs/API.md#responses-api)."""
        return await create_response(serving, body, raw)

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        raise not_stored(response_id)

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        raise not_stored(response_id)

    return router
