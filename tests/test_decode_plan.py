"""A small step's layers in one C call (kvserve/accel/decode_plan.py, kvserve/kernels/decode_step.c)
compute bitwise what the Python path computes: same tokens and same log-probabilities, on fp32
panels, on the int8 / int4 kernels and on GGUF blocks, with sliding-window layers, for Gemma 3 and
the Llama family, after the weights change under it, and for steps of several rows (decode
batches, speculative verification chunks, both at once)."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams, kernels
from kvserve.accel.decode_plan import DecodePlan, plan_for

pytestmark = pytest.mark.skipif(kernels.kernel_lib("decode_step") is None, reason="no C compiler")

PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)


class _Spy:
    """Counts the steps the plan ran; `off` sends every step down the Python path."""

    def __init__(self, monkeypatch):
        self.runs, self.off = 0, False
        self.steps: list[tuple[int, int, int]] = []  # (rows, chunks, decode rows) of each run, group 0
        run, applies = DecodePlan.run, DecodePlan.applies

        def counted(plan, h, cos_sin, meta):
            self.runs += 1
            g = meta.for_group(0)
            self.steps.append((h.shape[0], len(g.seqs), 0 if g.decode is None else g.decode.rows.shape[0]))
            return run(plan, h, cos_sin, meta)

        monkeypatch.setattr(DecodePlan, "run", counted)
        monkeypatch.setattr(DecodePlan, "applies", staticmethod(lambda h, meta: not self.off and applies(h, meta)))


def _generate(llm: LLM, prompt) -> tuple[list[int], list[float]]:
    out = llm.generate(prompt, PARAMS)[0].outputs[0]
    return out.token_ids, out.logprobs


def _plan_equals_python_path(llm: LLM, prompt, spy: _Spy) -> tuple[list[int], list[float]]:
    """Greedy tokens and log-probabilities with the plan on every decode step, then bitwise the
    same with every step on the Python path; returns them."""
    got = _generate(llm, prompt)
    assert spy.runs == PARAMS.max_tokens - 1  # every decode step (the first token comes from the prefill)
    spy.off = True
    assert _generate(llm, prompt) == got  # bitwise
    assert spy.runs == PARAMS.max_tokens - 1
    spy.off = False
    return got


@pytest.mark.parametrize("weights", ["float", "int8", "int4"])
def test_plan_equals_the_python_path_on_gemma(gemma, monkeypatch, weights):
    spy = _Spy(monkeypatch)
    llm = LLM(loaded=gemma, weights=weights, kv_cache_gib=0.25, max_num_seqs=1, enable_prefix_caching=False)
    _plan_equals_python_path(llm, "The history of the printing press begins", spy)


@pytest.mark.parametrize("activations", ["int8", "float"])
def test_plan_equals_the_python_path_on_gguf_blocks(gemma_path, monkeypatch, activations):
    """The file's own blocks (q/k/v and gate/up as separate GGUF matrices of mixed types), with
    int8 or float activations."""
    spy = _Spy(monkeypatch)
    llm = LLM(model=str(gemma_path), weights="gguf", gguf_activations=activations, kv_cache_gib=0.25,
              max_num_seqs=1, enable_prefix_caching=False)
    prompt = "The history of the printing press begins"
    _plan_equals_python_path(llm, prompt, spy)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    from kvserve.loading import load_model
    from tests.tiny_models import make_model

    folder = tmp_path_factory.mktemp("tiny-gemma3-plan")
    make_model("gemma3", folder)  # 6 layers (2 full, 4 sliding), window 8, 2 KV heads
    return load_model(folder)


@pytest.mark.parametrize("release", [True, False])
def test_plan_follows_sliding_windows_and_rebuilds_after_changes(tiny_gemma3, monkeypatch, release):
    spy = _Spy(monkeypatch)
    llm = LLM(loaded=tiny_gemma3, kv_cache_gib=0.01, block_size=4, max_num_seqs=1, enable_prefix_caching=False,
              sliding_window_release=release)
    prompt = [2] + [(7 * j) % 300 + 3 for j in range(30)]  # past the window of 8: windows slide every step
    got = _plan_equals_python_path(llm, prompt, spy)

    model = llm.engine.loaded.model
    plan = plan_for(model, llm.engine.runner.kv_cache)
    assert plan is not None and plan.current()
    with torch.no_grad():
        model.layers[3].pre_feedforward_layernorm.weight.add_(0.5)  # in place: the packed gains go stale
        model.layers[1].mlp.down_proj.weight.mul_(-1.0)  # and a packed projection
    assert not plan.current()
    changed = _generate(llm, prompt)
    assert plan_for(model, llm.engine.runner.kv_cache) is not plan  # rebuilt
    spy.off = True
    assert _generate(llm, prompt) == changed != got

    # A weight replaced by assignment (not changed in place) makes the plan stale too.
    plan = plan_for(model, llm.engine.runner.kv_cache)
    assert plan is not None and plan.current()
    norm = model.layers[2].input_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone())
    assert not plan.current()


@pytest.mark.parametrize("kind, weights", [("llama", "float"), ("llama", "int8"), ("qwen3", "float"),
                                           ("mistral", "int4")])
def test_plan_equals_the_python_path_on_llama_family(tmp_path, monkeypatch, kind, weights):
    """Pre-norm layers with SwiGLU (no post norms), llama3 RoPE scaling, Qwen3's q/k norms,
    Mistral's sliding window."""
    from kvserve.loading import load_model
    from tests.tiny_models import make_model

    make_model(kind, tmp_path / kind, intermediate_size=256)  # int4's kernel: rows a multiple of its tile
    spy = _Spy(monkeypatch)
    llm = LLM(loaded=load_model(tmp_path / kind), weights=weights, kv_cache_gib=0.01, block_size=4, max_num_seqs=1,
              enable_prefix_caching=False)
    prompt = [2] + [(5 * j) % 300 + 3 for j in range(20)]  # past Mistral's window of 12
    _plan_equals_python_path(llm, prompt, spy)


