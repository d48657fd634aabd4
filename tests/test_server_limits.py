"""What one request may ask for (kvserve/server/limits.py): each limit a 400 that names the field,
the limit and its flag; raised limits let the same request through; a body failing validation a
thousand times gets a short message; the limits' own settings are checked."""
from __future__ import annotations

import httpx
import pytest

from kvserve.loading import load_model
from kvserve.server.limits import DEFAULT_MAX_N, RequestLimits
from tests.server_harness import live_server, make_engine
from tests.tiny_models import make_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_limits")
    make_model("llama", folder)
    return load_model(folder)


def _post(limits: RequestLimits | None, tiny, body: dict) -> httpx.Response:
    with live_server(make_engine(tiny, kv_cache_gib=0.01), "tiny", limits=limits) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        resp = http.post("/v1/completions", json={"model": "tiny", "prompt": "The quick", "max_tokens": 2, **body})
        assert srv.state.engine.engine.block_manager.num_free_blocks == srv.state.engine.engine.num_blocks
        return resp


def test_each_limit_names_its_field_limit_and_flag(tiny):
    cases = [({"n": DEFAULT_MAX_N + 1}, "n", "--max-n"),
             ({"stop": ["x"] * 17}, "stop", "--max-stop"),
             ({"stop": ["x" * 257]}, "stop[0]", "--max-stop-chars"),
             ({"stop_token_ids": [1] * 257}, "stop_token_ids", "--max-stop-token-ids")]
    with live_server(make_engine(tiny, kv_cache_gib=0.01), "tiny") as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        for extra, param, flag in cases:
            resp = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, **extra})
            err = resp.json()["error"]
            assert resp.status_code == 400 and err["param"] == param and err["code"] == "limit_exceeded", err
            assert flag in err["message"], err
        deep = b'{"model": "tiny", "prompt": "x", "user": ' + b"[" * 33 + b"]" * 33 + b"}"
        resp = http.post("/v1/completions", content=deep, headers={"Content-Type": "application/json"})
        assert resp.status_code == 400 and "--max-json-depth" in resp.json()["error"]["message"]


def test_raised_limits_let_the_request_through(tiny):
    limits = RequestLimits(max_n=32, max_stop=40, max_stop_token_ids=300)
    resp = _post(limits, tiny, {"n": 20, "stop": ["zz"] * 40, "stop_token_ids": [3] * 300})
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 20


def test_a_thousand_validation_errors_give_a_short_message(tiny):
    resp = _post(None, tiny, {"stop": [0] * 12000})  # every element the wrong type
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["param"].startswith("stop")
    assert len(err["message"]) < 1000 and "further errors not shown" in err["message"]


@pytest.mark.parametrize("kwargs,flag", [({"max_n": 0}, "--max-n"), ({"max_n": 129}, "--max-n"),
                                         ({"max_stop": -1}, "--max-stop"), ({"max_json_depth": True}, "--max-json-depth"),
                                         ({"max_stop_chars": 1.5}, "--max-stop-chars")])
def test_limit_settings_are_checked(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        RequestLimits(**kwargs)


def test_sequences_per_request_are_counted_before_tokenizing(tiny):
    with live_server(make_engine(tiny, kv_cache_gib=0.01), "tiny", max_queue=300) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        # 64 prompts x n 8 = 512 sequences: past --max-request-seqs (256) -> 400, not a retryable 429
        body = {"model": "tiny", "prompt": ["a"] * 64, "n": 8, "max_tokens": 1}
        err = http.post("/v1/completions", json=body).json()["error"]
        assert err["param"] == "prompt" and "--max-request-seqs" in err["message"]
    limits = RequestLimits(max_request_seqs=4096)
    with live_server(make_engine(tiny, kv_cache_gib=0.01), "tiny", max_queue=1024, limits=limits) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        # 1,025 prompts can never fit a queue of 1,024: a 400 naming --max-queue
        resp = http.post("/v1/completions", json={"model": "tiny", "prompt": ["a"] * 1025, "max_tokens": 1})
        assert resp.status_code == 400 and "--max-queue" in resp.json()["error"]["message"]
        assert srv.state.engine.num_waiting == 0


def test_a_request_without_max_tokens_gets_the_server_default(tiny):
    limits = RequestLimits(max_tokens_default=3)
    with live_server(make_engine(tiny, kv_cache_gib=0.01), "tiny", limits=limits) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                       "ignore_eos": True}).json()
        assert chat["usage"]["completion_tokens"] == 3 and chat["choices"][0]["finish_reason"] == "length"
        comp = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": None,
                                                  "ignore_eos": True}).json()
        assert comp["usage"]["completion_tokens"] == 3
        asked = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 5,
                                                   "ignore_eos": True}).json()
        assert asked["usage"]["completion_tokens"] == 5  # a request's own cap is its own


