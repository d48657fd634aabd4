"""Starting a tensor-parallel engine: rank 0 launches the group and tells the workers what to
load and how large a KV pool to build; every rank loads the model, keeps its shard and builds
its runner. The same steps run on rank 0 (`start`, `driver_runner`) and on a worker (`serve`)."""
from __future__ import annotations

import dataclasses
import logging
import sys
import weakref
from pathlib import Path

import torch

from kvserve.accel.greedy_head import drop_head_screen
from kvserve.accel.prepare import prepare_model
from kvserve.config import EngineConfig
from kvserve.engine.parallel.group import START_TIMEOUT, ParallelGroup, TensorParallelError, join, launch, torchrun_env
from kvserve.engine.parallel.runner import TensorParallelRunner
from kvserve.engine.parallel.shard import AllReduce, check_float_weights, check_shardable, shard_model
from kvserve.loading import LoadedModel, load_model
from kvserve.loading.loader import compute_dtype
from kvserve.model.attention import KVCache

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    """What every rank loads: the model's file or folder, in the dtype rank 0 computes in."""

    source: str
    dtype: torch.dtype
    pack_weights: bool
    num_threads: int | None


def load_shard(group: ParallelGroup, spec: LoadSpec, full: LoadedModel | None = None) -> LoadedModel:
    """This rank's shard of the model (of `full` when given: it is left as it was, else loaded
    here; refused unless it splits over the ranks), prepared with the fast paths that run per
    rank (packed panels; not the greedy screen, whose argmax would be of this rank's rows only)."""
    full = full or load_model(spec.source, spec.dtype, group.device)
    check_model(full.model, group.world)
    model = shard_model(full.model, group.rank, group.world, AllReduce(group))
    tokenizer, source = full.tokenizer, full.source
    del full  # this rank's slices are its own tensors: the full copy goes (unless a caller holds it)
    prepare_model(model, group.device, pack=spec.pack_weights, what=f"rank {group.rank} shard")
    drop_head_screen(model)
    return LoadedModel(model, model.config, tokenizer, Path(source))


def check_model(model: torch.nn.Module, world: int) -> None:
    """What a split needs, checked on rank 0 before the workers load anything."""
    check_shardable(model.config, world)
    check_float_weights(model)


def ready(group: ParallelGroup) -> None:
    """Every rank reached this point (a worker that failed to get here has exited: rank 0 learns
    it here, with its exit status)."""
    group.gather(torch.zeros(1), START_TIMEOUT)  # (as long as a load takes; a host tensor: the messages' group)


def start(cfg: EngineConfig, loaded: LoadedModel | None, path: Path | None) -> tuple[ParallelGroup, LoadedModel]:
    """Rank 0: the group and rank 0's shard. Under torchrun a rank other than 0 serves rank 0
    here and the process exits with the group."""
    world = cfg.tensor_parallel_size
    env = torchrun_env()
    if env is not None and env[0] != 0:
        group = join(env[0], world, cfg.device, "", 0)
        raise SystemExit(serve(group))
    if loaded is not None:
        check_model(loaded.model, world)  # before any process starts
    group = launch(world, cfg.device)
    try:
        group.bind_cores(cfg.num_threads)
        _close_at_exit(group)
        dtype = next(loaded.model.parameters()).dtype if loaded else compute_dtype(cfg.dtype, cfg.device)
        spec = LoadSpec(str(loaded.source if loaded else path), dtype, cfg.pack_weights, cfg.num_threads)
        group.send_object(("load", spec))  # every rank loads at once (each checks the split: shard_model)
        shard = load_shard(group, spec, loaded)
        ready(group)
    except BaseException:
        _give_up(group)
        raise
    return group, shard


def driver_runner(group: ParallelGroup, model: torch.nn.Module, cache: KVCache, cache_args: dict,
                  block_size: int) -> TensorParallelRunner:
    """Rank 0's runner, once the workers have built their pools as `cache_args` (KVCache's
    arguments but the device) says: the same pages, at their local heads."""
    try:
        group.send_object(("pool", cache_args, block_size))
        ready(group)
    except BaseException:
        _give_up(group)
        raise
    return TensorParallelRunner(group, model, cache, block_size, group.device)


def serve(group: ParallelGroup) -> int:
    """A worker: load, build the pool, then run rank 0's steps until it says stop (exit status 0)
    or the group fails (1)."""
    try:
        msg = group.recv_object(idle=True)
        if msg[0] == "stop":
            return 0
        spec: LoadSpec = msg[1]
        group.bind_cores(spec.num_threads)
        try:
            shard = load_shard(group, spec)
        except ValueError as exc:  # rank 0 raises the same (a model that does not split)
            print(f"kvserve: tensor-parallel rank {group.rank}: {exc}", file=sys.stderr)
            return 1
        ready(group)
        msg = group.recv_object(idle=True)
        if msg[0] == "stop":
            return 0
        _, cache_args, block_size = msg
        cache = KVCache(**cache_args, device=group.device)
        runner = TensorParallelRunner(group, shard.model, cache, block_size, group.device)
        ready(group)
        log.info("tensor-parallel rank %d: ready", group.rank)
        while True:
            msg = group.recv_object(idle=True)
            if msg[0] == "stop":
                return 0
            runner.run_step(msg[1])
    except TensorParallelError as exc:
        print(f"kvserve: tensor-parallel rank {group.rank}: {exc}", file=sys.stderr)
        return 1


def _give_up(group: ParallelGroup) -> None:
    """Start-up failed on rank 0: the workers may be anywhere in it (loading, in a barrier), so
    they are killed rather than told to stop."""
    group.abort()
    group.close()


def _close_at_exit(group: ParallelGroup) -> None:
    """Workers never outlive their engine, nor does its hold on the cores: both undone when the
    group is collected unclosed or the interpreter exits (a killed parent is the workers' own
    watch: group.exit_with_parent)."""
    weakref.finalize(group, _release, group.procs, group.restore)


def _release(procs, restore) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except Exception:
            p.kill()
    restore()
