"""The Responses API's reply: a response object, or a stream of its events, built from one
chat run (serving.ChatRun). The output is read as chat completions read it (tool calls by
structured.py) and laid out as output items:

    text        {"type": "message", "role": "assistant", "content": [{"type": "output_text",
                 "text", "annotations": [], "logprobs": []}]}
    each call   {"type": "function_call", "call_id", "name", "arguments"}

`status` is "completed", or "incomplete" with `incomplete_details.reason` "max_output_tokens"
when the length limit cut the output short. `usage` counts input, cached input
(RequestOutput.num_cached_tokens: prompt tokens the prefix cache served) and output tokens.

A stream sends response.created and response.in_progress, then per item
response.output_item.added, its content (response.content_part.added and
response.output_text.delta ... .done, or response.function_call_arguments.delta ... .done)
and response.output_item.done, then response.completed (or response.incomplete); each event
carries `sequence_number`. Text goes out as it is generated (up to a tool call's tag); a
named tool_choice streams its arguments as they are generated, "required" and "auto" calls
go out whole at the end. A failure after the first event is a response.failed event whose
`response.error` has the error's code and message.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from ort_lora.outputs import CompletionOutput, RequestOutput
from ort_lora.server.errors import ERROR_TYPES, api_error
from ort_lora.server.openai_responses_protocol import FunctionChoice, ResponsesRequest
from ort_lora.server.structured import OutputSpec, streamable_text, tool_calls


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(text)]}  # fmt: skip


def call_item(item_id: str, call: dict, status: str) -> dict:
    """A function_call item of a chat tool call (structured.new_call's shape)."""
    return {"type": "function_call", "id": item_id, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}  # fmt: skip


def message_text(spec: OutputSpec, text: str, content: str | None) -> str:
    """The message text of a finished output (content: tool_calls' reading of it): free
    text and "auto" show what a stream lets out, up to the first call's tag; a "required"
    output cut short inside its first call shows as it is; a named call shows none."""
    if spec.tool_mode in (None, "auto"):
        return streamable_text(spec, text, True)
    return content or ""


def _status(c: CompletionOutput) -> tuple[str, dict | None]:
    """The response's status and incomplete_details."""
    if c.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


class ResponseFormat:
    """The response object of one run, whole or as events."""

    def __init__(self, serving, req: ResponsesRequest, run, response_id: str):
        self.serving = serving
        self.req = req
        self.run = run
        self.id = response_id
        self.created = int(time.time())

    def body(self, status: str, output: list, usage=None, incomplete=None, error=None) -> dict:
        r = self.req
        choice = r.tool_choice or "auto"
        fmt = r.text.format if r.text is not None else None
        shown = {"by_alias": True, "exclude_none": True}
        text_format = {"type": "text"} if fmt is None else fmt.model_dump(**shown)
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "max_tool_calls": None,
            "model": self.run.model,
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": False,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": text_format, "verbosity": "medium"},
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else choice,
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": r.user,
            "metadata": r.metadata or {},
        }

    def usage(self, final: RequestOutput) -> dict:
        prompt = len(self.run.job.prompt_ids)
        output = sum(len(c.token_ids) for c in final.outputs)
        cached = final.num_cached_tokens
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output,
        }

    def full(self, final: RequestOutput) -> dict:
        c = final.outputs[0]
        content, calls = tool_calls(self.run.spec, c.text)
        text = message_text(self.run.spec, c.text, content)
        status, incomplete = _status(c)
        items = [message_item(new_id("msg"), text, status)] if text.strip() or not calls else []
        items += [call_item(new_id("fc"), call, "completed") for call in calls]
        return self.body(status, items, self.usage(final), incomplete)

    def stream(self) -> AsyncIterator[str]:
        return _EventStream(self).events()