def test_metrics_behind_the_key_when_asked(tiny):
    with live_server(make_engine(tiny, kv_cache_gib=0.01), "tiny", api_key="k", protect_metrics=True) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as http:
        for path in ("/metrics", "/stats"):
            assert http.get(path).status_code == 401
            assert http.get(path, headers={"Authorization": "Bearer k"}).status_code == 200
        assert http.get("/health").status_code == 200  # probes carry no key
    with pytest.raises(ValueError, match="--protect-metrics needs an API key"):
        live_server(make_engine(tiny, kv_cache_gib=0.01), "tiny", protect_metrics=True).__enter__()


def test_only_allowed_hosts_are_answered(tiny):
    """--allowed-hosts: a page elsewhere whose name resolves to this address (DNS rebinding)
    sends its own Host header and gets 400."""
    with live_server(make_engine(tiny, kv_cache_gib=0.01), "tiny", allowed_hosts=["localhost", "127.0.0.1"]) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as http:
        assert http.get("/v1/models").status_code == 200  # Host: 127.0.0.1:port
        assert http.get("/v1/models", headers={"Host": "localhost"}).status_code == 200
        assert http.get("/v1/models", headers={"Host": "attacker.example"}).status_code == 400
        assert http.post("/v1/completions", headers={"Host": "attacker.example"},
                         json={"model": "tiny", "prompt": "x", "max_tokens": 1}).status_code == 400


def test_cache_salt_keeps_prefixes_apart(tiny):
    """Requests share cached prefixes only with the same `cache_salt` (none counts as its own)."""
    prompt = list(range(3, 3 + 64))  # four full 16-token blocks
    with live_server(make_engine(tiny, kv_cache_gib=0.01), "tiny") as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as http:
        def hits(salt):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
            if salt is not None:
                body["cache_salt"] = salt
            before = http.get("/stats").json()["prefix_cache_hits"]
            assert http.post("/v1/completions", json=body).status_code == 200
            return http.get("/stats").json()["prefix_cache_hits"] - before

        assert hits("alice") == 0
        assert hits("bob") == 0  # same tokens, another tenant: no hit
        assert hits(None) == 0
        assert hits("alice") > 0 and hits(None) > 0
        bad = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "cache_salt": ""})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_a_client_leaving_mid_upload_is_a_disconnect_not_an_error(tiny, caplog):
    import logging
    import socket
    import time

    with live_server(make_engine(tiny, kv_cache_gib=0.01), "tiny") as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        with caplog.at_level(logging.INFO):
            s = socket.create_connection((host, int(port)))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
            time.sleep(0.3)
            s.close()  # 10 of 1000 bytes sent
            time.sleep(0.5)
        assert httpx.get(srv.url + "/health").status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert any("disconnected while sending its request body" in r.getMessage() for r in caplog.records)


def test_uvicorn_settings():
    from kvserve.server.launch import ServeOptions, uvicorn_config

    config = uvicorn_config(object(), ServeOptions(max_connections=7))
    assert config.limit_concurrency == 7 and config.timeout_keep_alive == 5
    assert config.h11_max_incomplete_event_size == 16 * 1024


