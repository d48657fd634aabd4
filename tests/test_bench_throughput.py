"""`kvserve bench throughput`: the sampling setting reaches every request, and HF gets the same."""
from __future__ import annotations

import pytest

import kvserve.cli as cli
from kvserve.tools.bench.throughput import Sampling, Workload, run_kvserve


def test_flags_parse_into_one_setting() -> None:
    args = cli.build_parser().parse_args(["bench", "throughput", "--temperature", "0.8", "--top-p", "0.95",
                                          "--top-k", "40", "--min-p", "0.05"])
    s = Sampling(args.temperature, args.top_p, args.top_k, args.min_p)
    assert str(s) == "temperature=0.8, top_p=0.95, top_k=40, min_p=0.05"
    assert s.params(7).max_tokens == 7 and s.params(7).ignore_eos
    assert s.hf_generate_kwargs() == {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05}
    greedy = cli.build_parser().parse_args(["bench", "throughput"])
    assert str(Sampling(greedy.temperature, greedy.top_p, greedy.top_k, greedy.min_p)) == "greedy"
    assert Sampling().hf_generate_kwargs() == {"do_sample": False}
    assert Sampling(1.0).hf_generate_kwargs()["top_k"] == 0  # HF's default top-k of 50 turned off
    rep = cli.build_parser().parse_args(["bench", "throughput", "--repetition-penalty", "1.1"])
    s = Sampling(rep.temperature, rep.top_p, rep.top_k, rep.min_p, rep.repetition_penalty)
    assert str(s) == "greedy, repetition_penalty=1.1" and s.params(3).repetition_penalty == 1.1
    assert s.hf_generate_kwargs() == {"do_sample": False, "repetition_penalty": 1.1}


def test_a_bad_setting_names_its_field() -> None:
    with pytest.raises(ValueError, match="top_p"):
        Sampling(0.8, top_p=1.5).params(1)


def test_a_sampled_run_generates_every_requested_token(gemma) -> None:
    wl = Workload(prompts=[[2, 651, 6037, 576], [2, 9259], [2, 1175, 603, 11, 15]], output_lens=[5, 3, 8])
    r = run_kvserve(gemma, wl, Sampling(0.8, top_p=0.95, top_k=50), max_num_seqs=4, kv_cache_gib=0.05)
    assert r.output_tok_s > 0 and "temperature=0.8, top_p=0.95, top_k=50" in r.setting
