"""Llama GGUF files, written the way llama.cpp's convert_hf_to_gguf.py writes LlamaForCausalLM
(q/k rows permuted for its interleaved RoPE, byte-level BPE vocabulary as tokenizer model "gpt2"),
must load in kvserve exactly as HF transformers loads the same file: same weights, same logits
at every position, same greedy tokens, same token ids.

Two files: all tensors F32 with a separate output matrix (pre-tokenizer "llama-bpe", as Llama 3
files have), and tied embeddings (no output.weight, as Llama 3.2 1B files) with every matrix Q8_0
and F32 norms (as `--outtype q8_0` writes; pre-tokenizer "default"). For the quantized one the
oracle is HF dequantizing the same file, not the original model.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.loading import gguf as kv_gguf
from kvserve.loading import load_model
from tests.logits import all_position_logits
from tests.tiny_models import VOCAB, write_tokenizer

ROPE_THETA = 50000.0  # not the 10k default, so the loader must read rope.freq_base
CASES = {"f32": ("F32", "llama-bpe", False), "q8_0_tied": ("Q8_0", "default", True)}  # qtype, pre, tied
TEXTS = ["The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x * 2\n",
         "  Paged   attention, ünïcödé & 12345 blocks!", "<eos> stays whole<bos>", ""]


def _tiny_llama(tied: bool = False):
    import transformers as tf

    torch.manual_seed(4321)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-5, rope_theta=ROPE_THETA, tie_word_embeddings=tied,
                         bos_token_id=2, eos_token_id=1, pad_token_id=0, initializer_range=0.1)
    assert cfg.rope_parameters.get("rope_type", "default") == "default"
    model = tf.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # non-trivial norms, so a misplaced norm tensor shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.2)
    return model


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: within each head, rows (half0, half1) become interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}


def _gguf_tensors(hf_name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, array) of one HF tensor: as named by _gguf_name, except a Mixtral layer's
    router (ffn_gate_inp) and its stacked experts, gate_up_proj [E, 2I, H] split into
    ffn_gate_exps / ffn_up_exps [E, I, H] and down_proj [E, H, I] as ffn_down_exps, as
    llama.cpp converts MixtralForCausalLM (and Qwen2MoeForCausalLM, with its shared expert)."""
    layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
    if ".mlp.shared_expert" in hf_name:  # Qwen2-MoE's shared expert; its gate [1, hidden] is a vector in GGUF
        if hf_name.endswith(".shared_expert_gate.weight"):
            return [(f"blk.{layer}.ffn_gate_inp_shexp.weight", data.reshape(-1))]
        proj = hf_name.rsplit(".", 2)[1].removesuffix("_proj")
        return [(f"blk.{layer}.ffn_{proj}_shexp.weight", data)]
    if hf_name.endswith(".mlp.gate.weight"):
        return [(f"blk.{layer}.ffn_gate_inp.weight", data)]
    if hf_name.endswith(".mlp.experts.gate_up_proj"):
        gate, up = np.split(data, 2, axis=1)
        return [(f"blk.{layer}.ffn_gate_exps.weight", gate), (f"blk.{layer}.ffn_up_exps.weight", up)]
    if hf_name.endswith(".mlp.experts.down_proj"):
        return [(f"blk.{layer}.ffn_down_exps.weight", data)]
    return [(_gguf_name(hf_name), data)]


def _gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if stem in top:
        return f"{top[stem]}.{kind}"
    _, _, layer, local = stem.split(".", 3)  # model.layers.N.<local>
    return f"blk.{layer}.{_GGUF_NAMES[local]}.{kind}"