@pytest.mark.parametrize("kind, dtype", [("llama", torch.bfloat16), ("gemma3", torch.float16)])
def test_plan_equals_the_python_path_on_16bit_weights(tmp_path, monkeypatch, kind, dtype):
    """A bf16 / fp16 checkpoint under dtype auto: its matrices stay 16-bit (HalfLinear) and the
    plan widens them in the same kernel the Python path calls."""
    from kvserve.loading import load_model
    from kvserve.weights.half import HalfLinear
    from tests.tiny_models import make_model

    make_model(kind, tmp_path).to(dtype).save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="auto")
    assert any(isinstance(m, HalfLinear) for m in loaded.model.modules())
    spy = _Spy(monkeypatch)
    llm = LLM(loaded=loaded, kv_cache_gib=0.01, block_size=4, max_num_seqs=1, enable_prefix_caching=False)
    prompt = [2] + [(11 * j) % 300 + 3 for j in range(14)]
    _plan_equals_python_path(llm, prompt, spy)


def test_plan_equals_the_python_path_on_llama_gguf_blocks(tmp_path, monkeypatch):
    from tests.test_gguf_llama import _tiny_llama, write_llama_gguf
    from tests.tiny_models import write_tokenizer

    write_tokenizer(tmp_path)
    path = tmp_path / "tiny-llama-q8_0.gguf"
    write_llama_gguf(_tiny_llama(), tmp_path / "tokenizer.json", path, "Q8_0", "default")
    spy = _Spy(monkeypatch)
    llm = LLM(model=str(path), weights="gguf", kv_cache_gib=0.01, max_num_seqs=1, enable_prefix_caching=False)
    prompt = [2] + [(3 * j) % 300 + 3 for j in range(12)]
    _plan_equals_python_path(llm, prompt, spy)


def test_models_the_loop_does_not_run_take_the_python_path(tiny_gemma3, tmp_path):
    from kvserve.loading import load_model
    from tests.tiny_models import make_model

    make_model("qwen2", tmp_path / "qwen2")  # q/k/v biases
    qwen2 = LLM(loaded=load_model(tmp_path / "qwen2"), kv_cache_gib=0.01, max_num_seqs=1)
    assert plan_for(qwen2.engine.loaded.model, qwen2.engine.runner.kv_cache) is None
    int8_pool = LLM(loaded=tiny_gemma3, kv_cache_gib=0.01, kv_cache_dtype="int8", max_num_seqs=1)
    assert plan_for(int8_pool.engine.loaded.model, int8_pool.engine.runner.kv_cache) is None
    # A model nobody packed: its projections are plain nn.Linear.
    unpacked = LLM(loaded=load_model(tiny_gemma3.source), kv_cache_gib=0.01, max_num_seqs=1, pack_weights=False)
    assert plan_for(unpacked.engine.loaded.model, unpacked.engine.runner.kv_cache) is None


def _both_paths(llm: LLM, prompts: list, params: SamplingParams, spy: _Spy) -> list[tuple[list[int], list]]:
    """Every request's tokens and log-probabilities with the plan, then bitwise the same with every
    step on the Python path; returns them."""
    def run():
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]

    got = run()
    spy.off = True
    assert run() == got
    spy.off = False
    return got


@pytest.mark.parametrize("source", ["float", "gguf"])
def test_plan_takes_speculative_verification_chunks(gemma, gemma_path, monkeypatch, source):
    """An n-gram draft's k + 1 rows of one sequence: the prefill kernel's causal chunk inside the loop."""
    spy = _Spy(monkeypatch)
    model = dict(loaded=gemma, weights="float") if source == "float" else dict(model=str(gemma_path), weights="gguf")
    llm = LLM(**model, kv_cache_gib=0.25, max_num_seqs=1, enable_prefix_caching=False, speculative="ngram",
              num_speculative_tokens=4)
    prompt = "one two three four five one two three four five one two three four five one two"
    _both_paths(llm, [prompt], PARAMS, spy)
    assert any(rows > 1 and chunks == 1 and dec == 0 for rows, chunks, dec in spy.steps)


def test_plan_takes_small_decode_batches(gemma, monkeypatch):
    spy = _Spy(monkeypatch)
    llm = LLM(loaded=gemma, weights="int8", kv_cache_gib=0.25, max_num_seqs=4, enable_prefix_caching=False)
    prompts = ["The history of the printing press begins", "A recipe for bread:", "Rivers of Europe include"]
    _both_paths(llm, prompts, PARAMS, spy)
    assert any(rows == dec == 3 and chunks == 0 for rows, chunks, dec in spy.steps)


@pytest.mark.parametrize("release", [True, False])
def test_plan_takes_chunks_beside_decode_rows_in_sliding_windows(tiny_gemma3, monkeypatch, release):
    """Two sequences, one drafting (a chunk) and one not (a decode row) in the same step, both past
    the window of 8, with sliding blocks released or kept: decode rows gathered from among the
    chunk's rows."""
    spy = _Spy(monkeypatch)
    llm = LLM(loaded=tiny_gemma3, kv_cache_gib=0.01, block_size=4, max_num_seqs=2, enable_prefix_caching=False,
              sliding_window_release=release, speculative="ngram", num_speculative_tokens=3)
    periodic = [2] + [3 + j % 5 for j in range(30)]
    plain = [2] + [(7 * j) % 300 + 3 for j in range(25)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    _both_paths(llm, [periodic, plain], params, spy)
    assert any(chunks >= 1 and dec >= 1 for _, chunks, dec in spy.steps)
