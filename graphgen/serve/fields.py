"""Every request field of OpenAI's and vLLM's completions and chat APIs, and what this server does
with it: ``supported`` (it works), ``refused`` (a 400 naming it, unless it holds a value that asks
for nothing: ``use_beam_search: false``), ``ignored`` (accepted, with the reason it changes nothing
a client could see). Fields outside both APIs are ignored, as vLLM does.

The lists follow OpenAI's API reference and vLLM's ``CompletionRequest`` / ``ChatCompletionRequest``
(``vllm/entrypoints/openai/{completion,chat_completion}/protocol.py``). `check_refused` is the one
place a refused field is answered; docs/serve.md's field table is `table()`'s output
(``python -m graphgen.serve.fields``), and tests/serve/test_serve_fields.py holds the two to each
other and to the parsers (every supported field is read by them, every field they read is here).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .errors import ApiError

__all__ = ["Field", "FIELDS", "check_refused", "table"]

BOTH, COMPLETIONS, CHAT = ("completions", "chat"), ("completions",), ("chat",)


@dataclass(frozen=True)
class Field:
    name: str
    routes: tuple[str, ...]
    status: str  # supported | refused | ignored
    note: str = ""
    noop: tuple = (None,)  # refused: the values that ask for nothing (accepted)


def _s(name, routes=BOTH, note=""):
    return Field(name, routes, "supported", note)


def _r(name, note, routes=BOTH, noop=(None,)):
    return Field(name, routes, "refused", note, noop)


def _i(name, note, routes=BOTH):
    return Field(name, routes, "ignored", note)


FIELDS = (
    # ---- OpenAI, both routes
    _s("model", note="the served name; another is a 404"),
    _s("max_tokens"), _s("n"), _s("seed"), _s("stop"), _s("stream"), _s("stream_options"),
    _s("temperature"), _s("top_p"), _s("frequency_penalty"), _s("presence_penalty"), _s("logit_bias"),
    _s("logprobs", note="completions: top-k 0..--max-logprobs; chat: a boolean"),
    _i("user", "an end-user id for OpenAI's abuse monitoring; nothing here reads it"),
    # ---- OpenAI, completions
    _s("prompt", COMPLETIONS), _s("echo", COMPLETIONS), _s("best_of", BOTH),
    _r("suffix", "insertion (text after the completion) is not implemented", COMPLETIONS, (None, "")),
    _r("tools", "a chat completions field", COMPLETIONS, (None, False)),
    # ---- OpenAI, chat
    _s("messages", CHAT), _s("max_completion_tokens", CHAT), _s("top_logprobs", CHAT),
    _s("response_format", BOTH, "text, json_object, json_schema"), _s("tools", CHAT), _s("tool_choice", CHAT),
    _s("parallel_tool_calls", CHAT, "false: the output ends with the first call"),
    _s("reasoning_effort", CHAT, "none turns thinking off; the value reaches the template"),
    _r("functions", "deprecated by OpenAI: send tools", CHAT, (None, False)),
    _r("function_call", "deprecated by OpenAI: send tool_choice", CHAT),
    _r("audio", "audio output is not implemented", CHAT),
    _r("modalities", "text is the only output", CHAT, (None, ["text"])),
    _r("web_search_options", "no web search here", CHAT),
    _r("verbosity", "no chat template here reads it", CHAT),
    _i("metadata", "stored-completion tags; nothing is stored", CHAT),
    _i("store", "nothing is stored", CHAT),
    _i("service_tier", "one tier here", CHAT),
    _i("safety_identifier", "an end-user id for OpenAI's abuse monitoring", CHAT),
    _i("prompt_cache_key", "the prefix cache keys blocks by their tokens, whoever sends them", CHAT),
    _i("prompt_cache_retention", "blocks live as long as the pool keeps them", CHAT),
    _i("prediction", "a latency hint only; the output is the same without it", CHAT),
    # ---- vLLM's sampling fields, both routes
    _s("top_k"), _s("min_p"), _s("repetition_penalty"), _s("stop_token_ids"), _s("ignore_eos"),
    _s("min_tokens"), _s("allowed_token_ids"), _s("bad_words"),
    _s("include_stop_str_in_output", note="the stop string stays at the end of the text"),
    _s("skip_special_tokens", note="false: special tokens are text too (EOS included)"),
    _r("use_beam_search", "beam search is not implemented", noop=(None, False)),
    _r("length_penalty", "applies to beam search only", noop=(None, 1, 1.0)),
    _r("spaces_between_special_tokens", "not implemented (special tokens are skipped by default)",
       noop=(None, True)),
    _r("truncate_prompt_tokens", "prompts are never truncated: a long one is a 400"),
    _r("truncation_side", "prompts are never truncated"),
    _r("prompt_logprobs", "send echo with logprobs (completions)"),
    # ---- vLLM's extra fields
    _s("add_special_tokens", note="default false on both routes (vLLM: true on completions)"),
    _s("kv_transfer_params", note="P/D handoff (docs/pd.md)"),
    _s("add_generation_prompt", CHAT), _s("continue_final_message", CHAT), _s("chat_template", CHAT),
    _s("chat_template_kwargs", CHAT), _s("documents", CHAT),
    _s("include_reasoning", CHAT, "false: no reasoning field"),
    _r("echo", "echoing the last message is not implemented", CHAT, (None, False)),
    _r("prompt_embeds", "prompt embeddings are not implemented", COMPLETIONS),
    _r("structured_outputs", "send response_format (or tool_choice)"),
    _r("priority", "no priority scheduling here", noop=(None, 0)),
    _r("return_tokens_as_token_ids", "not implemented", noop=(None, False)),
    _r("return_prompt_text", "not implemented", CHAT, (None, False)),
    _r("cache_salt", "the prefix cache is not salted per tenant"),
    _r("ec_transfer_params", "no encoder-cache disaggregation"),
    _r("vllm_xargs", "no custom extensions", noop=(None, {})),
    _r("repetition_detection", "not implemented"),
    _r("thinking_token_budget", "not implemented", noop=(None, -1)),
    _r("media_io_kwargs", "no multimodal input", CHAT, (None, {})),
    _r("mm_processor_kwargs", "no multimodal input", CHAT, (None, {})),
    _i("request_id", "the server names its requests; the response id is its own"),
    _i("return_token_ids", "every choice carries token_ids anyway"),
    _i("return_token_offsets", "vLLM honours it on /render only"),
    _i("return_assistant_tokens_mask", "vLLM honours it on /render only", CHAT),
)


def fields_of(route: str) -> dict[str, Field]:
    return {f.name: f for f in FIELDS if route in f.routes}


_REFUSED = {r: [f for f in fields_of(r).values() if f.status == "refused"] for r in ("completions", "chat")}


def _same(v, ok) -> bool:
    if isinstance(v, bool) or isinstance(ok, bool):  # false is not 0, true is not 1
        return v is ok
    return v == ok


def check_refused(body: dict, route: str) -> None:
    """A 400 naming the first refused field ``body`` sets to something that asks for more than nothing."""
    for f in _REFUSED[route]:
        v = body.get(f.name)
        if v is not None and not any(_same(v, ok) for ok in f.noop):
            raise ApiError(f"'{f.name}' is not supported: {f.note}"[:300], param=f.name, code="unsupported_value")


def table() -> str:
    """docs/serve.md's field table (markdown)."""
    rows = ["| field | completions | chat | notes |", "|---|---|---|---|"]
    names = sorted({f.name for f in FIELDS})
    for name in names:
        cells = []
        notes = []
        for route in ("completions", "chat"):
            f = fields_of(route).get(name)
            cells.append(f.status if f else "—")
            if f and f.note:
                extra = "" if f.status != "refused" or f.noop == (None,) else \
                    f" (accepted: {', '.join(json.dumps(v) for v in f.noop if v is not None)})"
                if f.note + extra not in notes:
                    notes.append(f.note + extra)
        rows.append(f"| `{name}` | {cells[0]} | {cells[1]} | {'; '.join(notes)} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
