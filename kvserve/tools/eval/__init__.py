"""Evaluations (`kvserve eval ...`).

stream.py   StreamingLLM: NLL over a long token stream with a bounded KV cache
            (full attention, window, attention sinks + window, sliding-window recompute).
cli.py      the `kvserve eval` argument parser (no torch import, so `kvserve --help` stays fast).
"""
