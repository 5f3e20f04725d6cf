"""Client jobs inside the P/D test's network namespace (the servers listen only there):
``python pd_client.py JOBS_JSON`` runs each job in order and prints one JSON line per job;
``python pd_client.py --loop`` stays up and, per line of JOBS_JSON on stdin, prints one line
``@@`` + the JSON list of results (the test's client for quick jobs: no interpreter start each).

Jobs: ``complete`` (the official ``openai`` client: greedy completion, streamed or not, extra body
fields; prints the token ids, ``cached_tokens`` and any ``kv_transfer_params``; ``progress``: a
line once the first chunk came), ``chat`` (greedy
chat, streamed or not: token ids and text), ``post`` / ``get``
(urllib, ``key``: a bearer key; status, body and headers), ``metrics`` (a server's Prometheus samples whose name starts with one of
``prefixes``: ``{"name{labels}": value}``), ``concurrent`` (its ``jobs`` at once, a thread each, started
``stagger_s`` apart: ``{"results": [...]}`` in the jobs' order; ``gate``: ``{"base", "sample", "at_least"}``,
a ``{"gate": value}`` line once that server's Prometheus sample reaches ``at_least``, ``{"gate": null}`` if it
does not within ``within_s``: the caller acts while the jobs run)."""
from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request


def complete(job):
    import openai

    client = openai.OpenAI(base_url=job["base"] + "/v1", api_key=job.get("key", "unused"), timeout=120,
                           max_retries=0)
    kw = dict(model=job.get("model", "tiny_qwen3"), prompt=job["prompt"], max_tokens=job["max_tokens"],
              temperature=0, extra_body=job.get("extra") or None)
    try:
        if not job.get("stream"):
            r = client.completions.create(**kw)
            return {"tokens": r.choices[0].model_extra["token_ids"],
                    "cached": r.usage.prompt_tokens_details.cached_tokens,
                    "kv": (r.model_extra or {}).get("kv_transfer_params")}
        tokens, cached = [], None
        for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
            for c in chunk.choices:
                if job.get("progress") and not tokens:
                    print(json.dumps({"first_chunk": True}), flush=True)  # the caller may act now
                tokens += c.model_extra.get("token_ids") or []
            if chunk.usage is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens
        return {"tokens": tokens, "cached": cached}
    except openai.APIStatusError as e:
        return {"status": e.status_code, "error": e.body}
    except openai.APIError as e:  # an error event in the stream
        return {"error": e.message}


def chat(job):
    import openai

    client = openai.OpenAI(base_url=job["base"] + "/v1", api_key="unused", timeout=120, max_retries=0)
    kw = dict(model="tiny_qwen3", messages=job["messages"], max_tokens=job["max_tokens"], temperature=0)
    if not job.get("stream"):
        r = client.chat.completions.create(**kw)
        return {"tokens": r.choices[0].model_extra["token_ids"], "text": r.choices[0].message.content}
    tokens, text = [], ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            tokens += c.model_extra.get("token_ids") or []
            text += c.delta.content or ""
    return {"tokens": tokens, "text": text}


def http(job):
    data = json.dumps(job["json"]).encode() if "json" in job else None
    headers = {"Content-Type": "application/json"}
    if job.get("key"):
        headers["Authorization"] = f"Bearer {job['key']}"
    req = urllib.request.Request(job["url"], data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


def metrics(job):
    _, text, _ = http({"url": job["base"] + "/metrics"})
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and line.startswith(tuple(job["prefixes"])):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def concurrent(job):
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    gate = job.get("gate")
    if gate:
        def watch():
            end = time.monotonic() + gate.get("within_s", 60)
            while time.monotonic() < end:
                value = metrics({"base": gate["base"], "prefixes": [gate["sample"]]}).get(gate["sample"], 0.0)
                if value >= gate["at_least"]:
                    print(json.dumps({"gate": value}), flush=True)
                    return
                time.sleep(0.02)
            print(json.dumps({"gate": None}), flush=True)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
    with ThreadPoolExecutor(len(job["jobs"])) as pool:
        futures = []
        for j in job["jobs"]:
            futures.append(pool.submit(run, j))
            time.sleep(job.get("stagger_s", 0.0))
        results = [f.result() for f in futures]
    if gate:
        watcher.join()
    return {"results": results}


def run(job) -> dict:
    op = job["op"]
    if op == "complete":
        return complete(job)
    if op == "chat":
        return chat(job)
    if op in ("post", "get"):
        status, body, headers = http(job)
        return {"status": status, "body": body, "headers": headers}
    if op == "metrics":
        return metrics(job)
    if op == "concurrent":
        return concurrent(job)
    raise SystemExit(f"unknown op {op}")


def main() -> int:
    if sys.argv[1] == "--loop":
        for line in sys.stdin:
            print("@@" + json.dumps([run(job) for job in json.loads(line)]), flush=True)
        return 0
    for job in json.loads(sys.argv[1]):
        print(json.dumps(run(job)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
