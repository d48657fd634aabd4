"""Model transforms that shrink the KV cache: GQA / MQA conversion by mean-pooling K/V heads
(`kvserve convert --kv-heads K`) and cross-layer KV sharing (`--share-kv-every N`)."""
from kvserve.compress.convert.cla import share_kv
from kvserve.compress.convert.gqa import pool_kv_heads

__all__ = ["pool_kv_heads", "share_kv"]
