"""Synthetic llama-architecture GGUFs for memory and speed work: real shapes and real block
formats, seeded random weights (the text they generate is meaningless; their timings and memory
are real).

    cd benchmarks && ../.venv/bin/python synthetic_gguf.py --shape 1b --type Q8_0 --out DIR
    ../.venv/bin/python synthetic_gguf.py --shape 8b --type Q4_K_M --out DIR   # needs llama-cpp-python

Shapes are Llama 3.2 1B, Llama 3.2 3B and Llama 3 8B; the vocabulary is the bundled Gemma 3
tokenizer's (262,144 tokens, copied from its GGUF), so the embedding is larger than those
models' own (128,256). Q4_0, Q8_0 and F16 are written by the `gguf` package's quantizer a few
rows at a time (memory stays near one layer's fp32 rows); Q4_K_M is llama.cpp's own quantizer
(`llama_model_quantize` from llama-cpp-python, the peers' venv) run on an F16 file written first.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

from kvserve.loading.gguf_file import GGUFFile
from kvserve.loading.loader import default_model_path

# name: (hidden, intermediate, layers, heads, kv heads, head dim, tied embeddings, rope theta)
SHAPES = {
    "1b": (2048, 8192, 16, 32, 8, 64, True, 500000.0),
    "3b": (3072, 8192, 28, 24, 8, 128, True, 500000.0),
    "8b": (4096, 14336, 32, 32, 8, 128, False, 500000.0),
}
T = gguf.GGMLQuantizationType
WRITTEN = {"Q4_0": T.Q4_0, "Q8_0": T.Q8_0, "F16": T.F16}
ROWS_AT_ONCE = 4096
PEERS_PYTHON = Path(__file__).resolve().parent / "peers" / ".venv-llamacpp" / "bin" / "python"


def tokenizer_fields(src: Path) -> list[tuple[str, object, gguf.GGUFValueType]]:
    """The tokenizer.* metadata of the bundled model's GGUF, to copy."""
    r = GGUFFile(src)
    out = []
    for key, value in r.fields.items():
        if key.startswith("tokenizer.") and key != "tokenizer.chat_template":
            vtype, elem = r.types[key]
            out.append((key, value, vtype if elem is None else elem))
    return out


def tensors(shape: tuple, vocab: int) -> list[tuple[str, tuple[int, int] | tuple[int]]]:
    """(GGUF name, numpy shape) of every tensor, in file order."""
    hidden, inter, layers, heads, kv_heads, head_dim, tied, _ = shape
    out: list[tuple[str, tuple]] = [("token_embd.weight", (vocab, hidden))]
    for i in range(layers):
        b = f"blk.{i}"
        out += [(f"{b}.attn_norm.weight", (hidden,)), (f"{b}.attn_q.weight", (heads * head_dim, hidden)),
                (f"{b}.attn_k.weight", (kv_heads * head_dim, hidden)), (f"{b}.attn_v.weight", (kv_heads * head_dim, hidden)),
                (f"{b}.attn_output.weight", (hidden, heads * head_dim)), (f"{b}.ffn_norm.weight", (hidden,)),
                (f"{b}.ffn_gate.weight", (inter, hidden)), (f"{b}.ffn_up.weight", (inter, hidden)),
                (f"{b}.ffn_down.weight", (hidden, inter))]
    out.append(("output_norm.weight", (hidden,)))
    if not tied:
        out.append(("output.weight", (vocab, hidden)))
    return out


def write(shape_name: str, qtype: T, out: Path, seed: int = 0) -> Path:
    shape = SHAPES[shape_name]
    hidden, inter, layers, heads, kv_heads, head_dim, tied, theta = shape
    tok = tokenizer_fields(default_model_path())
    vocab = next(len(v) for k, v, _ in tok if k == "tokenizer.ggml.tokens")
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"synthetic-llama-{shape_name}")
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    w.add_file_type(int({T.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, T.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
                         T.F16: gguf.LlamaFileType.MOSTLY_F16}[qtype]))
    for key, value, vtype in tok:
        if isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    plan = tensors(shape, vocab)
    for name, shp in plan:
        if len(shp) == 1:
            w.add_tensor_info(name, shp, np.dtype(np.float32), shp[0] * 4)
        else:
            nbytes = shp[0] * shp[1] // gguf.GGML_QUANT_SIZES[qtype][0] * gguf.GGML_QUANT_SIZES[qtype][1]
            w.add_tensor_info(name, (shp[0], nbytes // shp[0]), np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shp in plan:
        if len(shp) == 1:
            w.write_tensor_data(np.ones(shp, dtype=np.float32))
            continue
        std = shp[1] ** -0.5  # activations keep their scale layer to layer
        parts = []
        for r0 in range(0, shp[0], ROWS_AT_ONCE):
            rows = (rng.standard_normal((min(ROWS_AT_ONCE, shp[0] - r0), shp[1]), dtype=np.float32) * std)
            parts.append(gguf.quants.quantize(rows, qtype) if qtype != T.F16 else rows.astype(np.float16))
        w.write_tensor_data(np.concatenate(parts).view(np.uint8).reshape(shp[0], -1))
    w.close()
    return out


def quantize_with_llama_cpp(src: Path, dst: Path, ftype: str) -> None:
    """llama.cpp's quantizer (in the peers' llama-cpp-python venv) from an F16 file."""
    code = ("import sys, llama_cpp as L; p = L.llama_model_quantize_default_params(); "
            f"p.ftype = L.LLAMA_FTYPE_{ftype}; p.nthread = 2; "
            "sys.exit(L.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
    if not PEERS_PYTHON.exists():
        raise SystemExit(f"{ftype} needs llama.cpp's quantizer: run benchmarks/peers/setup_peers.sh llamacpp first")
    subprocess.run([str(PEERS_PYTHON), "-c", code, str(src), str(dst)], check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--type", choices=[*WRITTEN, "Q4_K_M"], required=True)
    p.add_argument("--out", required=True, help="folder for the file (synthetic-llama-<shape>-<type>.gguf)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"synthetic-llama-{args.shape}-{args.type.lower()}.gguf"
    if args.type == "Q4_K_M":
        f16 = write(args.shape, T.F16, out / f"synthetic-llama-{args.shape}-f16.gguf", args.seed)
        quantize_with_llama_cpp(f16, target, "MOSTLY_Q4_K_M")
    else:
        write(args.shape, WRITTEN[args.type], target, args.seed)
    print(target, f"{target.stat().st_size / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