def write_llama_gguf(model, tokenizer_json: Path, out: Path, qtype: str, pre: str,
                     chat_template: str | None = None, arch: str = "llama", name: str = "tiny-llama") -> None:
    """`arch` "qwen2" / "qwen3" / "qwen2moe" / "qwen3moe": those families as llama.cpp writes them (q/k rows not
    permuted; the MoE expert widths as their own keys). A llama3 rope scaling becomes the
    rope_freqs tensor, as llama.cpp writes Llama 3.1+."""
    import gguf

    cfg = model.config
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    quant = gguf.GGMLQuantizationType[qtype]
    ftype = gguf.LlamaFileType.ALL_F32 if qtype == "F32" else gguf.LlamaFileType.MOSTLY_Q8_0

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(int(ftype))
    w.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    w.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // n_head:  # (Qwen3)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope = cfg.rope_parameters
    if rope.get("rope_type", "default") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_freq_factors(rope, head_dim))
    if getattr(cfg, "num_local_experts", None):  # Mixtral, as llama.cpp writes it: a llama file with experts
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)

    # Vocabulary as llama.cpp's _set_vocab_gpt2: tokens by id, special added tokens CONTROL.
    tj = json.loads(tokenizer_json.read_text())
    vocab = tj["model"]["vocab"]
    special = {t["id"] for t in tj["added_tokens"] if t["special"]}
    by_id = {i: t for t, i in vocab.items()}
    assert sorted(by_id) == list(range(cfg.vocab_size))
    tokens = [by_id[i] for i in range(cfg.vocab_size)]
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(cfg.vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_pad_token_id(cfg.pad_token_id)
    w.add_add_bos_token(True)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        data = t.detach().float().numpy()
        if arch != "llama":
            pass  # (llama.cpp permutes q/k for llama only)
        elif name.endswith("q_proj.weight"):
            data = _llama_cpp_permute(data, n_head)
        elif name.endswith("k_proj.weight"):
            data = _llama_cpp_permute(data, n_kv)
        for gguf_name, part in _gguf_tensors(name, data):
            # 1-D tensors (norms) and the MoE router stay F32 (llama.cpp keeps ffn_gate_inp unquantized)
            if part.ndim >= 2 and quant != gguf.GGMLQuantizationType.F32 and ".ffn_gate_inp" not in gguf_name:
                w.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(part), quant), raw_dtype=quant)
            else:
                w.add_tensor(gguf_name, np.ascontiguousarray(part, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama3_freq_factors(rope: dict, head_dim: int) -> np.ndarray:
    """What each rotary frequency is divided by under HF's llama3 rule (f32 [head_dim / 2]), the
    values llama.cpp's converter stores as rope_freqs: 1 for short wavelengths, `factor` for long
    ones, a blend between."""
    freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    old, low, high, factor = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                              rope["high_freq_factor"], rope["factor"])
    smooth = (old / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, blended))
    return out.astype(np.float32)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, original HF model, gguf path, HF model from gguf, HF tokenizer, our LoadedModel, cache dir)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = request.param
    qtype, pre, tied = CASES[name]
    folder = tmp_path_factory.mktemp(f"gguf_{name}")
    cache = tmp_path_factory.mktemp(f"kvcache_{name}")
    write_tokenizer(folder)
    original = _tiny_llama(tied)
    path = folder / f"tiny-llama-{name}.gguf"
    write_llama_gguf(original, folder / "tokenizer.json", path, qtype, pre)
    (folder / "tokenizer.json").unlink()  # everything below must come from the .gguf alone

    hf = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=path.name, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=path.name)
    with pytest.MonkeyPatch.context() as mp:  # module-scoped, so not the function-scoped fixture
        mp.setenv("KVSERVE_CACHE", str(cache))
        loaded = load_model(path)
        yield name, original, path, hf, hf_tok, loaded, cache


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def test_gguf_file_is_what_llama_cpp_writes(case):
    import gguf

    name, original, path, *_ = case
    r = gguf.GGUFReader(str(path))
    assert r.fields["general.architecture"].contents() == "llama"
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert types["blk.1.attn_q.weight"] == types["token_embd.weight"] == CASES[name][0]
    assert ("output.weight" in types) == (not CASES[name][2])
    # The permutation is not the identity, so the loader really has to undo it.
    q = next(t for t in r.tensors if t.name == "blk.0.attn_q.weight")
    stored = gguf.quants.dequantize(q.data, q.tensor_type)
    hf_q = original.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert stored.shape == hf_q.shape and not np.allclose(stored, hf_q, atol=0.05)


def test_cache_entry_under_kvserve_cache(case):
    *_, loaded, cache = case
    entries = list((cache / "gguf").iterdir())
    assert len(entries) == 1
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in entries[0].iterdir()}


def test_config_from_metadata(case):
    _, original, _, hf, _, loaded, _ = case
    c, o = loaded.config, original.config
    assert (c.family, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == \
        ("llama", o.vocab_size, o.hidden_size, o.intermediate_size, o.num_hidden_layers)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, 16)
    assert c.rms_norm_eps == pytest.approx(o.rms_norm_eps)
    assert c.max_position_embeddings == o.max_position_embeddings
    assert c.tie_word_embeddings == o.tie_word_embeddings == hf.config.tie_word_embeddings
    assert c.bos_token_id == 2 and c.eos_token_ids == [1] and c.pad_token_id == 0
    assert [r.theta for r in c.rope.values()] == [ROPE_THETA]
    assert c.attn_scale == pytest.approx(16**-0.5)
    assert hf.config.rope_parameters["rope_theta"] == ROPE_THETA


