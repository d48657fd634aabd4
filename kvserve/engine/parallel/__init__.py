"""Tensor parallelism over torch.distributed (gloo on the CPU, NCCL on CUDA): shards
(shard.py), the group and its processes (group.py), the step protocol (runner.py), start-up
(setup.py) and the spawned worker (worker.py)."""
