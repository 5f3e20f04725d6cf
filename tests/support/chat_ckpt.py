"""A tiny checkpoint trained to answer one fixed chat prompt with a thought and a tool call, in its
family's own format (``graphgen/families/chat.py``): the end-to-end tool-call and reasoning tests
run on real model output, not a stubbed parser.

`train_chat_checkpoint(out, spec_path)`: graphgen's random checkpoint of the spec (vocab 512: the
family's tokenizer and chat template), then Adam on the one sequence (prompt + ``TARGET[family]``,
loss on the answer only; fixed seed) with transformers, saved back with ``save_pretrained``; it
asserts that greedy decoding from the prompt reproduces the answer.
"""

from __future__ import annotations

import dataclasses

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
THOUGHT = "The user wants the weather in Paris."
ARGS = '{"city": "Paris"}'
TARGET = {
    "qwen3_dense": f'<think>\n{THOUGHT}\n</think>\n\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}'
                   f'\n</tool_call><|im_end|>',
    "deepseek_v3": f"{THOUGHT}</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{ARGS}"
                   f"<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
}
# the template switch that opens the thought (DeepSeek-V3.1 thinks only when asked)
TEMPLATE_KWARGS = {"qwen3_dense": {}, "deepseek_v3": {"thinking": True}}


def prompt_ids(tok, family: str) -> list[int]:
    text = tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                   **TEMPLATE_KWARGS[family])
    return tok.encode(text, add_special_tokens=False)


def train_chat_checkpoint(out, spec_path, *, steps: int = 300, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint

    spec = load_spec(spec_path)
    write_random_hf_checkpoint(str(out), spec.family, dataclasses.asdict(spec.dims), seed=seed)
    tok = AutoTokenizer.from_pretrained(str(out))
    prompt = prompt_ids(tok, spec.family)
    target = tok.encode(TARGET[spec.family], add_special_tokens=False)
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: more threads only contend (7 s vs ~100 s seen)
    try:
        return _train(out, spec, tok, prompt, target, steps)
    finally:
        torch.set_num_threads(threads)


def _train(out, spec, tok, prompt, target, steps):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model.train()
    ids = torch.tensor([prompt + target])
    labels = ids.clone()
    labels[0, :len(prompt)] = -100
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 24 and loss.item() < 1e-3:
            break
    model.eval()
    with torch.no_grad():
        got = model.generate(torch.tensor([prompt]), max_new_tokens=len(target), do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert got == target, (f"greedy decoding does not reproduce the target after {step + 1} steps "
                           f"(loss {loss.item():.4g}): {tok.decode(got)!r}")
    model.save_pretrained(str(out))
    return out, spec.family, len(prompt), target
