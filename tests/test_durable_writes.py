"""Nothing lost on disk: a model folder is written beside its destination and moved in when
complete (an interrupted save leaves the old folder as it was; weights of an earlier sharded save
cannot shadow new ones; the source folder is never the destination), two processes converting one
GGUF at once both succeed, a corrupt cached kernel is rebuilt, and a training checkpoint that is not
plain tensors and values is refused by name."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.loading import load_model
from kvserve.loading import save as save_module
from kvserve.loading.cache import temp_sibling
from kvserve.loading.save import save_model
from tests.test_gguf_llama import _tiny_llama, write_llama_gguf
from tests.tiny_models import make_model, write_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("durable_src")
    make_model("llama", folder)
    return load_model(folder)


def _digest(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def test_an_interrupted_save_leaves_the_old_folder(tiny, tmp_path, monkeypatch):
    out = save_model(tiny, tmp_path / "out")
    before = _digest(out)
    real = save_module.save_file

    def half_then_interrupt(tensors, path, metadata=None):
        Path(path).write_bytes(b"half a file")  # the weights were being written: then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(save_module, "save_file", half_then_interrupt)  # the name save.py calls
    with pytest.raises(KeyboardInterrupt):
        save_model(tiny, out, dtype=torch.bfloat16)
    monkeypatch.setattr(save_module, "save_file", real)
    assert _digest(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the staging sibling is gone too
    assert load_model(out).config == tiny.config


def test_stale_sharded_weights_never_shadow_a_new_save(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors.index.json").write_text('{"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}')
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old shard")
    (out / "notes.txt").write_text("mine")  # a file of the user's stays
    save_model(tiny, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "notes.txt", "tokenizer.json"])
    again = load_model(out)
    assert torch.equal(again.model.norm.weight, tiny.model.norm.weight)


def test_the_source_folder_is_never_the_destination(tmp_path):
    make_model("llama", tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    before = _digest(tmp_path / "m")
    with pytest.raises(ValueError, match="is the source folder"):
        save_model(loaded, tmp_path / "m")
    assert _digest(tmp_path / "m") == before


def test_temporary_names_are_private():
    p = Path("/x/model.safetensors")
    assert temp_sibling(p) != temp_sibling(p) and temp_sibling(p).parent == p.parent


def test_two_processes_convert_one_gguf_at_once(tmp_path):
    write_tokenizer(tmp_path)
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(_tiny_llama(False), tmp_path / "tokenizer.json", path, "F32", "default")
    (tmp_path / "tokenizer.json").unlink()
    env = {**os.environ, "KVSERVE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    code = ("import sys; from kvserve.loading import load_model; m = load_model(sys.argv[1]); "
            "print(m.config.num_layers)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    entry = next((tmp_path / "cache" / "gguf").iterdir())
    assert sorted(f.name for f in entry.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_a_corrupt_cached_kernel_is_rebuilt(tmp_path):
    env = {**os.environ, "KVSERVE_CACHE": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("KVSERVE_NO_KERNELS", None)
    code = ("import torch; from kvserve import kernels; "
            "x = torch.randn(3, 64); g = torch.rand(64); "
            "y = kernels.rms_norm(x, g, 1e-6); assert y is not None, 'the kernel was not used'; "
            "ref = torch.nn.functional.rms_norm(x, (64,), g, 1e-6); "
            "torch.testing.assert_close(y, ref); print('ok')")
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if "no C compiler" in first.stderr:
        pytest.fail("the kernels need a C compiler (make test installs one)")
    assert first.returncode == 0, first.stderr
    so = next((tmp_path / "kernels").glob("rms_norm-*.so"))
    size = so.stat().st_size
    so.write_bytes(so.read_bytes()[:200])  # truncated, as a full disk or a kill mid-copy leaves it
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and "ok" in second.stdout, second.stderr
    assert "rebuilding" in second.stderr and so.stat().st_size == size


def test_a_checkpoint_that_is_not_plain_data_is_refused(tmp_path):
    from kvserve.compress.train.loop import TrainConfig, _resume

    ckpt = tmp_path / "ckpt.pt"
    torch.save({"config": {}, "payload": Path("/etc")}, ckpt)  # an arbitrary object: loading it would unpickle
    with pytest.raises(ValueError, match=f"checkpoint {ckpt}: cannot be read"):
        _resume(ckpt, TrainConfig(steps=1), [], [], "", None)
