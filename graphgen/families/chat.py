"""Each family's chat format: the special tokens of its real tokenizer, its chat template (tools,
assistant ``tool_calls``, ``tool`` messages, thinking) and the names of its tool-call and reasoning
parsers (``graphgen serve`` implements them in ``serve/tools.py`` and ``serve/reasoning.py``).

One table keyed by family (``CHAT``), read by the random checkpoints' tokenizer writer
(``runtime/checkpoint/tokenizer.py``) and by ``graphgen serve`` (through the names only: the
server's table of parsers is keyed by these strings). No torch, no transformers.

Sources: Qwen3's tokenizer_config.json (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``; the
non-special text tokens ``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>``,
``<tool_response>``, ``</tool_response>``; EOS ``<|im_end|>``) and its hermes-style tool format;
DeepSeek-V3.1's tokenizer (``<｜begin▁of▁sentence｜>`` BOS, ``<｜end▁of▁sentence｜>`` EOS,
``<｜User｜>``, ``<｜Assistant｜>``, ``<think>``/``</think>``, the tool-call tokens) and its tool format
``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜><｜tool▁calls▁end｜>``
(as vLLM's ``deepseekv31_tool_parser.py`` reads it). The templates here are shortened versions of the
real ones with the same token layout. (transformers renders templates with ``trim_blocks``, which eats
a newline right after a block tag: such newlines are written ``{{ '\\n' }}``.)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ChatFormat", "CHAT", "chat_format"]


@dataclass(frozen=True)
class ChatFormat:
    specials: tuple[str, ...]  # control tokens (skipped when detokenizing), ids 0.. in this order
    text_tokens: tuple[str, ...]  # single tokens that stay text when detokenizing (parsers read them)
    bos: str | None
    eos: tuple[str, ...]  # the first is the tokenizer's eos_token; all stop generation
    chat_template: str
    tool_parser: str  # serve/tools.py PARSERS key
    reasoning_parser: str  # serve/reasoning.py PARSERS key


_QWEN3_TEMPLATE = (
    "{% set ns = namespace(start=0) %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% set ns.start = 1 %}{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages[ns.start:] %}"
    "{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.get('reasoning_content') %}<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{{ m['content'] or '' }}"
    "{% for tc in m.get('tool_calls') or [] %}{% set f = tc['function'] if tc.get('function') else tc %}"
    "{% if not loop.first or m['content'] %}{{ '\\n' }}{% endif %}<tool_call>\n{\"name\": \"{{ f['name'] }}\", "
    "\"arguments\": {{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[ns.start + loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[ns.start + loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")

_DSV31_TEMPLATE = (
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = ns.system + m['content'] %}"
    "{% endif %}{% endfor %}"
    "<｜begin▁of▁sentence｜>{{ ns.system }}"
    "{% if tools %}{{ '\\n' }}\n## Tools\nYou have access to the following tools:\n\n"
    "{% for t in tools %}### {{ t['function']['name'] }}\nDescription: {{ t['function'].get('description', '') }}"
    "\n\nParameters: {{ t['function'].get('parameters', {}) | tojson }}\n\n{% endfor %}"
    "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
    "tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜></think>{{ m['content'] or '' }}"
    "{% if m.get('tool_calls') %}<｜tool▁calls▁begin｜>"
    "{% for tc in m['tool_calls'] %}{% set f = tc['function'] if tc.get('function') else tc %}"
    "<｜tool▁call▁begin｜>{{ f['name'] }}<｜tool▁sep｜>"
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}<｜tool▁call▁end｜>"
    "{% endfor %}<｜tool▁calls▁end｜>{% endif %}<｜end▁of▁sentence｜>"
    "{% elif m['role'] == 'tool' %}<｜tool▁output▁begin｜>{{ m['content'] }}<｜tool▁output▁end｜>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>"
    "{% if thinking is defined and thinking %}<think>{% else %}</think>{% endif %}{% endif %}")

CHAT: dict[str, ChatFormat] = {
    "qwen3_dense": ChatFormat(
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        text_tokens=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        bos=None, eos=("<|im_end|>", "<|endoftext|>"), chat_template=_QWEN3_TEMPLATE,
        tool_parser="hermes", reasoning_parser="qwen3"),
    "deepseek_v3": ChatFormat(
        specials=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
        text_tokens=("<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                     "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
                     "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
        bos="<｜begin▁of▁sentence｜>", eos=("<｜end▁of▁sentence｜>",), chat_template=_DSV31_TEMPLATE,
        tool_parser="deepseek_v31", reasoning_parser="deepseek_r1"),
}


def chat_format(family: str) -> ChatFormat | None:
    return CHAT.get(family)
