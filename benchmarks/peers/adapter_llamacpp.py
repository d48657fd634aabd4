"""llama.cpp adapter (runs in benchmarks/peers/.venv-llamacpp, llama-cpp-python built with
GGML_NATIVE): the same GGUF as it is stored (Q4_K_M weights, llama.cpp's own kernels), n_threads
= the spec's threads, token ids fed directly (no tokenization), greedy = argmax of the logits.

Batch-1: `Llama.reset()` + `Llama.eval(prompt)` (one batch of n_batch=512 tokens), then one
`eval([token])` per new token; the KV cache is emptied before every request, so nothing is reused.
Offline: llama-cpp-python's high-level API serves one sequence at a time, so this adapter drives a
second llama.cpp context with `n_seq_max = parallel` through the low-level API (llama_batch with
one sequence id per request, as llama.cpp's `batched`/server --parallel do). Each throughput
setting is one way to run that context, and the driver keeps the best:
- "unified KV": one KV buffer for all sequences (`kv_unified`, llama.cpp's default); every step
  decodes one token of every running sequence plus the prompts of newly admitted ones in one
  llama_decode (llama.cpp then splits the batch into ubatches freely).
- "per-sequence KV": one KV stream per sequence (`kv_unified = false`: attention reads only the
  sequence's own cells). llama.cpp then splits a batch into ubatches holding the same number of
  tokens of every sequence, so a prompt mixed with one-token decodes would go a token at a time:
  each admitted prompt gets a llama_decode of its own, and the decode tokens one together.
- flash attention on or off (`flash_attn_type`).
With parallel=1 it is the plain one-request-at-a-time loop.
"""
from __future__ import annotations

import ctypes
import sys
import time
from collections import deque

import numpy as np
from _common import LLAMACPP_KV_MODES, ThroughputRun, Timed, main, threads


