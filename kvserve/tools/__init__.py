"""Tools beside the serving stack: they use it, the stack never imports them.

eval/      perplexity and StreamingLLM evaluations, `kvserve eval`
analysis/  roofline and KV-cache arithmetic, `kvserve roofline`
bench/     latency, throughput, serving and speculative benchmarks, `kvserve bench`
"""