def test_a_slowloris_client_is_cut_off(tiny):
    """--header-timeout: headers trickled a byte at a time (each byte would reset uvicorn's
    keep-alive timer) close the connection once the deadline passes; on a fresh connection and
    on a kept-alive one after a first request. Other clients are served meanwhile."""
    import socket
    import time

    from kvserve.server.launch import ServeOptions

    def trickle(s: socket.socket, limit: float) -> float:
        """Send a header a byte at a time until the server closes; seconds it took."""
        t0 = time.monotonic()
        s.settimeout(0.05)
        for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000:
            try:
                s.sendall(bytes([b]))
                if s.recv(1) == b"":
                    break
            except TimeoutError:
                pass
            except OSError:
                break
            if time.monotonic() - t0 > limit:
                raise AssertionError("the slow client was never cut off")
            time.sleep(0.05)
        return time.monotonic() - t0

    opts = ServeOptions(log_level="warning", header_timeout=1.0)
    with live_server(make_engine(tiny, kv_cache_gib=0.01), "tiny", options=opts) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            assert 0.8 < trickle(s, 6) < 4
        assert httpx.get(srv.url + "/health").status_code == 200
        with socket.create_connection((host, int(port))) as s:  # kept alive after one request
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            assert 0.8 < trickle(s, 6) < 4


def test_a_trickled_body_gets_408(tiny):
    import socket
    import time

    with live_server(make_engine(tiny, kv_cache_gib=0.01), "tiny", body_timeout=1.0) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: 500\r\n\r\n".encode())
            t0 = time.monotonic()
            answer = b""
            s.settimeout(0.2)
            while time.monotonic() - t0 < 6 and b"\r\n\r\n" not in answer:
                try:
                    s.sendall(b" ")  # a byte of body at a time
                    answer += s.recv(4096)
                except TimeoutError:
                    pass
                except OSError:
                    break
                time.sleep(0.1)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert 0.8 < time.monotonic() - t0 < 4
        assert srv.wait_pool_full(5)


def test_the_body_timeout_does_not_cut_a_long_generation(tiny):
    """After the body is in, the handler's wait for a disconnect is not timed: a non-streaming
    request that generates for longer than --body-timeout still gets its answer."""
    import time

    engine = make_engine(tiny, kv_cache_gib=0.01)
    step = engine.step

    def slow():
        time.sleep(0.02)
        return step()

    engine.step = slow
    with live_server(engine, "tiny", body_timeout=0.3) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        resp = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 40, "ignore_eos": True})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 40


def test_large_bodies_and_long_conversations_are_handled_off_the_event_loop(tiny, monkeypatch):
    """Parsing a large body and rendering a long conversation run in worker threads, so they do
    not stall other clients; small ones stay on the loop (a thread hop costs more than they do)."""
    import threading

    from kvserve.server import body, chat

    threads: dict[str, set[str]] = {"parse": set(), "render": set()}
    parse, render = body._parse, chat.render_messages

    def parse_where(*a):
        threads["parse"].add(threading.current_thread().name)
        return parse(*a)

    def render_where(*a):
        threads["render"].add(threading.current_thread().name)
        return render(*a)

    monkeypatch.setattr(body, "_parse", parse_where)
    monkeypatch.setattr(chat, "render_messages", render_where)
    with live_server(make_engine(tiny, kv_cache_gib=0.01, max_model_len=512), "tiny", max_body_bytes=1 << 20) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        loop_thread = srv._thread.name
        assert http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}).status_code == 200
        assert threads["parse"] == {loop_thread}
        big = {"model": "tiny", "prompt": "x", "max_tokens": 1, "user": "u" * (100 * 1024)}
        assert http.post("/v1/completions", json=big).status_code == 200
        assert len(threads["parse"] - {loop_thread}) == 1
        long_chat = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}] * 100}
        http.post("/v1/chat/completions", json=long_chat)  # past the context or not: rendered either way
        assert threads["render"] - {loop_thread}
