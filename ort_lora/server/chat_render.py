"""How a chat request becomes prompt ids: the template (the request's, only with
--trust-request-chat-template, else the adapter's, else the model's), the tools and earlier
tool calls written in when the template ignores them (tool_prompt.py), and the output spec
with the tool-call parser that reads the reply (structured.py). Chat completions, the
Responses API and /tokenize render through it, on worker threads.
"""

from __future__ import annotations

from ort_lora.server.adapter_templates import AdapterTemplates
from ort_lora.server.errors import bad_request
from ort_lora.server.jobs import Lora
from ort_lora.server.limits import PromptBound
from ort_lora.server.structured import OutputSpec, output_spec
from ort_lora.server.tool_prompt import TemplateTools, ToolPrompting
from ort_lora.tokenizer import ChatTemplateError, Tokenizer


class ChatRenderer:
    """Renders chat requests with one tokenizer. `adapter_templates` holds the adapters' own
    templates (app.py sets its root); `tool_call_parser` None: the one the template implies."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_bound: PromptBound,
        adapter_templates: AdapterTemplates,
        trust_request_chat_template: bool = False,
        tool_call_parser: str | None = None,
    ):
        self.tokenizer = tokenizer
        self.prompt_bound = prompt_bound
        self.adapter_templates = adapter_templates
        self.trust_request_chat_template = trust_request_chat_template
        self.tool_call_parser = tool_call_parser
        self.tool_prompting = ToolPrompting(tokenizer)

    def prepare_chat(self, req, lora: Lora) -> tuple[OutputSpec, list[int]]:
        """The request's output spec and prompt ids (on a worker thread: probing a new
        template's tool support renders it). The tool-call parser is --tool-call-parser's,
        else the one the template implies (tool_prompt.py). A template that ignores tools
        gets them written in for "auto" only, where the model must choose and write a call
        on its own: "required" and named calls are the grammar's, and "none" asks for
        none (the block costs context: ~150 tokens and the tools' JSON)."""
        support = self.template_tools(req, self.template_for(req, lora))
        parser = self.tool_call_parser or (support.parser if support else None)
        spec = output_spec(req, parser)
        return spec, self.render(req, lora, spec.tools, show_tools=spec.tool_mode == "auto")

    def template_tools(self, req, template: str | None) -> TemplateTools | None:
        """What `template` does with tools (tool_prompt.py) if the request has any: tools,
        earlier calls or their results; else None, and no template is probed for it."""
        used = req.tools or any(m.role == "tool" or m.tool_calls for m in req.messages)
        return self.tool_prompting.for_template(template) if used else None

    def template_for(self, req, lora: Lora) -> str | None:
        """The request's template (only with --trust-request-chat-template), else the
        adapter's, else None (the model's)."""
        if req.chat_template is not None and not self.trust_request_chat_template:
            raise bad_request(
                "chat_template in a request is refused: this server renders only the model's "
                "and the adapters' own templates (start it with --trust-request-chat-template "
                "to allow it)",
                "chat_template",
            )
        return req.chat_template or self.chat_template_for(lora)

    def chat_template_for(self, lora: Lora) -> str | None:
        """An adapter's own chat template wins over the model's; a composition's adapters'
        when they all carry the same one. Read under adapter_templates.py's rules (inside the
        adapter root, regular, size-capped), cached per adapter."""
        if isinstance(lora, list):
            templates = {self.chat_template_for(r) for r in lora}
            return templates.pop() if len(templates) == 1 else None
        return None if lora is None else self.adapter_templates.get(lora)

    def render(self, req, lora: Lora, tools: list[dict], show_tools: bool = True) -> list[int]:
        """A chat request's prompt ids (chat completions, /tokenize): its messages and tools
        rendered by the request's template (only with --trust-request-chat-template), else
        the adapter's or the model's (bounded in time and size, chat_template.py), then
        encoded. A template that ignores tools gets them (with `show_tools`), the earlier
        calls and their results written into the messages (tool_prompt.py). Runs on a
        worker thread; messages longer in all than the context could hold are refused first
        (limits.PromptBound)."""
        self.prompt_bound.check_text(sum(map(_message_chars, req.messages)), "messages")
        template = self.template_for(req, lora)
        tok = self.tokenizer
        support = self.template_tools(req, template)
        messages = [m.as_template_dict() for m in req.messages]
        if support is not None:
            messages = support.messages(messages, tools, show_tools)
        kwargs = (req.chat_template_kwargs or {}) | ({"tools": tools} if tools else {})
        try:
            text = tok.apply_chat_template(messages, req.add_generation_prompt, template, **kwargs)
        except ChatTemplateError as exc:
            param = "chat_template" if req.chat_template is not None else "messages"
            raise bad_request(str(exc), param) from exc
        return tok.encode_releasing_gil(text, add_special_tokens=False)

    def tokenize(self, body, lora: Lora) -> list[int]:
        """/tokenize's ids: the prompt, or the messages as a chat request would render them."""
        if body.prompt is not None:
            self.prompt_bound.check_text(len(body.prompt), "prompt")
            return self.tokenizer.encode_releasing_gil(body.prompt, body.add_special_tokens)
        return self.render(body, lora, [t.model_dump(exclude_none=True) for t in body.tools or []])


def _message_chars(message) -> int:
    """The characters of a chat message the template renders: its content and its earlier
    tool calls' arguments."""
    content = message.content or ""
    chars = len(content) if isinstance(content, str) else sum(len(p.text) for p in content)
    return chars + sum(len(c.function.arguments) for c in message.tool_calls or ())
