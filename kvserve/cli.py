"""Command line: `kvserve generate | serve | bench | eval | roofline | quantize | prune | distill |
convert`. Each command imports what it needs when it runs, so `kvserve --help` stays quick."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from kvserve.argtypes import json_object, positive_int
from kvserve.reasoning import PARSERS as REASONING_PARSERS


# kvserve.model.attention.KV_CACHE_DTYPES, spelled out so that parsing flags does not import torch
KV_CACHE_DTYPES = ("auto", "fp16", "bf16", "float16", "bfloat16", "fp32", "float32", "int8", "fp8")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file, HF folder, or a Hugging Face name from the HF cache: ORG/NAME, or ORG/NAME:QUANT "
                        "for a repository's .gguf file holding QUANT, e.g. Q4_K_M (default: bundled Gemma 3 270M)")
    p.add_argument("--allow-download", action="store_true",
                   help="download a Hugging Face name missing from the HF cache ($HF_HUB_CACHE, else $HF_HOME/hub) "
                        "instead of failing")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="auto",
                   help="float32, bfloat16 or float16; auto: float32 on the CPU, bfloat16 on CUDA")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly instead of through captured CUDA graphs")
    p.add_argument("--num-scheduler-steps", type=positive_int, default=1,
                   help="CUDA graphs: decode plain greedy sequences this many tokens per scheduling step, the "
                        "steps in one captured graph (the host's per-step work paid once per run)")
    p.add_argument("--no-kv-cache", action="store_true",
                   help="recompute the whole sequence every step (the O(T^2) baseline)")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV pool size in GiB (default: --max-model-len tokens in every layer, at most half the "
                        "memory available once the weights are loaded)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV storage. auto: the model's dtype, but fp16 with --weights gguf (llama.cpp's cache "
                        "type); fp16 / bf16 (half an fp32 pool, computed in fp32) or fp32; int8 / fp8 (e4m3) with "
                        "per-token, per-head scales")
    p.add_argument("--max-model-len", type=int, default=None, help="context window cap")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV cache page (%(default)s)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV pages of a prompt prefix computed before (on by default)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                   help="split the model over N processes (rank 0 is this one; gloo on the CPU, NCCL on CUDA), each "
                        "bound to its share of the cores; under torchrun, over its ranks (%(default)s)")
    _add_weights_arg(p)
    g = p.add_argument_group("StreamingLLM (constant KV memory past the context length)")
    g.add_argument("--attention-sinks", type=int, default=0, help="S: first tokens every layer keeps for good")
    g.add_argument("--streaming-window", type=int, default=None,
                   help="W: recent tokens every layer keeps; positions are ranks in the cache (off by default)")
    _add_speculative_args(p)


def _add_weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", default="float", choices=["float", "fp32", "int8", "int4", "gguf"],
                   help="float: as loaded, in --dtype (fp32: the same, for --dtype float32); int8 / int4: RTN-quantize "
                        "every linear, the LM head and the embedding at start (int8 per channel, int4 groups of 128) "
                        "onto kvserve's C int8 / int4 kernels on CPU (PyTorch's without a C compiler); gguf: a .gguf "
                        "file's own quantized blocks (Q4_0..Q8_0, Q2_K..Q6_K, F16), no float copy")
    p.add_argument("--gguf-activations", default="int8", choices=["int8", "float"],
                   help="--weights gguf: int8 quantizes each activation row per 32 values for integer dot products "
                        "with the blocks (llama.cpp's arithmetic, the fast path); float computes the float model's "
                        "products exactly (slower)")
    p.add_argument("--gguf-mmap", action="store_true",
                   help="--weights gguf: compute from the memory-mapped file's pages (shared with other processes "
                        "serving the same file through the page cache) instead of reading the blocks into this "
                        "process's memory in 2 MB pages (the default; faster decode on large files)")
    p.add_argument("--no-pack-weights", dest="pack_weights", action="store_false",
                   help="CPU fp32: do not keep the packed copy of the weights for decode steps nor the int8 screen "
                        "of the LM head for greedy tokens (saves one copy of the fp32 weights and a quarter of the "
                        "head in memory; decode steps get slower); CUDA: cuBLAS for every matmul, no Triton "
                        "matrix-vector kernels chosen by timing for decode steps of 1-4 sequences")
    p.add_argument("--compile", action="store_true",
                   help="float weights: run every full forward pass through torch.compile (inductor; attention stays "
                        "kvserve's, one opaque op per layer) instead of the packed-weight C kernels; the first step "
                        "of each shape pays the compile (about a minute on 2 cores)")


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (lossless)")
    g.add_argument("--speculative", choices=["ngram", "draft", "self"], default=None,
                   help="proposer: ngram (prompt lookup), draft (--speculative-model), self (a cheaper copy of the target)")
    g.add_argument("--num-speculative-tokens", type=int, default=4, help="k tokens proposed and verified per step")
    g.add_argument("--num-speculative-tokens-schedule", choices=["constant", "heuristic"], default="constant",
                   help="constant: k every step; heuristic: each sequence's own k, +2 after a step that kept all "
                        "its drafts, -1 after one that did not, within 1..k (HF transformers' schedule)")
    g.add_argument("--speculative-model", default=None, help="draft model (GGUF or HF folder) sharing the tokenizer")
    g.add_argument("--ngram-min", type=int, default=1, help="shortest suffix n-gram to look up")
    g.add_argument("--ngram-max", type=int, default=4, help="longest suffix n-gram to look up (tried first)")
    g.add_argument("--self-draft-layers", type=int, default=None, help="self draft: early exit after L layers")
    g.add_argument("--self-draft-dtype", default=None,
                   help="self draft: a copy of the target in this dtype (default bfloat16 for a float32 target)")
    g.add_argument("--self-draft-bits", type=int, choices=[4, 8], default=None,
                   help="self draft: an RTN int4 (g128) / int8 copy of the target, LM head included")
    g.add_argument("--draft-vocab", default=None,
                   help="self / draft model: its head scores only the tokens of this file (from `kvserve draft-vocab`)")
    g.add_argument("--draft-vocab-size", type=int, default=None, help="keep the first N ids of --draft-vocab")


def decoding_config(args: argparse.Namespace) -> dict:
    """EngineConfig fields from the flags `generate` and `serve` share beyond the basic ones:
    downloads, KV pages, weights, speculative decoding, StreamingLLM."""
    return dict(allow_download=args.allow_download, block_size=args.block_size,
                enable_prefix_caching=args.enable_prefix_caching,
                speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                num_speculative_tokens_schedule=args.num_speculative_tokens_schedule,
                speculative_model=args.speculative_model, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                self_draft_layers=args.self_draft_layers, self_draft_dtype=args.self_draft_dtype,
                self_draft_bits=args.self_draft_bits, draft_vocab=args.draft_vocab,
                draft_vocab_size=args.draft_vocab_size,
                attention_sinks=args.attention_sinks, streaming_window=args.streaming_window,
                kv_cache_dtype=args.kv_cache_dtype, weights=args.weights, gguf_activations=args.gguf_activations,
                gguf_mmap=args.gguf_mmap, pack_weights=args.pack_weights,
                compile=args.compile, enforce_eager=args.enforce_eager,
                num_scheduler_steps=args.num_scheduler_steps,
                tensor_parallel_size=args.tensor_parallel_size)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)


def _add_serve_parser(sub) -> None:
    from kvserve.engine.async_engine import DEFAULT_MAX_UNREAD_TOKENS
    from kvserve.server.limits import (
        DEFAULT_MAX_JSON_DEPTH,
        DEFAULT_MAX_N,
        DEFAULT_MAX_REQUEST_SEQS,
        DEFAULT_MAX_STOP,
        DEFAULT_MAX_STOP_CHARS,
        DEFAULT_MAX_STOP_TOKEN_IDS,
        DEFAULT_MAX_TOKENS,
        DEFAULT_REQUEST_TIMEOUT_S,
    )

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    srv.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                     help="GGUF file, HF folder or Hugging Face name (ORG/NAME, ORG/NAME:QUANT) (default: bundled "
                          "Gemma 3 270M); same as --model")
    _add_engine_args(srv)
    srv.add_argument("--max-num-seqs", type=positive_int, default=64, help="sequences per step")
    srv.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, help="token budget per step")
    srv.add_argument("--seed", type=int, default=None,
                     help="the engine's seed: requests without a seed draw theirs from it in arrival order, so a "
                          "server started with the same seed and sent the same requests samples the same tokens "
                          "(default: unseeded requests use the process's random state)")
    srv.add_argument("--pooler-config", type=json_object, default=None, metavar="JSON",
                     help='/v1/embeddings pooling, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' '
                          '(default: LAST, normalized)')
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL)")
    srv.add_argument("--chat-template", default=None, metavar="FILE",
                     help="chats render with this Jinja template (a file, or the template itself) instead of the "
                          "model's own")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1 routes (visible in ps: prefer the next two)")
    srv.add_argument("--api-key-file", default=None, help="the API key from the first line of this file")
    srv.add_argument("--protect-metrics", action="store_true", help="/metrics and /stats want the API key too")
    srv.add_argument("--max-connections", type=int, default=1024,
                     help="open connections (streams included) before new ones get 503 (%(default)s)")
    srv.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds a client has to send its request headers before the connection is closed "
                          "(%(default)s; against slowloris clients)")
    srv.add_argument("--body-timeout", type=float, default=60.0,
                     help="seconds a request body may take to arrive before a 408 (%(default)s)")
    srv.add_argument("--allowed-hosts", default=None,
                     help="comma list of Host header values to answer (e.g. localhost,127.0.0.1; '*.example.com' "
                          "wildcards); others get 400: a guard against DNS rebinding (default: any)")
    srv.add_argument("--max-queue", type=int, default=None, help="waiting requests before answering 429 (1024)")
    srv.add_argument("--max-body-bytes", type=positive_int, default=None, help="larger request bodies get 413 (4 MiB)")
    lim = srv.add_argument_group("what one request may ask for (past a limit: a 400 naming the field)")
    lim.add_argument("--max-n", type=positive_int, default=DEFAULT_MAX_N, help="samples per prompt, n (%(default)s)")
    lim.add_argument("--max-stop", type=positive_int, default=DEFAULT_MAX_STOP, help="stop strings (%(default)s)")
    lim.add_argument("--max-stop-chars", type=positive_int, default=DEFAULT_MAX_STOP_CHARS,
                     help="characters per stop string (%(default)s)")
    lim.add_argument("--max-stop-token-ids", type=positive_int, default=DEFAULT_MAX_STOP_TOKEN_IDS,
                     help="stop_token_ids (%(default)s)")
    lim.add_argument("--max-json-depth", type=positive_int, default=DEFAULT_MAX_JSON_DEPTH,
                     help="nesting of the JSON body (%(default)s)")
    lim.add_argument("--max-request-seqs", type=positive_int, default=DEFAULT_MAX_REQUEST_SEQS,
                     help="sequences of one request, prompts x n (%(default)s)")
    lim.add_argument("--max-tokens-default", type=positive_int, default=DEFAULT_MAX_TOKENS,
                     help="output tokens of a request that sets no max_tokens (%(default)s)")
    lim.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                     help="seconds from arrival after which a request finishes with finish_reason 'length' "
                          "(%(default)s)")
    lim.add_argument("--strict-requests", action="store_true",
                     help="refuse a request field that is not an OpenAI or kvserve parameter with a 400 naming it "
                          "(default: ignore it and log a warning naming it, as vLLM does)")
    srv.add_argument("--max-stream-backlog", type=positive_int, default=DEFAULT_MAX_UNREAD_TOKENS,
                     help="output tokens of one sample a streaming client may leave unread before its request "
                          "is aborted and its KV blocks freed (%(default)s)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="on SIGTERM, seconds in-flight requests get to finish before they are aborted")
    dp = srv.add_argument_group("replicas behind this server (Ray Serve; pip install 'kvserve[ray]')")
    dp.add_argument("--data-parallel-size", type=positive_int, default=1,
                    help="engine replicas, each with cores / N threads (%(default)s: one engine in this process)")
    dp.add_argument("--router", choices=["prefix", "round_robin", "pow2"], default="prefix",
                    help="how a request picks its replica: the one holding its longest prefix (load-guarded), "
                         "in turn, or the less loaded of two at random (%(default)s)")
    dp.add_argument("--router-cache-threshold", type=float, default=0.5,
                    help="prefix: the least share of a prompt's blocks a replica must hold to get it (%(default)s)")
    dp.add_argument("--router-balance-abs-threshold", type=int, default=8,
                    help="prefix: loads are unbalanced (least loaded wins) past this max - min outstanding ... "
                         "(%(default)s)")
    dp.add_argument("--router-balance-rel-threshold", type=float, default=1.5,
                    help="... and when max > this x min (%(default)s)")
    dp.add_argument("--ray-address", default=None,
                    help="an existing Ray cluster (default: a Ray of this server's own, listening on 127.0.0.1 only, "
                         "with no dashboard and no usage stats)")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    tools = srv.add_argument_group("tool calling")
    tools.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "none"],
                       help="format of the model's tool calls for tool_choice 'auto' (default: the one its chat "
                            "template defines, if any; 'required' and named choices work without one)")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="accepted for vLLM command lines: tool_choice 'auto' is on whenever a parser is known")
    tools.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                       help="a thinking model's <think> ... </think> block goes to the chat responses' reasoning "
                            "field (and reasoning_content), the rest to content and tool calls (default: all content)")


def _add_eval_parser(sub) -> None:
    from kvserve.tools.eval.cli import (
        add_eval_parser,  # the flags live beside the evaluations
    )

    add_eval_parser(sub)


def _add_roofline_parser(sub) -> None:
    from kvserve.tools.analysis.cli import add_roofline_parser

    add_roofline_parser(sub)


def _add_quantize_parser(sub) -> None:
    from kvserve.compress.quant.cli import add_quantize_parser

    add_quantize_parser(sub)


def _add_prune_parser(sub) -> None:
    from kvserve.compress.prune.cli import add_prune_parser

    add_prune_parser(sub)


def _add_convert_parser(sub) -> None:
    from kvserve.compress.convert.cli import add_convert_parser

    add_convert_parser(sub)


def _add_distill_parser(sub) -> None:
    from kvserve.compress.train.cli import add_distill_parser

    add_distill_parser(sub)


def _add_draft_vocab_parser(sub) -> None:
    from kvserve.tools.draft_vocab import add_draft_vocab_parser

    add_draft_vocab_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="A small LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for a prompt, streamed to the terminal")
    gen.add_argument("prompt")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--quiet-metrics", action="store_true", help="do not print TTFT/TPOT at the end")
    _add_serve_parser(sub)
    _add_eval_parser(sub)
    _add_roofline_parser(sub)
    _add_quantize_parser(sub)
    _add_prune_parser(sub)
    _add_distill_parser(sub)
    _add_convert_parser(sub)
    _add_draft_vocab_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    from kvserve.tools.bench.throughput import INPUT_RANGE, OUTPUT_RANGE

    tp = bench.add_parser("throughput", help="offline throughput on a random workload (optionally vs HF)")
    tp.add_argument("--model", default=None)
    tp.add_argument("--dtype", default="float32")
    _add_weights_arg(tp)
    tp.add_argument("--num-prompts", type=positive_int, default=64)
    tp.add_argument("--input-len", type=positive_int, nargs=2, default=list(INPUT_RANGE), metavar=("MIN", "MAX"))
    tp.add_argument("--output-len", type=positive_int, nargs=2, default=list(OUTPUT_RANGE), metavar=("MIN", "MAX"))
    tp.add_argument("--seed", type=int, default=0)
    tp.add_argument("--max-num-seqs", type=_int_list, default=[64], help="comma list: a sweep")
    tp.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    tp.add_argument("--kv-cache-gib", type=float, default=None)
    tp.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    tp.add_argument("--temperature", type=float, default=0.0,
                    help="0 = greedy (the default); above 0 every request samples, HF with do_sample too")
    tp.add_argument("--top-p", type=float, default=1.0)
    tp.add_argument("--top-k", type=int, default=0, help="0 = off")
    tp.add_argument("--min-p", type=float, default=0.0)
    tp.add_argument("--repetition-penalty", type=float, default=1.0)
    tp.add_argument("--hf-batch-sizes", type=_int_list, default=[], help="comma list; empty = skip HF")
    tp.add_argument("--plot", default=None, help="PNG of throughput vs --max-num-seqs")
    tp.add_argument("--json", default=None)
    sp = bench.add_parser("spec", help="speculative decoding vs plain decoding: acceptance, tok/s, speedup per k")
    sp.add_argument("--model", default=None)
    sp.add_argument("--dtype", default="float32")
    sp.add_argument("--proposers", default="ngram,self",
                    help="comma list of ngram, self (bf16 copy), self-int4, self-int8 (RTN copies), self-exitN "
                         "(the target's first N layers), draft; NAME+vocab: a model draft's head over --draft-vocab; "
                         "then +heuristic: the heuristic draft-length schedule, k at most")
    sp.add_argument("--draft-vocab", default=None, help="the +vocab proposers' token subset (kvserve draft-vocab)")
    sp.add_argument("--weights", choices=["float", "gguf"], default="float",
                    help="the target's weights: float (--dtype) or gguf (a GGUF file's own blocks)")
    sp.add_argument("--k", type=_int_list, default=[1, 2, 4, 6, 8], help="comma list of speculative token counts")
    sp.add_argument("--batch", type=_int_list, default=[1, 8], help="comma list of batch sizes")
    sp.add_argument("--workload", default="grounded", help="grounded (repeat / summarize a document) or free")
    sp.add_argument("--num-prompts", type=positive_int, default=8)
    sp.add_argument("--doc-words", type=positive_int, default=200, help="words of WikiText per prompt")
    sp.add_argument("--output-len", type=positive_int, default=96)
    sp.add_argument("--temperature", type=float, default=0.0)
    sp.add_argument("--top-p", type=float, default=1.0)
    sp.add_argument("--top-k", type=int, default=0, help="0 = off")
    sp.add_argument("--repetition-penalty", type=float, default=1.0)
    sp.add_argument("--rounds", type=positive_int, default=2, help="interleaved rounds; medians are reported")
    sp.add_argument("--speculative-model", default=None, help="draft model for --proposers draft")
    sp.add_argument("--kv-cache-gib", type=float, default=0.5, help="KV pool per engine (one per configuration)")
    sp.add_argument("--dataset-path", default=None, help="text file (default: $KVSERVE_DATA/wikitext2/wiki.test.raw)")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--json", default=None)
    sp.add_argument("--plot", default=None, help="PNG of speedup vs k per proposer and batch size")
    lt = bench.add_parser("latency", help="one request: TTFT, prefill tok/s, batch-1 decode tok/s vs the bandwidth bound")
    lt.add_argument("--model", default=None)
    lt.add_argument("--dtype", default="float32")
    _add_weights_arg(lt)
    lt.add_argument("--input-len", type=positive_int, default=512, help="prompt tokens (fresh random ids)")
    lt.add_argument("--output-len", type=positive_int, default=128, help="new tokens (ignore_eos)")
    lt.add_argument("--repeats", type=positive_int, default=3, help="runs; medians are reported")
    lt.add_argument("--seed", type=int, default=0)
    lt.add_argument("--json", default=None)
    pf = bench.add_parser("prefix", help="requests sharing a system prompt, prefix cache on vs off")
    pf.add_argument("--model", default=None)
    pf.add_argument("--dtype", default="float32")
    pf.add_argument("--num-prompts", type=positive_int, default=32)
    pf.add_argument("--shared-len", type=positive_int, default=384)
    pf.add_argument("--unique-len", type=positive_int, default=32)
    pf.add_argument("--output-len", type=positive_int, default=32)
    pf.add_argument("--seed", type=int, default=0)
    pf.add_argument("--json", default=None)
    sv = bench.add_parser("serve", help="online serving benchmark against an OpenAI-compatible server")
    sv.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    sv.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    sv.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    sv.add_argument("--request-rate", default="inf",
                    help="requests/s with Poisson arrivals; comma list = sweep; inf = all at once")
    sv.add_argument("--max-concurrency", type=positive_int, default=None, help="at most this many requests in flight")
    sv.add_argument("--num-prompts", type=positive_int, default=64, help="requests per rate")
    sv.add_argument("--dataset", choices=["random", "wikitext2"], default="random")
    sv.add_argument("--dataset-path", default=None, help="wikitext2 text file (default: $KVSERVE_DATA/wikitext2/wiki.test.raw)")
    sv.add_argument("--input-len", type=positive_int, default=256, help="prompt length in words")
    sv.add_argument("--workload", choices=["dataset", "shared-prefix"], default="dataset",
                    help="dataset: --dataset prompts; shared-prefix: --num-prefixes system prompts of --prefix-len "
                         "words, each request one of them plus a unique --suffix-len suffix")
    sv.add_argument("--num-prefixes", type=positive_int, default=8, help="shared-prefix: K system prompts")
    sv.add_argument("--prefix-len", type=positive_int, default=512, help="shared-prefix: words per system prompt")
    sv.add_argument("--suffix-len", type=positive_int, default=32, help="shared-prefix: new words per turn")
    sv.add_argument("--turns", type=positive_int, default=1,
                    help="shared-prefix: turns per conversation (turn t repeats the earlier turns)")
    sv.add_argument("--output-len", type=positive_int, default=64, help="max_tokens per request (ignore_eos)")
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                    help="SLOs in ms, e.g. ttft:500 tpot:50 e2e:10000; goodput = req/s meeting all")
    sv.add_argument("--api-key", default=None)
    sv.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    sv.add_argument("--json", default=None)
    sv.add_argument("--plot", default=None, help="PNG of TTFT/TPOT vs output tok/s, one point per rate")
    ho = bench.add_parser("hostile", help="hostile clients against a running server: 5xx, RSS, /health, normal latency")
    ho.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (a server on this machine)")
    ho.add_argument("--pid", type=positive_int, required=True, help="the server's process id (its RSS from /proc)")
    ho.add_argument("--no-amplify", action="store_true", help="leave out 64 prompts x n 128 (GBs on a server without caps)")
    ho.add_argument("--seed", type=int, default=0)
    ho.add_argument("--json", default=None)
    return parser


def _int_list(text: str) -> list[int]:
    return [positive_int(t) for t in text.split(",") if t.strip()] if text.strip() else []


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "throughput":
        from kvserve.tools.bench.throughput import main as throughput

        for name in ("input_len", "output_len"):
            lo, hi = getattr(args, name)
            if lo > hi:
                raise ValueError(f"--{name.replace('_', '-')}: MIN {lo} > MAX {hi}")
        return throughput(args)
    if args.bench == "spec":
        from kvserve.tools.bench.spec import main as spec_main

        return spec_main(args)
    if args.bench == "latency":
        from kvserve.tools.bench.latency import main as latency

        if args.output_len < 2:
            raise ValueError("--output-len: at least 2 tokens are needed to time decode")
        return latency(args)
    if args.bench == "prefix":
        from kvserve.tools.bench.prefix import main as prefix

        return prefix(args)
    if args.bench == "serve":
        from kvserve.tools.bench.serve import main as serve

        return serve(args)
    if args.bench == "hostile":
        from kvserve.tools.bench.hostile import main as hostile

        return hostile(args)
    raise ValueError(f"unknown benchmark {args.bench!r}")


def _sampling_params(args: argparse.Namespace):
    from kvserve.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
        ignore_eos=args.ignore_eos, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    from kvserve.llm import LLM

    params = _sampling_params(args)  # validate before the (slow) model load
    llm = LLM(args.model, device=args.device, dtype=args.dtype, use_kv_cache=not args.no_kv_cache,
              kv_cache_gib=args.kv_cache_gib, max_model_len=args.max_model_len, num_threads=args.threads,
              max_num_seqs=1, **decoding_config(args))
    t_loaded = time.perf_counter()
    final = None
    try:
        for out in llm.stream(args.prompt, params):
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
            final = out
    finally:
        llm.close()
    sys.stdout.write("\n")
    if not args.quiet_metrics and final is not None:
        m = final.metrics
        tpot = f"{m.tpot * 1000:.1f} ms" if m.tpot is not None else "n/a"
        print(f"--- {m.num_prompt_tokens} prompt tokens, {m.num_output_tokens} output tokens "
              f"({final.outputs[0].finish_reason})", file=sys.stderr)
        print(f"load {t_loaded - t_start:.2f} s | TTFT {m.ttft * 1000:.1f} ms | TPOT {tpot} | "
              f"{m.output_tokens_per_s:.2f} tok/s | first token {m.first_token_time - t_start:.2f} s after start",
              file=sys.stderr)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from kvserve.tools.eval.cli import run

    return run(args)


def cmd_roofline(args: argparse.Namespace) -> int:
    from kvserve.tools.analysis.cli import run

    return run(args)


def cmd_quantize(args: argparse.Namespace) -> int:
    from kvserve.compress.quant.cli import run

    return run(args)


def cmd_prune(args: argparse.Namespace) -> int:
    from kvserve.compress.prune.cli import run

    return run(args)


def cmd_convert(args: argparse.Namespace) -> int:
    from kvserve.compress.convert.cli import run

    return run(args)


def cmd_distill(args: argparse.Namespace) -> int:
    from kvserve.compress.train.cli import run

    return run(args)


def cmd_draft_vocab(args: argparse.Namespace) -> int:
    from kvserve.tools.draft_vocab import run

    return run(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.config import EngineConfig
    from kvserve.server.launch import ServeOptions, resolve_api_key, serve
    from kvserve.server.limits import RequestLimits

    if args.model_path and args.model and args.model_path != args.model:
        raise ValueError(f"two models given: {args.model_path!r} and --model {args.model!r}")
    config = EngineConfig(model=args.model_path or args.model, device=args.device, dtype=args.dtype,
                          use_kv_cache=not args.no_kv_cache, kv_cache_gib=args.kv_cache_gib,
                          max_model_len=args.max_model_len, num_threads=args.threads,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          seed=args.seed, pooler_config=args.pooler_config, reasoning_parser=args.reasoning_parser,
                          **decoding_config(args))
    server_limits = {k: getattr(args, k) for k in ("max_queue", "max_body_bytes") if getattr(args, k) is not None}
    opts = ServeOptions(host=args.host, port=args.port, served_model_name=args.served_model_name,
                        api_key=resolve_api_key(args.api_key, args.api_key_file),
                        protect_metrics=args.protect_metrics, max_connections=args.max_connections,
                        header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                        max_stream_backlog=args.max_stream_backlog,
                        allowed_hosts=None if args.allowed_hosts is None else args.allowed_hosts.split(","),
                        shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
                        chat_template=args.chat_template,
                        tool_call_parser=args.tool_call_parser, data_parallel_size=args.data_parallel_size,
                        router=args.router, ray_address=args.ray_address,
                        router_cache_threshold=args.router_cache_threshold,
                        router_balance_abs_threshold=args.router_balance_abs_threshold,
                        router_balance_rel_threshold=args.router_balance_rel_threshold,
                        limits=RequestLimits(max_n=args.max_n, max_stop=args.max_stop, max_stop_chars=args.max_stop_chars,
                                             max_stop_token_ids=args.max_stop_token_ids,
                                             max_json_depth=args.max_json_depth,
                                             max_request_seqs=args.max_request_seqs,
                                             max_tokens_default=args.max_tokens_default,
                                             request_timeout=args.request_timeout,
                                             strict_requests=args.strict_requests),
                        **server_limits)
    return serve(config, opts)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="kvserve: %(message)s", stream=sys.stderr)
    try:
        commands = {"generate": cmd_generate, "bench": cmd_bench, "serve": cmd_serve, "eval": cmd_eval,
                    "roofline": cmd_roofline, "quantize": cmd_quantize,
                    "prune": cmd_prune, "distill": cmd_distill, "convert": cmd_convert,
                    "draft-vocab": cmd_draft_vocab}
        return commands[args.command](args)
    except ValueError as e:  # bad input (ModelLoadError is a ValueError): a message, no traceback
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # an optional extra not installed
        extra = _EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"kvserve: error: this command needs {e.name}: pip install 'kvserve[{extra}]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


# Packages of optional extras (pyproject.toml) -> the extra that brings them.
_EXTRAS = {"httpx": "bench", "matplotlib": "bench", "transformers": "convert", "ray": "ray"}


if __name__ == "__main__":
    sys.exit(main())
