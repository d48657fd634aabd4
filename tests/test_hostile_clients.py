"""The hostile-client suite (kvserve/tools/bench/hostile.py) against a live server on 127.0.0.1.

Passes when no answer is a 5xx (or missing), no attacker hangs, the process's RSS stays under a
stated bound, /health always answers within 1 s, normal traffic keeps being served, and
afterwards the greedy output of a fixed prompt is unchanged, nothing is running or waiting and
the whole KV pool is free."""
from __future__ import annotations

import httpx
import pytest

from kvserve.loading import load_model
from kvserve.tools.bench.hostile import C, json_attacks, raw_attacks, run_attack
from tests.server_harness import live_server, make_engine
from tests.tiny_models import make_model

pytestmark = pytest.mark.slow
RSS_BOUND_MB = 400  # over the RSS before the attack, for everything the attack may make the server hold
HEALTH_BOUND_S = 1.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    make_model("llama", folder)
    return load_model(folder)


def test_the_suite_is_what_it_says():
    assert len(json_attacks()) + len(raw_attacks("127.0.0.1", 1)) >= 60


def test_hostile_clients(tiny):
    engine = make_engine(tiny, kv_cache_gib=0.05, max_num_seqs=32)
    with live_server(engine, "tiny", max_body_bytes=1 << 20) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        fixed = {"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0}
        reference = http.post(C, json=fixed).json()["choices"][0]["text"]
        r = run_attack(srv.url)  # this process: the server runs in one of its threads
        print(f"\nhostile suite: {r.statuses}; RSS {r.rss_before_mb:.0f} -> peak {r.rss_peak_mb:.0f} MB; "
              f"/health max {r.health_max_s:.3f} s; normal p99 {r.normal_p99_s:.3f} s")
        assert not r.server_errors, r.server_errors
        assert sum(r.statuses.values()) >= 60 + 64
        assert r.rss_peak_mb - r.rss_before_mb < RSS_BOUND_MB
        assert r.health_failures == 0 and r.health_max_s < HEALTH_BOUND_S and r.health_probes > 10
        assert r.normal_requests > 10 and r.normal_failures == 0
        assert srv.wait_pool_full(30), srv.state.engine.stats()
        assert http.post(C, json=fixed).json()["choices"][0]["text"] == reference
        assert srv.pool_is_full()


def test_an_unknown_pid_is_named(capsys):
    from kvserve.cli import main

    assert main(["bench", "hostile", "--pid", "999999999"]) == 2
    assert "--pid 999999999: no such process" in capsys.readouterr().err