def test_weights_equal_hf(case):
    name, original, _, hf, _, loaded, _ = case
    ours = loaded.model.state_dict()
    theirs = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    if loaded.config.tie_word_embeddings:  # HF lists the tied head; we hold the embedding only
        assert torch.equal(theirs.pop("lm_head.weight"), ours["embed_tokens.weight"])
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        assert torch.equal(ours[k], v), f"{name}: {k} differs from HF's"
    if name == "f32":  # our writer's permutation is llama.cpp's: HF's un-permute recovers the original
        for k, v in original.state_dict().items():
            assert torch.equal(hf.state_dict()[k], v), k


def test_prompt_logits_match_hf(case):
    name, _, _, hf, _, loaded, _ = case
    ids = _prompt(7, 40)
    ours = all_position_logits(loaded, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape == (40, VOCAB)
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-4, f"{name}: max abs logit diff {diff}"


def test_greedy_matches_hf_generate(case):
    name, _, path, hf, hf_tok, _, _ = case
    llm = LLM(str(path), kv_cache_gib=0.01)  # a second load: reads the cache entry
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    text = "The quick brown fox"
    prompts = [_prompt(11, 5), _prompt(12, 23), text]
    outs = llm.generate(prompts, params)
    for p, out in zip(prompts, outs):
        ids = hf_tok(p).input_ids if isinstance(p, str) else p
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=16, min_new_tokens=16, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, len(ids):].tolist(), f"{name}: {p!r}"


def test_tokenizer_matches_hf(case):
    name, _, _, _, hf_tok, loaded, _ = case
    tok = loaded.tokenizer
    # HF's GPT2Tokenizer adds its default "<|endoftext|>" when the vocabulary lacks it (id VOCAB, past
    # the model's rows); the converted tokenizer.json carries the same extra entry.
    assert tok.vocab_size == len(hf_tok) >= VOCAB
    for text in TEXTS:
        ids = hf_tok(text).input_ids
        assert ids[0] == 2, "add_bos_token in the GGUF: both sides prepend <bos>"
        assert tok.encode(text) == ids, f"{name}: {text!r}"
        assert tok.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False).input_ids
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.encode("<eos>", add_special_tokens=False) == [1]  # a CONTROL token stays whole


def test_without_unpermute_logits_differ(case, tmp_path, monkeypatch):
    """The logits test above is sensitive to the q/k un-permute: skipping it breaks the match."""
    name, _, path, hf, _, _, _ = case
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))  # a fresh conversion, not the cached one
    monkeypatch.setattr(kv_gguf, "_unpermute_rope", lambda w, n_heads: w)
    broken = load_model(path)
    ids = _prompt(7, 40)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    diff = (all_position_logits(broken, ids) - ref).abs().max().item()
    assert diff > 1e-2, f"{name}: still matched without the un-permute ({diff})"


def test_tokenizer_json_beside_gguf_is_ignored(case, tmp_path, monkeypatch):
    """The tokenizer comes from the GGUF's own vocabulary even when a different tokenizer.json
    lies in the same folder (transformers would otherwise pick that file up)."""
    name, _, path, _, hf_tok, _, _ = case
    folder = tmp_path / "with_decoy"
    folder.mkdir()
    copy = folder / path.name
    copy.symlink_to(path)
    from tokenizers import Tokenizer, models, pre_tokenizers

    decoy = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1}, unk_token="[UNK]"))
    decoy.pre_tokenizer = pre_tokenizers.Whitespace()
    decoy.save(str(folder / "tokenizer.json"))
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "cache"))
    loaded = load_model(copy)
    assert loaded.tokenizer.encode(TEXTS[0]) == hf_tok(TEXTS[0]).input_ids, name


