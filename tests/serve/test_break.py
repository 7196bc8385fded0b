"""A hostile crowd at once: 48 concurrent clients sending garbage, malformed and out-of-range requests,
oversized bodies and headers, bodies cut off mid-way, and streams they walk away from, among good
requests. The server answers each with a status (never a 500), stays up, frees every row, and its
greedy answers afterwards are bit for bit what the model gives alone (loopback only, bounded)."""

import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.serve.test_http import Server

ASKS = [("the cat sat", 24), ("once upon a", 30), ("tell me", 16)]
MALFORMED = [b"{not json", b"[1, 2]", b"[" * 50000 + b"]" * 50000, b"\xff\xfe{}", b'{"prompt": "x\\ud800y"}',
             json.dumps({"prompt": "a", "max_tokens": "ten"}).encode(), json.dumps({"prompt": [-1]}).encode(),
             json.dumps({"prompt": "a", "temperature": -1, "n": 10**9}).encode(),
             json.dumps({"prompt": [[1, 2], [2**63]], "max_tokens": 2}).encode(),
             json.dumps({"prompt": "a", "logprobs": 10**6, "stream": True}).encode(),
             json.dumps({"messages": "hi"}).encode(), json.dumps({"messages": [{"role": "tool", "content": 5}]}).encode()]


@pytest.fixture(scope="module")
def server():
    s = Server(max_batch_size=4)
    yield s
    s.close()


def _raw(server, data: bytes, read: bool = True) -> bytes:
    """Send ``data`` on a socket of its own and read what comes back (the server may close it)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        if not read:
            return b""
        try:
            return s.recv(65536)
        except OSError:
            return b""


def _hostile(server, kind: int, rng: random.Random):
    """One client's misbehaviour: returns the HTTP status it got (None where it left or no HTTP came back)."""
    url = server.url + ("/v1/chat/completions" if kind % 2 else "/v1/completions")
    if kind == 0:
        _raw(server, b"GARBAGE \x00\xff\r\n\r\n")
        return None
    if kind == 1:  # a body announced whole, cut off mid-way
        _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 5000\r\n\r\n{\"prompt\": \"ab", read=False)
        return None
    if kind == 2:  # a header of 200 KB
        reply = _raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n")
        return int(reply.split()[1]) if reply.startswith(b"HTTP/1.1 ") else None
    if kind == 3:  # a body over the size limit
        return httpx.post(url, content=b'{"prompt": "' + b"a" * (3 << 20) + b'"}',
                          headers={"Content-Type": "application/json"}, timeout=30).status_code
    if kind == 4:  # a stream left after its first chunk
        with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                          json={"prompt": "once", "max_tokens": 60, "stream": True}) as r:
            if r.status_code == 200:
                next(r.iter_lines())
            return r.status_code
    if kind == 5:  # a client that gives up waiting
        try:
            return httpx.post(server.url + "/v1/completions", json={"prompt": "more", "max_tokens": 60},
                              timeout=0.05).status_code
        except httpx.TimeoutException:
            return None
    if kind == 6:  # a good greedy request among them
        prompt, n = ASKS[rng.randrange(len(ASKS))]
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0},
                       timeout=60)
        if r.status_code == 200:  # answered among the crowd: what the model gives alone
            choice = r.json()["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == server.alone(prompt, n, temperature=0)[:2]
        return r.status_code
    body = MALFORMED[rng.randrange(len(MALFORMED))]
    r = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code in (400, 404, 429) and set(r.json()["error"]) == {"message", "type", "param", "code"}
    return r.status_code


def test_a_hostile_crowd_leaves_the_server_up_and_its_greedy_answers_unchanged(server):
    alone = [server.alone(prompt, n, temperature=0) for prompt, n in ASKS]
    rng = random.Random(0)
    kinds = [i % 9 for i in range(48)]
    rng.shuffle(kinds)
    with ThreadPoolExecutor(48) as pool:
        statuses = list(pool.map(lambda k: _hostile(server, k, random.Random(k)), kinds))
    assert not [s for s in statuses if s is not None and s >= 500 and s != 503], statuses
    assert {200, 400, 413} <= set(statuses)  # the crowd was served, refused and cut short
    # every row and handler is freed, /health answers, and greedy answers are the model's alone
    deadline = time.time() + 30
    while (server.engine.running or server.server.server_state.tasks) and time.time() < deadline:
        time.sleep(0.05)
    assert server.engine.running == 0 and not server.server.server_state.tasks
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    after = []
    for prompt, n in ASKS:
        out = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0)
        after.append((out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens))
    assert after == alone
