"""The fast paths: what makes the reference model (kvserve/model/) fast on a CPU or a GPU without
changing its numbers.

prepare.py       the one place that applies them to a loaded model (`prepare_model`)
panels.py        fp32 weights packed for the CPU decode-step matmul kernel
greedy_head.py   greedy tokens through an int8 screen of the packed LM head
decode_plan.py   a small step's layer stack as one C call
fused_linear.py  q/k/v and gate/up as one float matmul each (CUDA)
cuda_gemv.py     Triton matrix-vector kernels for CUDA steps of 1-4 rows, chosen against cuBLAS by timing
fused_quant.py   q/k/v and gate/up as one low-bit matmul each
compiled.py      the forward pass through torch.compile

The engine's model runner chooses among them per step (decode plan, greedy screen, compiled
graph); tests prove each equal to the reference path.
"""
