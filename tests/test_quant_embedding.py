"""The token-embedding lookup from low-bit codes (kvserve/weights/embedding.py): rows read straight
from the packed layouts equal the dequantized table, a tied model's lookup shares the quantized
head, and both forms save and load back bitwise."""
from __future__ import annotations

import pytest
import torch

from kvserve.compress.quant import QuantSpec, quantize_model
from kvserve.compress.quant.apply import model_weight_bytes
from kvserve.loading import load_model
from kvserve.loading.quantized import save_quantized
from kvserve.weights.embedding import QuantEmbedding
from kvserve.weights.linear import QuantLinear
from kvserve.weights.packing import cpu_int4_pack, cpu_int4_rows, from_cpu_int4_layout
from kvserve.weights.rtn import quantize_rtn
from tests.logits import all_position_logits

IDS = [2, 5, 17, 40, 3, 99, 250, 7, 11, 64, 128, 300, 1, 42, 8, 19, 23]
SHAPE = dict(hidden_size=128, intermediate_size=256, head_dim=32)


@pytest.mark.parametrize("n", [16, 48, 64, 80, 192])
def test_int4_rows_of_the_tiled_layout(n):
    """Full 64-row tiles and the short last tile alike."""
    g = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 16, (n, 96), generator=g, dtype=torch.int32)
    packed = cpu_int4_pack(codes)
    rows = torch.tensor([0, n - 1, n // 2, 1, n - 2, 31 % n, 32 % n, 63 % n, 5 % n])
    assert torch.equal(cpu_int4_rows(packed, rows), codes[rows])
    assert torch.equal(from_cpu_int4_layout(packed)[rows], codes[rows])


@pytest.mark.parametrize("spec,kernel", [
    (QuantSpec(bits=4, sym=False, granularity="group", group_size=32), "int4"),
    (QuantSpec(bits=4, sym=True, granularity="channel"), "int4"),
    (QuantSpec(bits=8, sym=True, granularity="channel"), "int8"),
    (QuantSpec(bits=8, sym=False, granularity="channel"), "int8"),
    (QuantSpec(bits=6, sym=False, granularity="group", group_size=32), "dequant"),
])
def test_dequantized_rows_equal_the_dequantized_weight(spec, kernel):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(80, 64, generator=g)
    layer = QuantLinear.from_quantized(quantize_rtn(w, spec), kernel=kernel)
    assert layer.kernel == kernel
    rows = torch.tensor([3, 79, 0, 64, 65, 3])
    assert torch.equal(layer.dequantized_rows(rows), layer.dequantized_weight()[rows])


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from tests.tiny_models import make_model

    root = tmp_path_factory.mktemp("quant_emb")
    for kind in ("llama", "gemma3"):
        make_model(kind, root / kind, **SHAPE)
    return root


@pytest.mark.parametrize("kind", ["gemma3", "llama"])
def test_quantized_lookup_matches_a_float_table_of_the_same_codes(sources, kind):
    tied = kind == "gemma3"
    loaded = load_model(sources / kind)
    model = loaded.model
    before = model_weight_bytes(model)
    quantize_model(model, "rtn", bits=4, group_size=128, lm_head=True, progress=False)
    with_float_table = model_weight_bytes(model)
    report = quantize_model(model, "rtn", bits=4, group_size=128, skip=["layers."], embedding=True,
                            lm_head=False, progress=False) if not tied else None
    if tied:  # quantize_model(embedding=True) on an already quantized head: add the lookup alone
        from kvserve.weights.quantize import _quantize_embedding
        from kvserve.weights.rtn import RTNQuantizer

        entry = _quantize_embedding(model, True, model.lm_head.spec, RTNQuantizer(model.lm_head.spec),
                                    torch.bfloat16, "auto")
    else:
        entry = report.layers[-1]
    assert entry.name == "embed_tokens"
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.tied == tied
    table = model.embed_tokens.source
    assert (table is model.lm_head) == tied
    after = model_weight_bytes(model)
    got = all_position_logits(loaded, IDS)
    # Oracle: a float table holding exactly the dequantized codes the lookup reads.
    model.embed_tokens = torch.nn.Embedding.from_pretrained(table.dequantized_weight(), freeze=True)
    assert torch.equal(got, all_position_logits(loaded, IDS))
    # Bytes: a tied table is freed (shared with the head); an untied one shrinks to its codes.
    table_fp32 = loaded.config.vocab_size * loaded.config.hidden_size * 4
    assert after == with_float_table - table_fp32 + (0 if tied else table.weight_nbytes)
    assert entry.bytes_after == (0 if tied else table.weight_nbytes)
    assert after < before * 0.3, (after, before)


def test_tied_embedding_needs_the_head(sources):
    loaded = load_model(sources / "gemma3")
    with pytest.raises(ValueError, match="lm_head=True"):
        quantize_model(loaded.model, "rtn", bits=4, embedding=True, progress=False)


@pytest.mark.parametrize("kind", ["gemma3", "llama"])
def test_quantized_embedding_round_trips_through_a_folder(sources, tmp_path, kind):
    loaded = load_model(sources / kind)
    quantize_model(loaded.model, "rtn", bits=4, group_size=128, lm_head=True, embedding=True, progress=False)
    want = all_position_logits(loaded, IDS)
    out = save_quantized(loaded, tmp_path / "q")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as st:
        keys = set(st.keys())
        # The compressed-tensors layout has no sharing: a tied table is stored as its own module,
        # the same codes as the head's (loading shares them again).
        assert ("lm_head.weight_packed" in keys) and "model.embed_tokens.weight_packed" in keys
        same = torch.equal(st.get_tensor("lm_head.weight_packed"), st.get_tensor("model.embed_tokens.weight_packed"))
        assert same == (kind == "gemma3")
    assert "model.embed_tokens.weight" not in keys
    back = load_model(out)
    assert isinstance(back.model.embed_tokens, QuantEmbedding)
    assert back.model.embed_tokens.tied == (kind == "gemma3")
    if kind == "gemma3":
        assert back.model.embed_tokens.source is back.model.lm_head
    assert torch.equal(all_position_logits(back, IDS), want)
    with pytest.raises(IndexError, match="out of range"):
        back.model.embed_tokens(torch.tensor([loaded.config.vocab_size]))
