"""HF model folders: config.json + *.safetensors (sharded or not) + tokenizer.json."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from kvserve.loading.errors import ModelLoadError
from kvserve.loading.tensors import TensorFiles
from kvserve.model.config import FULL, MAMBA, SLIDING, ModelConfig, MoEConfig, RopeConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "deepseek_v2", "deepseek_v3",
                         "mixtral", "qwen2_moe", "qwen3_moe", "bamba")
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
# Per model type: (pattern, replacement) of HF tensor names (after "model.") to ours.
_RENAMES = {
    "mixtral": ((re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate."),
                (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
                (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
                (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj.")),
    "qwen2_moe": ((re.compile(r"\.mlp\.shared_expert\."), ".mlp.shared_experts."),),
}


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(path, "file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(path, f"not valid JSON ({e})") from None


def _rope_scaling(raw: dict | None) -> tuple | None:
    if not raw:
        return None
    raw = {k: v for k, v in raw.items() if k != "rope_theta" and v is not None}
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind == "default":
        return None
    return tuple(sorted((k, v) for k, v in raw.items() if isinstance(v, (int, float, str))))


def _rope_params(c: dict, layer_types: list[str]) -> dict[str, RopeConfig]:
    """Understands both transformers 5 `rope_parameters` and the older rope_theta/rope_scaling."""
    rp = c.get("rope_parameters")
    if isinstance(rp, dict) and rp and all(t in rp for t in set(layer_types)):
        return {t: RopeConfig(float(rp[t].get("rope_theta", 10000.0)), _rope_scaling(rp[t])) for t in set(layer_types)}
    if isinstance(rp, dict) and "rope_theta" in rp:
        theta, scaling = float(rp["rope_theta"]), _rope_scaling(rp)
    else:
        theta, scaling = float(c.get("rope_theta", 10000.0)), _rope_scaling(c.get("rope_scaling"))
    rope = {FULL: RopeConfig(theta, scaling)}
    if SLIDING in layer_types:
        # Gemma 3 local layers: their own base, no scaling. Others: same rotary as global.
        local = c.get("rope_local_base_freq")
        rope[SLIDING] = RopeConfig(float(local), None) if local else RopeConfig(theta, scaling)
    return rope


def layer_types_of(c: dict, model_type: str, n_layers: int) -> list[str]:
    if isinstance(c.get("layer_types"), list):
        return list(c["layer_types"])
    if model_type == "gemma3_text":
        pattern = int(c.get("sliding_window_pattern", c.get("_sliding_window_pattern", 6)))
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n_layers)]
    if model_type in ("mistral", "mixtral") and c.get("sliding_window"):
        return [SLIDING] * n_layers
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and c.get("use_sliding_window"):
        start = int(c.get("max_window_layers", n_layers))
        return [SLIDING if i >= start else FULL for i in range(n_layers)]
    return [FULL] * n_layers


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(i) for i in (x if isinstance(x, list) else [x])]


def read_chat_template(folder: Path) -> str | None:
    """The folder's chat template: `chat_template.jinja` (where newer transformers save it), else
    `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text() or None
    tok_cfg = folder / "tokenizer_config.json"
    if not tok_cfg.is_file():
        return None
    tpl = read_json(tok_cfg).get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    if tpl is not None and not isinstance(tpl, str):
        raise ModelLoadError(tok_cfg, f"chat_template must be a string, got {type(tpl).__name__}")
    return tpl or None


def _mla_fields(c: dict, cfg_path: Path, model_type: str, n_layers: int) -> dict:
    """ModelConfig overrides of a DeepSeek-V2/V3 (MLA) config: a dense-MLP model only."""
    names = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    for name in names:
        if not isinstance(c.get(name), int) or c[name] <= 0:
            raise ModelLoadError(cfg_path, f"MLA field {name!r} must be a positive integer, got {c.get(name)!r}")
    q_lora = c.get("q_lora_rank")
    if q_lora is not None and (not isinstance(q_lora, int) or q_lora <= 0):
        raise ModelLoadError(cfg_path, f"MLA field 'q_lora_rank' must be null or a positive integer, got {q_lora!r}")
    if c["qk_rope_head_dim"] % 2:
        raise ModelLoadError(cfg_path, f"MLA field 'qk_rope_head_dim' must be even, got {c['qk_rope_head_dim']}")
    rp = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else c.get("rope_scaling")
    if _rope_scaling(rp) is not None:
        raise ModelLoadError(cfg_path, f"rope scaling {dict(_rope_scaling(rp))} is not supported for MLA models")
    return dict(family="deepseek", num_kv_heads=1, head_dim=c["qk_rope_head_dim"],
                attn_scale=(c["qk_nope_head_dim"] + c["qk_rope_head_dim"]) ** -0.5,
                kv_lora_rank=c["kv_lora_rank"], q_lora_rank=q_lora, qk_nope_head_dim=c["qk_nope_head_dim"],
                qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"],
                # V2 rotates interleaved pairs (complex form); V3 does unless rope_interleave is false.
                rope_interleave=model_type == "deepseek_v2" or bool(c.get("rope_interleave", True)),
                qkv_bias=bool(c.get("attention_bias", False)), o_bias=bool(c.get("attention_bias", False)))


def _json_float(v) -> float | None:
    """A number of config.json; transformers writes infinities as {"__float__": "Infinity"}."""
    if isinstance(v, dict) and "__float__" in v:
        v = v["__float__"]
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _bamba_fields(c: dict, cfg_path: Path, n_layers: int) -> dict:
    """ModelConfig overrides of a Bamba config: Mamba2 layers everywhere but `attn_layer_indices`
    (the layers `layers_block_type` calls "mamba" / "linear_attention" and "attention" /
    "full_attention"), half-rotary attention. What the mixer here does not compute is refused by
    name: a time-step clamp (`time_step_limit` other than (0, inf)), MoE feed-forwards."""
    attn = c.get("attn_layer_indices") or []
    if not isinstance(attn, list) or not all(isinstance(i, int) and 0 <= i < n_layers for i in attn):
        raise ModelLoadError(cfg_path, f"attn_layer_indices must be a list of layer indices below "
                                       f"num_hidden_layers ({n_layers}), got {attn!r}")
    declared = c.get("layers_block_type") or c.get("layer_types")
    known = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": FULL, "full_attention": FULL}
    if declared is not None:
        if not isinstance(declared, list) or len(declared) != n_layers:
            raise ModelLoadError(cfg_path, f"layers_block_type must list {n_layers} layer types, got {declared!r}")
        bad = [t for t in declared if t not in known]
        if bad:
            raise ModelLoadError(cfg_path, f"layers_block_type entry {bad[0]!r} is not supported "
                                           f"(supported: {', '.join(known)})")
        layer_types = [known[t] for t in declared]
    else:
        layer_types = [FULL if i in attn else MAMBA for i in range(n_layers)]
    limit = c.get("time_step_limit")
    if limit is not None and (not isinstance(limit, list) or [_json_float(v) for v in limit] != [0.0, float("inf")]):
        raise ModelLoadError(cfg_path, f"time_step_limit {limit!r} is not supported (only (0.0, inf): no clamp "
                                       f"of the time step)")
    if c.get("num_experts") not in (None, 1):
        raise ModelLoadError(cfg_path, f"num_experts {c['num_experts']!r} is not supported (dense MLPs only)")
    hidden, heads = int(c["hidden_size"]), int(c["mamba_n_heads"])
    expand = int(c.get("mamba_expand", 2))
    d_head = c.get("mamba_d_head", "auto")
    d_head = expand * hidden // heads if d_head in (None, "auto") else int(d_head)
    if d_head * heads != expand * hidden:
        raise ModelLoadError(cfg_path, f"mamba_d_head ({d_head}) x mamba_n_heads ({heads}) must equal "
                                       f"mamba_expand x hidden_size ({expand * hidden})")
    rp = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else {}
    return dict(family="bamba", layer_types=layer_types,
                partial_rotary_factor=float(rp.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.5))),
                mamba_n_heads=heads, mamba_head_dim=d_head, mamba_n_groups=int(c.get("mamba_n_groups", 1)),
                mamba_d_state=int(c["mamba_d_state"]), mamba_d_conv=int(c.get("mamba_d_conv", 4)),
                mamba_chunk_size=int(c.get("mamba_chunk_size", 256)),
                mamba_conv_bias=bool(c.get("mamba_conv_bias", True)),
                mamba_proj_bias=bool(c.get("mamba_proj_bias", False)),
                qkv_bias=bool(c.get("attention_bias", False)), o_bias=bool(c.get("attention_bias", False)))


def _positive(c: dict, cfg_path: Path, name: str, default: int | None = None) -> int:
    value = c.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(cfg_path, f"MoE field {name!r} must be a positive integer, got {value!r}")
    return value


def _refuse_unless(c: dict, cfg_path: Path, name: str, allowed: tuple, default) -> object:
    """c[name] (or `default` when absent / null) if it is one of `allowed`; else a ModelLoadError
    naming the field: a routing variant kvserve does not implement."""
    value = c.get(name)
    value = default if value is None else value
    if value not in allowed:
        raise ModelLoadError(cfg_path, f"MoE routing {name}={value!r} is not supported for model_type "
                                       f"{c.get('model_type')!r} (supported: {', '.join(map(repr, allowed))})")
    return value


def _moe_fields(c: dict, cfg_path: Path, model_type: str, n_layers: int) -> dict:
    """ModelConfig overrides of a mixture-of-experts config (empty for a dense DeepSeek)."""
    layers = range(n_layers)
    if model_type == "mixtral":
        moe = dict(num_experts=_positive(c, cfg_path, "num_local_experts"),
                   intermediate_size=int(c["intermediate_size"]), layers=tuple(layers), norm_topk_prob=True)
    elif model_type in ("qwen2_moe", "qwen3_moe"):  # Qwen3-MoE: no shared expert
        if c.get("num_experts", c.get("num_local_experts")) == 0:
            return {}  # every layer dense
        step = _positive(c, cfg_path, "decoder_sparse_step", 1)
        only_dense = c.get("mlp_only_layers") or []
        if not isinstance(only_dense, list) or not all(isinstance(i, int) for i in only_dense):
            raise ModelLoadError(cfg_path, f"mlp_only_layers must be a list of layer indices, got {only_dense!r}")
        # Qwen3-MoE checkpoints name the count num_experts; transformers 5 writes num_local_experts
        count = "num_local_experts" if "num_experts" not in c and "num_local_experts" in c else "num_experts"
        moe = dict(num_experts=_positive(c, cfg_path, count),
                   intermediate_size=_positive(c, cfg_path, "moe_intermediate_size"),
                   layers=tuple(i for i in layers if i not in only_dense and (i + 1) % step == 0),
                   norm_topk_prob=bool(c.get("norm_topk_prob", False)))
        if model_type == "qwen2_moe":
            moe.update(shared_intermediate_size=_positive(c, cfg_path, "shared_expert_intermediate_size"),
                       shared_expert_gate=True)
    else:  # DeepSeek-V2 / V3
        dense, freq = int(c.get("first_k_dense_replace") or 0), _positive(c, cfg_path, "moe_layer_freq", 1)
        sparse = tuple(i for i in layers if i >= dense and i % freq == 0)
        if not c.get("n_routed_experts") or not sparse:
            return {}  # a dense model (its routing fields, defaults of the config class, unused)
        v3 = model_type == "deepseek_v3"
        # V3 is sigmoid-scored with the selection bias; transformers' V2 implements softmax, greedy or
        # group-limited, and never renormalises (DeepSeek's own V2 code renormalises *instead of*
        # scaling): a V2 config asking for it is refused rather than computed one way or the other.
        scoring = _refuse_unless(c, cfg_path, "scoring_func", ("sigmoid",) if v3 else ("softmax",),
                                 "sigmoid" if v3 else "softmax")
        method = _refuse_unless(c, cfg_path, "topk_method", ("noaux_tc",) if v3 else
                                ("greedy", "group_limited_greedy"), "noaux_tc" if v3 else "greedy")
        norm = bool(c.get("norm_topk_prob", v3))
        if not v3:
            _refuse_unless(c, cfg_path, "norm_topk_prob", (False,), False)
        shared = int(c.get("n_shared_experts") or 0)
        moe_inter = _positive(c, cfg_path, "moe_intermediate_size")
        grouped = method != "greedy"
        moe = dict(num_experts=_positive(c, cfg_path, "n_routed_experts"), intermediate_size=moe_inter,
                   layers=sparse, scoring=scoring,
                   topk_method=method, norm_topk_prob=norm,
                   n_group=_positive(c, cfg_path, "n_group") if grouped else 1,
                   topk_group=_positive(c, cfg_path, "topk_group") if grouped else 1,
                   routed_scaling_factor=float(c.get("routed_scaling_factor") or 1.0),
                   shared_intermediate_size=moe_inter * shared, router_fp32=True)
    moe["top_k"] = _positive(c, cfg_path, "num_experts_per_tok")
    if moe["top_k"] > moe["num_experts"]:
        raise ModelLoadError(cfg_path, f"num_experts_per_tok ({moe['top_k']}) exceeds the number of routed experts "
                                       f"({moe['num_experts']})")
    try:
        return {"moe": MoEConfig(**moe)}
    except ValueError as e:
        raise ModelLoadError(cfg_path, str(e)) from None


def _kv_source(c: dict, cfg_path: Path) -> tuple[int, ...] | None:
    """kvserve's cross-layer KV sharing (`kvserve convert --share-kv-every`): per layer, the layer
    whose K/V it attends over."""
    src = c.get("kvserve_kv_source")
    if src is None:
        return None
    if not isinstance(src, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in src):
        raise ModelLoadError(cfg_path, f"kvserve_kv_source must be a list of layer indices, got {src!r}")
    return tuple(src)


def read_hf_config(folder: Path) -> ModelConfig:
    cfg_path = folder / "config.json"
    c = read_json(cfg_path)
    model_type = c.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            cfg_path, f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    try:
        hidden, heads, n_layers = int(c["hidden_size"]), int(c["num_attention_heads"]), int(c["num_hidden_layers"])
        head_dim = int(c.get("head_dim") or hidden // heads)
        layer_types = layer_types_of(c, model_type, n_layers)
        gemma = model_type == "gemma3_text"
        if gemma and c.get("attn_logit_softcapping"):
            raise ModelLoadError(cfg_path, "attn_logit_softcapping is not supported")
        gen = folder / "generation_config.json"
        eos = _as_list(read_json(gen).get("eos_token_id")) if gen.exists() else []
        sliding = c.get("sliding_window") if SLIDING in layer_types else None
        mla = _mla_fields(c, cfg_path, model_type, n_layers) if model_type in MLA_MODEL_TYPES else {}
        moe = _moe_fields(c, cfg_path, model_type, n_layers) if model_type in MLA_MODEL_TYPES + _MOE_TYPES else {}
        if model_type == "bamba":
            mla = _bamba_fields(c, cfg_path, n_layers)
            layer_types = mla["layer_types"]
        return ModelConfig(**{**dict(
            family="gemma3" if gemma else "llama",
            model_type=model_type,
            vocab_size=int(c["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(c["intermediate_size"]),
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
            layer_types=layer_types,
            rope=_rope_params(c, layer_types),
            attn_scale=float(c.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else head_dim**-0.5,
            sliding_window=int(sliding) if sliding else None,
            hidden_act=c.get("hidden_activation") or c.get("hidden_act") or "silu",
            qkv_bias=bool(c.get("qkv_bias", True)) if model_type == "qwen2_moe" else
            bool(c.get("attention_bias", model_type == "qwen2")),
            o_bias=bool(c.get("attention_bias", False)) and model_type not in ("qwen2", "qwen2_moe"),
            mlp_bias=bool(c.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", gemma)),
            final_logit_softcapping=c.get("final_logit_softcapping"),
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos or _as_list(c.get("eos_token_id")),
            pad_token_id=c.get("pad_token_id"),
            chat_template=read_chat_template(folder),
            kv_source=_kv_source(c, cfg_path),
        ), **mla, **moe})
    except ModelLoadError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(cfg_path, f"invalid or missing field: {e}") from None


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(index, "no 'weight_map' object")
        files = sorted({folder / f for f in weight_map.values()})
        missing = [f for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(missing[0], f"shard named in {index.name} is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(folder, "no *.safetensors files")
    return files


def hf_tensor_files(folder: Path, cfg: ModelConfig) -> TensorFiles:
    """The folder's tensors under our names ("model." prefix dropped, Mixtral's block_sparse_moe /
    w1 w2 w3 and Qwen2-MoE's shared_expert renamed; a tied lm_head is skipped, and so are
    DeepSeek-V3's multi-token-prediction layers past num_hidden_layers), read one at a time."""
    renames = _RENAMES.get(cfg.model_type, ())
    mtp = re.compile(r"layers\.(\d+)\.")

    def rename(key: str) -> str | None:
        name = key.removeprefix("model.")
        if cfg.family == "bamba" and name.startswith("final_layernorm."):
            name = "norm." + name.removeprefix("final_layernorm.")
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return None
        if cfg.model_type == "deepseek_v3" and (m := mtp.match(name)) and int(m.group(1)) >= cfg.num_layers:
            return None  # the MTP module: a training / speculative head the decoder never runs
        for pattern, repl in renames:
            name = pattern.sub(repl, name)
        return name

    return TensorFiles(safetensors_files(folder), rename)


def hf_state_dict(folder: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """All tensors under our names, as stored (see hf_tensor_files)."""
    return hf_tensor_files(folder, cfg).state_dict()


HALF_CHECKPOINT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_dtype(folder: Path) -> torch.dtype | None:
    """The 16-bit dtype config.json says the checkpoint is saved in (`dtype`, transformers 5, or
    `torch_dtype`), None for any other (float32, absent)."""
    c = read_json(folder / "config.json")
    name = c.get("dtype") or c.get("torch_dtype")
    return HALF_CHECKPOINT_DTYPES.get(name) if isinstance(name, str) else None
