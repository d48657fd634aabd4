"""Per-token cost of stop-string checking against the number of stop strings.

A request's stop strings are one automaton (kvserve/sampling/stop.py, `StopMatcher`), so a token
costs O(its characters) whatever their number: this times `StopChecker.check` over 2,000 tokens of
WikiText-like words for 0, 1, 4 and 16 stop strings of 256 characters (the server's default caps),
random ones and ones that share a long prefix with the text (the matcher then sits deep in its
trie and falls back along failure links). Median of 5 passes.

    cd benchmarks && ../.venv/bin/python stop_strings.py [--json-dir results]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from _common import machine, save_json

from kvserve.sampling import StopChecker
from kvserve.sampling_params import SamplingParams

WORDS = "the of and a to in is was for on that with as by at".split()


def stop_strings(kind: str, count: int, rng: random.Random) -> list[str]:
    if kind == "random":
        return ["".join(rng.choice("abcdefghij") for _ in range(256)) for _ in range(count)]
    return [(" the" * 64)[:255] + chr(65 + i) for i in range(count)]  # the text's own prefix, then a miss


def us_per_token(stops: list[str], deltas: list[str], passes: int) -> float:
    times = []
    for _ in range(passes):
        checker = StopChecker(SamplingParams(stop=stops, max_tokens=None), [1], 10**7)
        t = time.perf_counter()
        for i, d in enumerate(deltas, 1):
            checker.check(5, d, i, i + 10)
        times.append((time.perf_counter() - t) / len(deltas) * 1e6)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json-dir", default=None)
    args = p.parse_args()
    rng = random.Random(0)
    deltas = [" " + rng.choice(WORDS) for _ in range(2000)]
    rows = []
    for kind, text in (("random", deltas), ("sharing a prefix with the text", [" the"] * 2000)):
        for count in (0, 1, 4, 16):
            rows.append({"stops": kind, "count": count, "us_per_token": us_per_token(stop_strings(kind, count, rng),
                                                                                     text, passes=5)})
    print(f"{machine()}\n| stop strings (256 chars each) | count | us per token |\n|---|---|---|")
    for r in rows:
        print(f"| {r['stops']} | {r['count']} | {r['us_per_token']:.2f} |")
    save_json("stop_strings", {"rows": rows}, args.json_dir)


if __name__ == "__main__":
    main()
