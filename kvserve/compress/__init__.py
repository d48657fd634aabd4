"""The compression toolbox, beside the serving stack: it uses the stack (loading, model,
weights), the stack never imports it.

quant/    quantization methods (RTN, GPTQ, AWQ, LLM.int8, SmoothQuant, QAT), `kvserve quantize`
prune/    pruning (magnitude, Wanda, SparseGPT, N:M, structured), `kvserve prune`
train/    the training loop, losses and distillation, `kvserve distill`
convert/  KV-cache shrinking transforms (GQA / MQA pooling, cross-layer sharing), `kvserve convert`
"""
