"""Issue 16 items 1-2 through the official ``openai`` client, streamed and not: logprobs (values
checked against transformers' log-softmax on the same checkpoint), echo with prompt logprobs,
``max_tokens: 0``, ``n`` / ``best_of``, penalties (repetition: against transformers' ``generate``),
``logit_bias``, ``min_tokens``, more than four stop strings, and a sweep of extreme values batched
with a plain request whose tokens must not change. One server for the module (conftest)."""

from __future__ import annotations

import concurrent.futures as cf
import math
import time

import pytest

M = "tiny_qwen3"
PROMPT = [5, 17, 33, 2, 9, 100, 41, 7, 8, 9]


@pytest.fixture(scope="module")
def hf(ckpt):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()


def _logsoftmax(hf, ids):
    import torch

    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def _ids(choice):
    return list(choice.model_extra["token_ids"])


def test_completion_logprobs_echo_equal_transformers(server, hf):
    c = server.client()
    r = c.completions.create(model=M, prompt=PROMPT, max_tokens=3, logprobs=3, echo=True, temperature=0)
    ch = r.choices[0]
    gen = _ids(ch)
    lp = _logsoftmax(hf, PROMPT + gen)
    seq = PROMPT + gen
    got = ch.logprobs.token_logprobs
    assert len(got) == len(seq) and got[0] is None and ch.logprobs.top_logprobs[0] is None
    for j in range(1, len(seq)):
        assert abs(got[j] - float(lp[j - 1, seq[j]])) < 1e-4, j
        top = ch.logprobs.top_logprobs[j]
        assert 1 <= len(top) <= 4  # the top 3 and the chosen token (keyed by text: byte tokens may collide)
        assert abs(max(top.values()) - float(lp[j - 1].max())) < 1e-4
    for j in range(len(PROMPT), len(seq)):  # greedy: the chosen token is the top one
        assert seq[j] == int(lp[j - 1].argmax())
    offs = ch.logprobs.text_offset
    assert offs[0] == 0 and offs == sorted(offs)
    # streamed: the same tokens and values, the prompt's in the first chunk
    chunks = list(c.completions.create(model=M, prompt=PROMPT, max_tokens=3, logprobs=3, echo=True,
                                       temperature=0, stream=True))
    streamed = [v for k in chunks if k.choices and k.choices[0].logprobs
                for v in k.choices[0].logprobs.token_logprobs]
    assert len(streamed) == len(got) and streamed[0] is None
    assert all(abs(a - b) < 1e-4 for a, b in zip(streamed[1:], got[1:]))
    assert "".join(k.choices[0].text for k in chunks if k.choices) == ch.text


def test_max_tokens_zero_with_echo_and_logprobs_zero(server, hf):
    c = server.client()
    r = c.completions.create(model=M, prompt=PROMPT, max_tokens=0, logprobs=1, echo=True, temperature=0)
    ch = r.choices[0]
    assert _ids(ch) == [] and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(PROMPT)
    assert len(ch.logprobs.token_logprobs) == len(PROMPT)
    lp = _logsoftmax(hf, PROMPT)
    assert abs(ch.logprobs.token_logprobs[-1] - float(lp[-2, PROMPT[-1]])) < 1e-4
    with pytest.raises(Exception) as e:  # without echo, max_tokens 0 is still refused
        c.completions.create(model=M, prompt=PROMPT, max_tokens=0)
    assert getattr(e.value, "status_code", None) == 400
    r = c.completions.create(model=M, prompt=PROMPT, max_tokens=2, logprobs=0, temperature=0)
    lps = r.choices[0].logprobs
    assert lps is not None and len(lps.token_logprobs) == 2 and all(len(t) == 1 for t in lps.top_logprobs)
    with pytest.raises(Exception) as e:  # over --max-logprobs (20)
        c.completions.create(model=M, prompt=PROMPT, max_tokens=1, logprobs=21)
    assert getattr(e.value, "status_code", None) == 400


def test_chat_logprobs_streamed_equal_non_streamed(server):
    c = server.client()
    kw = dict(model=M, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
              logprobs=True, top_logprobs=2)
    r = c.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == len(_ids(r.choices[0])) and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= 0 and t.bytes == list(t.token.encode()) for t in content)
    streamed = [t for k in c.chat.completions.create(stream=True, **kw) if k.choices and k.choices[0].logprobs
                for t in k.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    # the second request's prompt hits the pool (another variant): equal up to float32 rounding
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content))


def test_n4_runs_one_prefill_and_the_copies_share_its_blocks(server):
    """The copies of an ``n`` request fork the first (one prefill of the prompt, tails per copy):
    the server's counters move by one prefill and three forks, and every block comes back."""
    from http_util import metric

    c = server.client()
    before = {k: metric(server.base, f"graphgen_{k}_total") for k in ("prefills", "forked_requests")}
    free = metric(server.base, "graphgen_kv_blocks_free")
    r = c.completions.create(model=M, prompt=PROMPT * 2, max_tokens=5, n=4, temperature=1.0, seed=3)
    assert len(r.choices) == 4 and len({tuple(_ids(ch)) for ch in r.choices}) > 1  # each copy its own draws
    assert metric(server.base, "graphgen_prefills_total") == before["prefills"] + 1
    assert metric(server.base, "graphgen_forked_requests_total") == before["forked_requests"] + 3
    alone = c.completions.create(model=M, prompt=PROMPT * 2, max_tokens=5, temperature=1.0, seed=3 + 2)
    assert _ids(r.choices[2]) == _ids(alone.choices[0])  # copy j draws with seed + j, forked or not
    deadline = time.monotonic() + 10  # the gauge is refreshed after the step that finished it
    while metric(server.base, "graphgen_kv_blocks_free") != free and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server.base, "graphgen_kv_blocks_free") == free


