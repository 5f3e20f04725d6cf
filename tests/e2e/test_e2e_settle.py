"""Prompts given to one `generate` call run in order: a repeated prompt hits deterministically
(settle=True, the default), even with a slow async save; without settling it races the commit."""

import e2e_util as u
from graphgen.runtime import open_engine
from graphgen.runtime.core.faults import Faults


def test_repeated_prompt_hits_even_with_a_slow_async_save(qwen):
    prompt = list(range(10, 27))  # 17 tokens, block size 4: 4 full blocks, lookups stop at (17-1)//4 = 4
    faults = Faults(save_delay_s=0.05)
    with open_engine(u.TINY_QWEN3, qwen.dir, write="async", granularity="layer", faults=faults) as eng:
        first, again = eng.generate([prompt, prompt], max_new_tokens=2)
        assert (first.hit_tokens, again.hit_tokens) == (0, 16)
        assert again.variant == "splitfuse" and again.tokens == first.tokens


def test_without_settling_the_repeat_races_the_in_flight_save(qwen):
    prompt = list(range(30, 47))
    faults = Faults(save_delay_s=0.05)
    with open_engine(u.TINY_QWEN3, qwen.dir, write="async", granularity="layer", faults=faults) as eng:
        first, again = eng.generate([prompt, prompt], max_new_tokens=1, settle=False)
        assert again.hit_tokens == 0  # its blocks were not committed yet: invisible, so recomputed
        assert again.tokens == first.tokens
