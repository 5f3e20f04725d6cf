"""``POST /v1/chat/completions``'s request: messages through the chat template, tools, forced calls,
reasoning switches and the chat-only fields, into a `Parsed`.

The template decides the prompt: ``add_generation_prompt`` (default true) opens the assistant's
turn, ``continue_final_message`` leaves the last (assistant) message open so the model continues it
(the two exclude each other, as in vLLM); ``chat_template`` replaces the tokenizer's; ``documents``,
``tools``, ``chat_template_kwargs`` and ``reasoning_effort`` reach it. The output is parsed by
serve/chat_output.py with the options gathered here (`Parsed.chat`).
"""

from __future__ import annotations

from .errors import ApiError
from .protocol import REASONING_EFFORTS, Context, Parsed, _check_ids, _common, _flag, _get, _params
from .structured import forced_call_grammar, structured
from .tools import check_messages, check_tools

__all__ = ["parse_chat"]


def _template_kwargs(body: dict) -> dict:
    """What the template gets besides messages and tools."""
    extra = dict(_get(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object", {}))
    effort = _get(body, "reasoning_effort", lambda v: v in REASONING_EFFORTS,
                  f"one of {', '.join(REASONING_EFFORTS)}", None)
    if effort is not None:  # the templates read it; "none" also turns thinking off (enable_thinking/thinking)
        extra = {"enable_thinking": effort != "none", "thinking": effort != "none", **extra,
                 "reasoning_effort": effort}
    gen, cont = _flag(body, "add_generation_prompt", True), _flag(body, "continue_final_message", False)
    if gen and cont:
        raise ApiError("'continue_final_message' continues the last message: send 'add_generation_prompt': "
                       "false with it", param="continue_final_message", code="invalid_value")
    extra.update(add_generation_prompt=gen, continue_final_message=cont)
    template = _get(body, "chat_template", lambda v: isinstance(v, str) and v, "a non-empty string", None)
    if template is not None:
        extra["chat_template"] = template
    docs = _get(body, "documents", lambda v: isinstance(v, list) and all(
        isinstance(d, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in d.items()) for d in v),
        "a list of objects of strings", None)
    if docs is not None:
        extra["documents"] = docs
    return extra


def _render(ctx: Context, messages: list, tools, extra: dict) -> str:
    tok = ctx.tokenizer
    if tok is None or not (getattr(tok, "chat_template", None) or extra.get("chat_template")):
        raise ApiError("chat completions need a tokenizer with a chat template in the checkpoint folder",
                       param="messages", code="no_chat_template")
    if extra["continue_final_message"] and messages[-1]["role"] != "assistant":
        raise ApiError("'continue_final_message' continues the last message, which must be the assistant's",
                       param="continue_final_message", code="invalid_value")
    try:
        return tok.apply_chat_template(messages, tools=tools, tokenize=False, **extra)
    except Exception as e:  # the template refused these messages
        raise ApiError(f"'messages' do not fit the chat template: {e}"[:300], param="messages",
                       code="invalid_value") from None


def parse_chat(body: dict, ctx: Context) -> Parsed:
    c = _common(body, ctx, chat=True)
    kw = c.kw
    messages = check_messages(body.get("messages"))
    tools, choice = check_tools(body, ctx.chat_setup)
    extra = _template_kwargs(body)
    setup = ctx.chat_setup
    forced = isinstance(choice, tuple) or choice == "required"  # the grammar starts the answer with the call
    grammar_field = "response_format" if kw["structured"] is not None else None
    if forced:
        if kw["structured"] is not None:
            raise ApiError("'response_format' and a forced 'tool_choice' cannot be combined", param="tool_choice",
                           code="invalid_value")
        grammar = forced_call_grammar(setup.tool_parser, tools, choice[1] if isinstance(choice, tuple) else None)
        kw["structured"], grammar_field = structured(grammar, ctx.tokenizer_dir, "tool_choice"), "tool_choice"
    text = _render(ctx, messages, tools, extra)
    tool_parser = setup.tool_parser if (setup is not None and tools is not None and choice != "none") else None
    reasoning_parser = setup.reasoning_parser if setup is not None and not forced else None
    parallel = _flag(body, "parallel_tool_calls", True)
    chat = None
    if tool_parser or reasoning_parser:
        chat = {"tool_parser": tool_parser, "reasoning_parser": reasoning_parser,
                "opened_thought": text.rstrip().endswith("<think>"), "parallel_tool_calls": parallel,
                "tool_names": [t["function"]["name"] for t in tools] if tools else None,
                "include_reasoning": _flag(body, "include_reasoning", True)}
    ids = ctx.encode(text, "messages", c.add_special)
    if kw["max_tokens"] is None:  # chat without max_tokens: up to the context (as vLLM)
        kw["max_tokens"] = max(1, ctx.max_model_len - len(ids))
    params = _params(kw)
    return Parsed((_check_ids(ids, ctx, "messages", params.max_tokens),), params, c.stream, c.include_usage, c.model,
                  chat=chat, fan=c.fan, grammar_field=grammar_field, text=c.text)
