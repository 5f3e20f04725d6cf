"""The official ``openai`` client in a process of its own (run inside the Mooncake tests' private
network namespace, where the servers listen): ``python ns_client.py BASE_URL PROMPTS_JSON MAX_TOKENS``
sends each prompt (greedy, one after another) and prints one JSON line per reply: the generated
token ids and ``usage.prompt_tokens_details.cached_tokens``."""
from __future__ import annotations

import json
import sys


def main() -> int:
    import openai

    base, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    for p in prompts:
        r = client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0)
        print(json.dumps({"tokens": r.choices[0].model_extra["token_ids"],
                          "cached": r.usage.prompt_tokens_details.cached_tokens}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
