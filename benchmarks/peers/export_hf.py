"""Write a GGUF's weights, dequantized to fp32 by HF transformers' GGUF reader, as an HF folder
(config.json + safetensors + tokenizer) for engines that read HF folders (vLLM).

    python benchmarks/peers/export_hf.py MODEL.gguf OUT_DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch


def export(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_plain(model, tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)  # only a complete folder gets the final name
    print(f"wrote {out}")


def save_plain(model, out: Path) -> None:
    """`save_pretrained` refuses a GGUF-loaded model ("quantized with gguf, not serializable"),
    although its weights are plain fp32 tensors by now: write them and the config directly."""
    from safetensors.torch import save_file

    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: the embedding is the head
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]  # absent after a GGUF load; vLLM picks the model class by it
    config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)


if __name__ == "__main__":
    export(Path(sys.argv[1]), Path(sys.argv[2]))
