"""Runtime weight formats: how a loaded model's weights may be stored when they are not plain
float tensors.

spec.py       the quantization grid (QuantSpec, QuantizedWeight) and the quantizer interface
rtn.py        round-to-nearest quantization (the load-time path needs no calibration)
packing.py    the int4 kernels' packed layouts
linear.py     QuantLinear: a low-bit linear layer on the int8 / int4 kernels (or dequantized)
embedding.py  QuantEmbedding: a lookup reading the low-bit codes
quantize.py   replacing a model's linears block by block (`quantize_blocks`, `rtn_quantize_model`)
sparse_nm.py  SparseNMLinear: N:M sparse storage
ggml.py       GGMLLinear: a GGUF file's own quantized blocks (Q4_0 ... Q6_K)

Reading and writing folders of these formats is kvserve/loading's; the methods that choose the
weights (GPTQ, AWQ, pruning, ...) are the toolbox's, kvserve/compress.
"""