class LlamaCppEngine:
    name = "llamacpp"

    def __init__(self, spec: dict):
        import llama_cpp

        opts = spec.get("llamacpp", {})
        self.threads = threads(spec)
        self.n_batch = int(opts.get("n_batch", 512))
        parallel = opts.get("parallel", 16)
        self.parallel_list = [int(x) for x in (parallel if isinstance(parallel, list) else [parallel])]
        self.kv_modes = list(opts.get("kv", ["unified", "per-sequence"]))
        self.flash = [bool(x) for x in opts.get("flash_attn_batched", [False, True])]
        if bad := [m for m in self.kv_modes if m not in LLAMACPP_KV_MODES]:
            raise ValueError(f"llamacpp.kv: unknown mode(s) {bad}; expected {list(LLAMACPP_KV_MODES)}")
        self._settings: dict[str, tuple[int, str, bool]] = {}
        for p in self.parallel_list:
            if p <= 1:
                self._settings["batch 1 (sequential)"] = (1, "unified", False)
                continue
            for kv in self.kv_modes:
                for fa in self.flash:
                    label = f"{p} parallel sequences, {kv} KV, flash-attn {'on' if fa else 'off'}"
                    self._settings[label] = (p, kv, fa)
        self.llm = llama_cpp.Llama(model_path=spec["model_path"], n_ctx=spec["max_model_len"], n_batch=self.n_batch,
                                   n_ubatch=self.n_batch, n_threads=self.threads, n_threads_batch=self.threads,
                                   flash_attn=bool(opts.get("flash_attn", False)), seed=0, verbose=False)
        self.n_vocab = self.llm.n_vocab()
        self._checked = False
        self.dtype = _file_type(self.llm)
        self.notes: list[str] = [f"llama-cpp-python {llama_cpp.__version__}, n_threads={self.threads}, "
                                 f"flash_attn={bool(opts.get('flash_attn', False))}"]

    def _picks(self, ctx, rows: list[tuple[int, int]], running: dict[int, dict]) -> list[int]:
        """Greedy next token of each (row, slot) just decoded, stored as the slot's `last`; the slots."""
        for row, slot in rows:
            running[slot]["last"] = self._argmax(ctx.ctx, row)
        return [slot for _, slot in rows]

    def _argmax(self, ctx, i: int) -> int:
        """Greedy pick from the logits of batch row i (-1: the last row with logits)."""
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(ctx, i)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def generate_timed(self, ids: list[int], new_tokens: int) -> Timed:
        llm = self.llm
        llm.reset()  # n_tokens = 0: eval() drops every cached position first
        start = time.perf_counter()
        llm.eval(ids)
        tok = self._argmax(llm._ctx.ctx, -1)
        times, tokens = [time.perf_counter()], [tok]
        while len(tokens) < new_tokens:
            llm.eval([tok])
            tok = self._argmax(llm._ctx.ctx, -1)
            times.append(time.perf_counter())
            tokens.append(tok)
        return Timed(tokens, times[0] - start, times[-1] - times[0])

    def throughput_settings(self) -> list[str]:
        return list(self._settings)

    def throughput(self, prompts: list[list[int]], output_lens: list[int], setting: str) -> ThroughputRun:
        parallel, kv, flash = self._settings[setting]
        if parallel <= 1:
            t = time.perf_counter()
            produced = sum(len(self.generate_timed(p, n).tokens) for p, n in zip(prompts, output_lens))
            return ThroughputRun(setting, time.perf_counter() - t, produced)
        return self._throughput_batched(prompts, output_lens, setting, parallel, kv, flash)

    def _throughput_batched(self, prompts: list[list[int]], output_lens: list[int], setting: str,
                            parallel: int, kv: str, flash: bool) -> ThroughputRun:
        """Continuous batching over `parallel` sequence slots in one llama.cpp context."""
        import llama_cpp
        from llama_cpp._internals import LlamaBatch, LlamaContext

        per_seq = -(-(max(len(p) + n for p, n in zip(prompts, output_lens)) + 8) // 256) * 256  # llama.cpp pads to 256
        cap = self.n_batch + parallel  # admitted prompts + one token per running sequence
        params = type(self.llm.context_params).from_buffer_copy(self.llm.context_params)
        params.n_seq_max = parallel
        params.n_ctx = parallel * per_seq  # split evenly: each sequence gets n_ctx / n_seq_max
        params.kv_unified = kv == "unified"
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.n_batch = cap
        ctx = LlamaContext(model=self.llm._model, params=params, verbose=False)
        batch = LlamaBatch(n_tokens=cap, embd=0, n_seq_max=1, verbose=False)
        mem = llama_cpp.llama_get_memory(ctx.ctx)
        b = batch.batch
        queue = deque(range(len(prompts)))
        free = list(range(parallel))
        running: dict[int, dict] = {}  # slot -> {req, pos, last, produced}
        produced = 0
        first: list[int] = []  # request 0's tokens: checked once against the batch-1 path
        t = time.perf_counter()
        try:
            while queue or running:
                rows: list[tuple[int, int]] = []  # (batch row with logits, slot) of the last llama_decode
                decoded: list[tuple[int, int]] = []  # every slot that got its next token this step
                b.n_tokens = 0
                for slot, st in running.items():  # one decode token per running sequence
                    rows.append((_add(b, st["last"], st["pos"], slot, True), slot))
                    st["pos"] += 1
                while queue and free and b.n_tokens + len(prompts[queue[0]]) <= cap:
                    if kv != "unified" and b.n_tokens:  # per-sequence KV: each prompt in a call of its own
                        ctx.decode(batch)
                        decoded += self._picks(ctx, rows, running)
                        rows, b.n_tokens = [], 0
                    req, slot = queue.popleft(), free.pop()
                    p = prompts[req]
                    for j, tok in enumerate(p):
                        row = _add(b, tok, j, slot, j == len(p) - 1)
                    rows.append((row, slot))
                    running[slot] = {"req": req, "pos": len(p), "last": -1, "produced": 0}
                if not rows and not decoded:
                    raise ValueError(f"prompt of {len(prompts[queue[0]])} tokens exceeds n_batch={self.n_batch}")
                if rows:
                    ctx.decode(batch)
                    decoded += self._picks(ctx, rows, running)
                for slot in decoded:
                    st = running[slot]
                    st["produced"] += 1
                    if st["req"] == 0:
                        first.append(st["last"])
                    if st["produced"] == output_lens[st["req"]]:
                        produced += st["produced"]
                        llama_cpp.llama_memory_seq_rm(mem, slot, -1, -1)
                        del running[slot]
                        free.append(slot)
            run = ThroughputRun(setting, time.perf_counter() - t, produced)
        finally:
            batch.close()
            ctx.close()
        if not self._checked:
            self._checked = True
            alone = self.generate_timed(prompts[0], output_lens[0]).tokens
            same = next((i for i, (a, b_) in enumerate(zip(first, alone)) if a != b_), min(len(first), len(alone)))
            self.notes.append(f"batched request 0 vs batch-1 greedy: first {same} of {len(alone)} tokens equal")
        return run


def _add(b, token: int, pos: int, seq: int, logits: bool) -> int:
    """Append one token of sequence `seq` at position `pos` to a llama_batch; returns its row."""
    i = b.n_tokens
    b.token[i] = token
    b.pos[i] = pos
    b.n_seq_id[i] = 1
    b.seq_id[i][0] = seq
    b.logits[i] = logits
    b.n_tokens = i + 1
    return i


def _file_type(llm) -> str:
    """The GGUF's quantization as llama.cpp names it (general.file_type), e.g. Q4_K_M."""
    names = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
             11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
             18: "Q6_K", 32: "BF16"}
    ft = llm.metadata.get("general.file_type")
    try:
        return names.get(int(ft), f"file_type {ft}")
    except (TypeError, ValueError):
        buf = ctypes.create_string_buffer(128)
        import llama_cpp

        llama_cpp.llama_model_desc(llm._model.model, buf, 128)
        return buf.value.decode()


if __name__ == "__main__":
    sys.exit(main(LlamaCppEngine, "llamacpp"))
