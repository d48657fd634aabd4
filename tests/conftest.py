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


def _oracle_cache(gemma_path: Path) -> Path:
    """Where HF's own conversion of the bundled GGUF is kept between sessions: parsing and
    dequantizing the GGUF takes HF ~35 s for the model and ~16 s for the tokenizer, loading what
    it made from safetensors and tokenizer.json about a second. Keyed by the file's size and
    mtime and by transformers' version; $KVSERVE_TEST_CACHE moves it."""
    import transformers

    st = gemma_path.stat()
    root = Path(os.environ.get("KVSERVE_TEST_CACHE", Path.home() / ".cache" / "kvserve-tests"))
    return root / f"hf-gemma-{st.st_size}-{int(st.st_mtime)}-transformers-{transformers.__version__}"


def _publish(folder: Path, write) -> Path:
    """`write(tmp)` fills a new folder that then appears at `folder` whole (a rename), so an
    interrupted session leaves nothing half-written for the next one to load."""
    import shutil

    from kvserve.loading.cache import temp_sibling

    tmp = temp_sibling(folder)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        tmp.rename(folder)
    except OSError:
        if not folder.is_dir():  # (another session publishing the same folder first is fine)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


@pytest.fixture(scope="session")
def hf_gemma_folder(gemma_path) -> Path:
    """HF transformers' Gemma 3 270M as HF reads it from the bundled GGUF (fp32, dequantized by
    HF), saved as an HF folder (config.json, generation_config.json, model.safetensors): the
    oracle's weights. HF loads any dtype from it in about a second, and what it loads equals its
    load from the GGUF: every parameter and buffer, and the logits."""
    folder = _oracle_cache(gemma_path) / "model"
    if (folder / "model.safetensors").is_file():
        return folder

    def write(tmp: Path) -> None:
        import json

        from safetensors.torch import save_model
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name,
                                                 dtype=torch.float32)
        config = m.config.to_dict()
        config.pop("quantization_config", None)  # (the GGUF it came from: HF would look for it)
        (tmp / "config.json").write_text(json.dumps(config))
        m.generation_config.save_pretrained(tmp)
        save_model(m, str(tmp / "model.safetensors"))  # (the tied head stored once)

    return _publish(folder, write)


@pytest.fixture(scope="session")
def hf_gemma(hf_gemma_folder):
    """HF transformers' Gemma 3 270M from the same GGUF (fp32): the reference oracle."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_gemma_folder), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def gemma_gguf_reader(gemma_path):
    """gguf-py's reader of the bundled file (~15 s to open): the oracle of kvserve's own."""
    import gguf

    return gguf.GGUFReader(str(gemma_path))


@pytest.fixture(scope="session")
def hf_gemma_tokenizer(gemma_path):
    """HF transformers' tokenizer as HF converts it from the bundled GGUF, saved once
    (tokenizer.json and its config) and loaded from there. The BOS / EOS flags, which HF's
    saving leaves out, are kept beside it and passed back."""
    import json

    from transformers import AutoTokenizer

    folder = _oracle_cache(gemma_path) / "tokenizer"
    if not (folder / "flags.json").is_file():
        tok = AutoTokenizer.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name)

        def write(tmp: Path) -> None:
            tok.save_pretrained(tmp)
            flags = {"add_bos_token": tok.add_bos_token, "add_eos_token": tok.add_eos_token}
            (tmp / "flags.json").write_text(json.dumps(flags))

        _publish(folder, write)
    return AutoTokenizer.from_pretrained(str(folder), **json.loads((folder / "flags.json").read_text()))


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