class _EventStream:
    """The events of one streamed response, numbered; `items` holds the finished items."""

    def __init__(self, fmt: ResponseFormat):
        self.fmt = fmt
        self.spec = fmt.run.spec
        self.seq = 0
        self.items: list[dict] = []
        self.sent = ""  # the text (or, for a named call, arguments) sent so far
        self.open: dict | None = None  # the item being streamed

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def events(self) -> AsyncIterator[str]:
        fmt = self.fmt
        yield self.event("response.created", response=fmt.body("in_progress", []))
        yield self.event("response.in_progress", response=fmt.body("in_progress", []))
        try:
            last = None
            async for _, out in fmt.serving.iterate(fmt.run.job):
                last = out
                for event in self.on_output(out.outputs[0]):
                    yield event
            for event in self.finish(last):
                yield event
        except Exception as exc:  # the headers are sent: the failure goes in-band
            err = api_error(exc, f"stream {fmt.id}")
            error = {"code": err.code or ERROR_TYPES.get(err.status, "server_error"),
                     "message": err.message}  # fmt: skip
            yield self.event("response.failed", response=fmt.body("failed", self.items,
                                                                   error=error))  # fmt: skip

    def on_output(self, c: CompletionOutput) -> list[str]:
        """The deltas of one engine output: arguments of a named call, else the text the
        tool mode lets out now (a message opens at its first text that is not blank)."""
        if self.spec.tool_mode == "named":
            delta = c.text[len(self.sent) :]
            if not delta:
                return []
            events = [] if self.open else self.open_call(self.named_call(""))
            self.sent += delta
            return [*events, self.arguments_delta(delta)]
        shown = streamable_text(self.spec, c.text, c.finish_reason is not None)
        if self.open is None and not shown.strip():
            return []
        return self.text_delta(shown)

    def text_delta(self, shown: str) -> list[str]:
        delta = shown[len(self.sent) :]
        if not delta:
            return []
        events = [] if self.open else self.open_message()
        self.sent += delta
        index = len(self.items)
        return [*events, self.event("response.output_text.delta", item_id=self.open["id"],
                                    output_index=index, content_index=0, delta=delta,
                                    logprobs=[])]  # fmt: skip

    def open_message(self) -> list[str]:
        self.open = message_item(new_id("msg"), "", "in_progress")
        self.open["content"] = []
        index, item_id = len(self.items), self.open["id"]
        return [
            self.event("response.output_item.added", output_index=index, item=self.open),
            self.event("response.content_part.added", item_id=item_id, output_index=index,
                       content_index=0, part=_text_part("")),
        ]  # fmt: skip

    def named_call(self, arguments: str) -> dict:
        return {"id": new_id("call"), "function": {"name": self.spec.named,
                                                    "arguments": arguments}}  # fmt: skip

    def open_call(self, call: dict) -> list[str]:
        self.open = call_item(new_id("fc"), call, "in_progress")
        return [self.event("response.output_item.added", output_index=len(self.items),
                           item=self.open)]  # fmt: skip

    def arguments_delta(self, delta: str) -> str:
        return self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                          output_index=len(self.items), delta=delta)  # fmt: skip

    def close_call(self, arguments: str) -> list[str]:
        item = self.open | {"arguments": arguments, "status": "completed"}
        index, self.open = len(self.items), None
        self.items.append(item)
        return [
            self.event("response.function_call_arguments.done", item_id=item["id"],
                       output_index=index, name=item["name"], arguments=arguments),
            self.event("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip

    def close_message(self, status: str) -> list[str]:
        item = self.open | {"status": status, "content": [_text_part(self.sent)]}
        index, self.open = len(self.items), None
        self.items.append(item)
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self.event("response.output_text.done", **ids, text=self.sent, logprobs=[]),
            self.event("response.content_part.done", **ids, part=item["content"][0]),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def finish(self, last: RequestOutput) -> list[str]:
        """The closing events: what is still held back of the text, the calls, the
        response itself."""
        c = last.outputs[0]
        content, calls = tool_calls(self.spec, c.text)
        status, incomplete = _status(c)
        events = []
        if self.spec.tool_mode == "named":
            if self.open is None:
                events += self.open_call(self.named_call(""))
            events += self.close_call(c.text)
        else:
            text = message_text(self.spec, c.text, content)
            if self.open is not None or text.strip() or not calls:
                events += self.text_delta(text)
                events += [] if self.open else self.open_message()
                events += self.close_message(status)
            for call in calls:
                arguments = call["function"]["arguments"]
                events += [*self.open_call(call), self.arguments_delta(arguments)]
                events += self.close_call(arguments)
        usage = self.fmt.usage(last)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        body = self.fmt.body(status, self.items, usage, incomplete)
        return [*events, self.event(kind, response=body)]
