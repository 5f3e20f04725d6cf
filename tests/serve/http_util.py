"""Plain HTTP (stdlib) for what the openai client hides: raw bodies, status codes, SSE lines."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse


def post(base: str, path: str, body, timeout: float = 60.0, headers=None) -> tuple[int, dict]:
    u = urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        raw = r.read()
        return r.status, (json.loads(raw) if raw else {})
    finally:
        conn.close()


def get(base: str, path: str, timeout: float = 30.0, headers=None) -> tuple[int, str]:
    u = urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def open_stream(base: str, body: dict, timeout: float = 60.0, headers=None):
    """(connection, response) of a streaming completion; read lines with response.readline()."""
    u = urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    conn.request("POST", "/v1/completions", body=json.dumps(dict(body, stream=True)),
                 headers={"Content-Type": "application/json", **(headers or {})})
    return conn, conn.getresponse()


def metrics(base: str) -> dict:
    """{(name, frozenset(labels)): value} from /metrics, parsed by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = get(base, "/metrics")
    assert status == 200
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def metric(base: str, name: str, **labels) -> float:
    return metrics(base)[(name, frozenset(labels.items()))]
