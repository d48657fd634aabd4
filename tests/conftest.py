"""Shared fixtures. The Gemma model and the HF oracle are loaded once per session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.manual_seed(0)
if not torch.cuda.is_available():
    # The Triton kernels' tests run them through Triton's CPU interpreter, which Triton reads when
    # it is first imported: set before any test module imports a library that imports Triton
    # (compressed-tensors does).
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the oracle never reaches a hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# The test data: $KVSERVE_DATA (`make test` sets it), else shared/data beside the checkout, as CI
# lays it out. The product itself only ever reads the setting.
os.environ.setdefault("KVSERVE_DATA", str(Path(__file__).resolve().parents[2] / "shared" / "data"))
WIKITEXT = Path(os.environ["KVSERVE_DATA"]) / "wikitext2"
if not (WIKITEXT / "wiki.test.raw").is_file():
    raise FileNotFoundError(f"WikiText-2 not found at {WIKITEXT}; set KVSERVE_DATA to the folder holding wikitext2/")


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    from kvserve.loading.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def gemma(gemma_path):
    """Our Gemma 3 270M (fp32), loaded once."""
    from kvserve.loading import load_model

    return load_model(gemma_path)


@pytest.fixture(scope="session")
def hf_gemma(gemma_path):
    """HF transformers' Gemma 3 270M from the same GGUF: the reference oracle."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name, dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="session")
def hf_gemma_folder(hf_gemma, tmp_path_factory) -> Path:
    """The oracle's weights, as HF dequantized them, in an HF folder (config.json and
    model.safetensors): HF loads another dtype from it in under a second, where parsing the
    GGUF again takes ~35 s. Its bf16 load from here equals its bf16 load from the GGUF: every
    parameter and buffer, and the logits."""
    import json

    from safetensors.torch import save_model

    folder = tmp_path_factory.mktemp("hf_gemma")
    config = hf_gemma.config.to_dict()
    config.pop("quantization_config", None)  # (the GGUF it came from: HF would look for it)
    (folder / "config.json").write_text(json.dumps(config))
    save_model(hf_gemma, str(folder / "model.safetensors"))  # (the tied head stored once)
    return folder


@pytest.fixture(scope="session")
def gemma_gguf_reader(gemma_path):
    """gguf-py's reader of the bundled file (~15 s to open): the oracle of kvserve's own."""
    import gguf

    return gguf.GGUFReader(str(gemma_path))


@pytest.fixture(scope="session")
def hf_gemma_tokenizer(gemma_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name)


@pytest.fixture(scope="session")
def gemma_llm(gemma):
    """An LLM over the shared Gemma weights (engine state is cheap; weights are shared)."""
    from kvserve import LLM

    return LLM(loaded=gemma, kv_cache_gib=0.5)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-model tests (faster, and immune to a busy
    machine's spin waits); the previous setting is restored afterwards. Use it from an autouse
    fixture of the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