def test_text_encoding_past_embedding_is_a_clear_error(case, monkeypatch):
    """The converted byte-level tokenizer knows <|endoftext|> at id VOCAB, one past the model's
    embedding: a prompt containing it is rejected with a message, not an IndexError."""
    from kvserve import LLM, SamplingParams

    name, _, path, _, _, loaded, cache = case
    if loaded.tokenizer.token_to_id("<|endoftext|>") is None:
        pytest.skip("this tokenizer has no extra token past the embedding")
    llm = LLM(loaded=loaded, kv_cache_gib=0.01)
    with pytest.raises(ValueError, match="does not have"):
        llm.generate("hello <|endoftext|>", SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()


def test_gguf_blocks_load_as_the_files_blocks_and_compute_what_the_float_load_does(case, monkeypatch):
    """load_model(gguf_blocks=True): every matrix a GGMLLinear over the file's bytes (the tied
    head and the embedding one table), no fp32 weights cached, logits those of the fp32 load of
    the same file to fp32 summation-order rounding with float activations, greedy tokens equal;
    with int8 activations (the default) close to them."""
    from kvserve.weights.embedding import QuantEmbedding
    from kvserve.weights.ggml import GGMLLinear

    name, _, path, _, _, loaded, cache = case
    monkeypatch.setenv("KVSERVE_CACHE", str(cache))
    blocks = load_model(path, gguf_blocks=True, gguf_activations="float")
    model = blocks.model
    assert blocks.config == loaded.config
    linears = [m for m in model.modules() if isinstance(m, GGMLLinear)]
    tied = blocks.config.tie_word_embeddings
    assert len(linears) == 7 * 2 + 1 + (not tied)  # q k v o gate up down per layer, the head, an untied table
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.tied == tied
    want = loaded.model.layers[1].self_attn.q_proj.weight  # the un-permuted rows, dequantized by gguf
    assert torch.equal(model.layers[1].self_attn.q_proj.dequantized_weight(), want)
    # Float tensors in the model are the norms alone (weights stay bytes).
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for n, p in loaded.model.named_parameters() if "norm" in n)
    ids = _prompt(7, 40)
    ours, ref = all_position_logits(blocks, ids), all_position_logits(loaded, ids)
    assert (ours - ref).abs().max().item() < 1e-4
    int8 = all_position_logits(load_model(path, gguf_blocks=True), ids)
    kl = (ref.log_softmax(-1).exp() * (ref.log_softmax(-1) - int8.log_softmax(-1))).sum(-1)
    assert kl.max() < 3e-3  # measured at most 3e-4 (the Q8_0 file)
    entry = next((cache / "gguf").iterdir())
    assert (entry / "tensors.json").exists()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [_prompt(11, 5), _prompt(12, 23)]
    got = [o.outputs[0].token_ids for o in LLM(str(path), weights="gguf", gguf_activations="float",
                                                       kv_cache_gib=0.01).generate(prompts, params)]
    ref_tokens = [o.outputs[0].token_ids for o in LLM(loaded=loaded, kv_cache_gib=0.01).generate(prompts, params)]
    assert got == ref_tokens


def test_gguf_blocks_refusals_name_the_problem(case):
    from kvserve import EngineConfig

    _, _, path, _, _, loaded, _ = case
    with pytest.raises(ValueError, match="model must be a .gguf file"):
        EngineConfig(model="/some/hf_folder", weights="gguf")
    with pytest.raises(ValueError, match="not a model loaded as floats"):
        LLM(loaded=loaded, weights="gguf")
    with pytest.raises(ValueError, match="device must be 'cpu'"):
        EngineConfig(model=str(path), weights="gguf", device="cuda")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_gguf_blocks_are_read_into_own_memory_unless_mmap(case, monkeypatch):
    """By default every matrix's bytes are read into the process's own memory (not the file's
    mapping: 2 MB pages can back them), byte for byte the file's; with gguf_mmap they are the
    mapped file's pages. The same bytes compute the same logits."""
    import gguf

    from tests.test_host_memory import _mapping_of

    name, _, path, _, _, _, cache = case
    monkeypatch.setenv("KVSERVE_CACHE", str(cache))
    own = load_model(path, gguf_blocks=True)
    mapped = load_model(path, gguf_blocks=True, gguf_mmap=True)
    q_own, q_mapped = (m.model.layers[1].self_attn.q_proj.raw for m in (own, mapped))
    assert _mapping_of(q_own.data_ptr()) != str(path)
    assert _mapping_of(q_mapped.data_ptr()) == str(path)
    stored = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.1.attn_q.weight")
    assert q_own.numpy().tobytes() == np.asarray(stored.data).tobytes() == q_mapped.numpy().tobytes()
    ids = _prompt(7, 40)
    assert torch.equal(all_position_logits(own, ids), all_position_logits(mapped, ids))
