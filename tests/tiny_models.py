"""Tiny random checkpoints written by transformers' save_pretrained, for the HF-folder path."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 320


def random_prompts(lengths, seed: int = 11) -> list[list[int]]:
    """Token-id prompts of the given lengths over the tiny vocabulary (ids 0-2 are specials)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """HF generate's n greedy tokens after `prompt` (no end token: exactly n)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def write_tokenizer(folder: Path) -> None:
    """A small byte-level BPE tokenizer.json trained in memory (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<eos>", "<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["The quick brown fox jumps over the lazy dog. " * 3, "def f(x):\n    return x * 2\n",
            "Paged attention stores keys and values in blocks."]
    tok.train_from_iterator(text, trainer)
    tok.save(str(folder / "tokenizer.json"))


def make_config(kind: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=2, eos_token_id=1, pad_token_id=0, initializer_range=0.1)
    if kind == "llama":
        return tf.LlamaConfig(**common, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})
    if kind == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32)
    if kind == "mistral":
        return tf.MistralConfig(**common, sliding_window=12)
    if kind == "gemma3":
        return tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 6}, head_dim=32, sliding_window=8,
                                   query_pre_attn_scalar=24, layer_types=["sliding_attention"] * 2 +
                                   ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"])
    if kind in ("deepseek_v3", "deepseek_v2"):  # MLA, dense MLPs only (every layer below first_k_dense_replace)
        cls = tf.DeepseekV3Config if kind == "deepseek_v3" else tf.DeepseekV2Config
        return cls(**{**common, "num_key_value_heads": 4}, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                   qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=3, rope_scaling=None)
    if kind == "bamba":  # Mamba2 layers around one attention layer; chunk 8 so prompts span several scan blocks
        return tf.BambaConfig(**{**common, "num_hidden_layers": 4}, attn_layer_indices=[1], mamba_n_heads=4,
                              mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                              mamba_chunk_size=8)
    if kind == "mixtral":
        return tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if kind == "qwen2_moe":  # layer 1 dense (mlp_only_layers), layers 0 and 2 MoE with a gated shared expert
        return tf.Qwen2MoeConfig(**common, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=64, mlp_only_layers=[1], norm_topk_prob=False)
    if kind == "qwen3_moe":  # q/k norms, no shared expert, renormalised top-k; layer 1 dense
        return tf.Qwen3MoeConfig(**common, head_dim=32, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                 mlp_only_layers=[1], norm_topk_prob=True)
    # layer 0 dense, layers 1 and 2 MoE with a shared expert; V2 routes within the best group of two experts
    # (topk_group 1, so the group limit changes choices), V3 within the best two groups (by each group's
    # two biased scores)
    if kind in ("deepseek_v2_moe", "deepseek_v3_moe"):
        v3 = kind == "deepseek_v3_moe"
        cls = tf.DeepseekV3Config if v3 else tf.DeepseekV2Config
        routing = (dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5) if v3 else
                   dict(topk_method="group_limited_greedy", n_group=4, topk_group=1, routed_scaling_factor=2.0))
        return cls(**{**common, "num_key_value_heads": 4}, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                   qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=1, rope_scaling=None,
                   n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                   **routing)
    raise ValueError(kind)


MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2_moe", "deepseek_v3_moe")


def _randomize_routers(model) -> None:
    """Random router weights and DeepSeek-V3 selection biases (HF may start them at zero: every
    expert would tie) and random expert weights wherever a parameter starts constant."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" not in n and p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.normal_(0, 0.1)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)


def make_model(kind: str, folder: Path, shard: bool = False, **overrides):
    """Write a random tiny model + tokenizer to `folder`; return the HF model (fp32, eval).
    `overrides`: config attributes to change (e.g. max_position_embeddings)."""
    import transformers as tf

    torch.manual_seed(1234)
    cfg = make_config(kind)
    for name, value in overrides.items():
        setattr(cfg, name, value)
    cls = tf.Gemma3ForCausalLM if kind == "gemma3" else tf.AutoModelForCausalLM
    model = cls.from_config(cfg) if cls is tf.AutoModelForCausalLM else cls(cfg)
    if kind == "gemma3":  # random norm deltas so the (1 + w) convention is exercised
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.normal_(0, 0.3)
    if kind.startswith("deepseek"):  # random norm weights so the latent norms are exercised
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.normal_(1, 0.3)
    if kind == "bamba":  # random decays, skips, time-step biases and norm gains, not HF's uniform init
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(("A_log", "dt_bias", "D")):
                    p.normal_(0, 0.5)
                elif "norm" in n:
                    p.normal_(1, 0.3)
    if kind in MOE_KINDS:
        _randomize_routers(model)
    model = model.float().eval()
    model.save_pretrained(folder, max_shard_size="60KB" if shard else "2GB")
    write_tokenizer(folder)
    return model