def test_n_and_best_of(server):
    c = server.client()
    r = c.completions.create(model=M, prompt="hello world", max_tokens=6, n=3, temperature=1.0, seed=7,
                             logprobs=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(len(_ids(ch)) for ch in r.choices)
    one = c.completions.create(model=M, prompt="hello world", max_tokens=6, temperature=1.0, seed=7)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert _ids(r.choices[0]) == _ids(one.choices[0])  # copy 0 draws with the request's seed
    cum = [sum(ch.logprobs.token_logprobs) for ch in r.choices]
    best = c.completions.create(model=M, prompt="hello world", max_tokens=6, n=1, best_of=3, temperature=1.0,
                                seed=7)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert _ids(best.choices[0]) == _ids(r.choices[cum.index(max(cum))])
    streamed = list(c.completions.create(model=M, prompt="hello world", max_tokens=3, n=2, temperature=1.0,
                                         seed=7, stream=True))
    assert {k.choices[0].index for k in streamed if k.choices} == {0, 1}
    with pytest.raises(Exception) as e:
        c.completions.create(model=M, prompt="hi", max_tokens=2, n=1, best_of=2, stream=True)
    assert getattr(e.value, "status_code", None) == 400


def test_repetition_penalty_equals_transformers_generate(server, hf):
    import torch

    want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, repetition_penalty=1.7,
                       attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))[0, len(PROMPT):].tolist()
    r = server.client().completions.create(model=M, prompt=PROMPT, max_tokens=8, temperature=0,
                                           extra_body={"repetition_penalty": 1.7, "ignore_eos": True})
    assert _ids(r.choices[0]) == want


def test_bias_min_tokens_penalties_and_stops(server, hf):
    c = server.client()
    plain = _ids(c.completions.create(model=M, prompt=PROMPT, max_tokens=4, temperature=0).choices[0])
    forced = c.completions.create(model=M, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={"11": 100})
    assert _ids(forced.choices[0]) == [11, 11, 11]
    banned = c.completions.create(model=M, prompt=PROMPT, max_tokens=1, temperature=0,
                                  logit_bias={str(plain[0]): -100})
    assert _ids(banned.choices[0])[0] != plain[0]
    # the greedy first token as a stop token: min_tokens masks it until two tokens are out
    m = c.completions.create(model=M, prompt=PROMPT, max_tokens=4, temperature=0,
                             extra_body={"stop_token_ids": [plain[0]], "min_tokens": 2})
    assert len(_ids(m.choices[0])) >= 2 and _ids(m.choices[0])[0] != plain[0]
    # bias, frequency and presence penalties against OpenAI's formula on transformers' logits
    fp = c.completions.create(model=M, prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={"11": 3},
                              frequency_penalty=1.5, presence_penalty=0.5, extra_body={"ignore_eos": True})
    import torch

    gen = []
    for _ in range(5):
        with torch.no_grad():
            row = hf(torch.tensor([PROMPT + gen])).logits[0, -1].float()
        row[11] += 3
        for t in set(gen):
            row[t] -= 1.5 * gen.count(t) + 0.5
        gen.append(int(row.argmax()))
    assert _ids(fp.choices[0]) == gen and 11 in gen
    stops = ["x1", "x2", "x3", "x4", "x5", "x6"]
    r = c.completions.create(model=M, prompt=PROMPT, max_tokens=4, temperature=0, stop=stops)
    assert r.choices[0].finish_reason in ("stop", "length")
    allowed = c.completions.create(model=M, prompt=PROMPT, max_tokens=3, temperature=0.8, seed=1,
                                   extra_body={"allowed_token_ids": [20, 21]})
    assert set(_ids(allowed.choices[0])) <= {20, 21}


EXTREMES = [
    dict(temperature=100, presence_penalty=2, frequency_penalty=2, extra_body={"repetition_penalty": 100}),
    dict(temperature=1e-5, presence_penalty=-2, frequency_penalty=-2, extra_body={"repetition_penalty": 0.01}),
    dict(temperature=0, logit_bias={str(t): -100 for t in range(64)}, top_p=1e-9),
    dict(temperature=1, logit_bias={"3": 100, "4": -100}, extra_body={"min_tokens": 6, "top_k": 1,
                                                                       "allowed_token_ids": [3]}),
    dict(temperature=0.7, extra_body={"allowed_token_ids": [1], "bad_words": ["\u0001"]}),
]


def test_extremes_stay_their_own(server):
    c = server.client()
    alone = _ids(c.completions.create(model=M, prompt=PROMPT, max_tokens=6, temperature=0).choices[0])

    def one(kw):
        return c.completions.create(model=M, prompt=PROMPT, max_tokens=6, logprobs=2, seed=3, **kw)

    with cf.ThreadPoolExecutor(len(EXTREMES) + 1) as ex:
        futs = [ex.submit(one, kw) for kw in EXTREMES]
        plain = ex.submit(lambda: c.completions.create(model=M, prompt=PROMPT, max_tokens=6, temperature=0))
        assert _ids(plain.result(120).choices[0]) == alone
        for f in futs:
            ch = f.result(120).choices[0]
            assert len(_ids(ch)) == 6
            assert all(math.isfinite(v) for v in ch.logprobs.token_logprobs)
