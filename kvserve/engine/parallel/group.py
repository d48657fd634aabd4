"""The tensor-parallel process group: rendezvous, the collectives a step needs, the workers'
processes and their cores.

Rank 0 is the engine's own process; ranks 1.. are workers it spawns (`python -m
kvserve.engine.parallel.worker`), meeting at a TCPStore on 127.0.0.1 with a free port. Under
torchrun (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set) nothing is spawned: every rank runs
the same command, and ranks other than 0 become workers (kvserve/engine/parallel/worker.py).

The group is a ProcessGroupGloo (CPU) or ProcessGroupNCCL (CUDA) of its own rather than the
process-wide default group, so one process may hold several engines (tests do).
"""
from __future__ import annotations

import datetime
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# How long a collective may wait for a peer: a dead peer is noticed at once (its sockets close),
# this bounds a peer that is alive but stuck. Waiting for the next step is not bounded (an idle
# server's workers wait for hours).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("KVSERVE_TP_TIMEOUT", "300")))
IDLE_TIMEOUT = datetime.timedelta(days=365)
START_TIMEOUT = datetime.timedelta(seconds=600)  # the rendezvous: every rank's process started and met
WORKER_MODULE = "kvserve.engine.parallel.worker"


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group failed (exited, or lost its connection): the group
    cannot compute another step."""


def torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) when launched by torchrun (or any launcher setting its variables)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def core_share(rank: int, world: int, cores: list[int]) -> list[int]:
    """Rank's disjoint share of `cores` (contiguous runs); with fewer cores than ranks, one core
    each, round robin."""
    if len(cores) < world:
        return [cores[rank % len(cores)]]
    per, extra = divmod(len(cores), world)
    start = rank * per + min(rank, extra)
    return cores[start:start + per + (rank < extra)]


@dataclass
class CoreRestore:
    """The process's cores and torch threads before a rank bound them; calling it restores them, once."""

    cores: set[int] | None = None
    threads: int | None = None

    def __call__(self) -> None:
        if self.cores is not None:
            _set_process_affinity(self.cores)
            torch.set_num_threads(self.threads)
            self.cores = None


@dataclass
class ParallelGroup:
    """One tensor-parallel group as seen by one rank."""

    pg: object  # the tensors' group: ProcessGroupGloo on the CPU, ProcessGroupNCCL on CUDA
    cpu_pg: object  # step messages and barriers (host memory): ProcessGroupGloo (`pg` itself on the CPU)
    rank: int
    world: int
    device: torch.device
    store: object = None
    procs: list[subprocess.Popen] = field(default_factory=list)  # rank 0's spawned workers
    failure: str | None = None  # why the group is dead (then every call raises)
    restore: CoreRestore = field(default_factory=lambda: CoreRestore())  # the cores and threads before bind_cores
    allreduce_seconds: float = 0.0  # time inside all-reduces (benchmarks/tensor_parallel.py)
    allreduce_calls: int = 0

    # ---------------------------------------------------------------- collectives
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place."""
        t0 = time.perf_counter()
        self._wait(self.pg.allreduce([t]), "all-reduce")
        self.allreduce_seconds += time.perf_counter() - t0
        self.allreduce_calls += 1
        return t

    def gather(self, t: torch.Tensor, timeout: datetime.timedelta | None = None) -> list[torch.Tensor] | None:
        """Every rank's `t` (same shape) on rank 0, in rank order; None on the others."""
        out = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if timeout is not None:
            opts.timeout = timeout
        pg = self.cpu_pg if t.device.type == "cpu" else self.pg
        self._wait(pg.gather([out] if self.rank == 0 else [], [t], opts), "gather")
        return out if self.rank == 0 else None

    def send_object(self, obj) -> None:
        """Rank 0: broadcast a picklable object to the workers."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self._broadcast(torch.tensor([data.numel()], dtype=torch.int64))
        self._broadcast(data)

    def recv_object(self, idle: bool = False):
        """A worker: the next object rank 0 broadcasts (`idle`: wait as long as it takes)."""
        size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size, IDLE_TIMEOUT if idle else None)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(data)
        return pickle.loads(data.numpy().tobytes())

    def _broadcast(self, t: torch.Tensor, timeout: datetime.timedelta | None = None) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if timeout is not None:
            opts.timeout = timeout
        self._wait(self.cpu_pg.broadcast([t], opts), "broadcast")

    def _wait(self, work, what: str) -> None:
        self.check()
        try:
            work.wait()
        except Exception as exc:
            self.failure = self._why(f"{what} failed: {exc}")
            raise TensorParallelError(self.failure) from None

    # ---------------------------------------------------------------- health and lifecycle
    def check(self) -> None:
        """Raise TensorParallelError if the group is dead or a spawned worker has exited."""
        if self.failure is None:
            for i, p in enumerate(self.procs, start=1):
                if p.poll() is not None:
                    self.failure = _exited(i, p)
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def _why(self, message: str) -> str:
        """The most useful reason: a worker's exit if one exited (give it a moment to be reaped)."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for i, p in enumerate(self.procs, start=1):
                if p.poll() is not None:
                    return _exited(i, p)
            if not self.procs:
                break
            time.sleep(0.05)
        return f"tensor-parallel rank {self.rank}: {message}"

    def bind_cores(self, num_threads: int | None) -> None:
        """Pin this rank (every thread of the process) to its share of the cores and size torch's
        thread pool to it; `close` restores both (rank 0 is the caller's process)."""
        if not hasattr(os, "sched_getaffinity") or self.device.type != "cpu":
            return
        cores = sorted(os.sched_getaffinity(0))
        # Under torchrun the ranks on this host split its cores (LOCAL_RANK of LOCAL_WORLD_SIZE).
        local, size = int(os.environ.get("LOCAL_RANK", self.rank)), int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        mine = set(core_share(local, size, cores))
        self.restore.cores, self.restore.threads = set(cores), torch.get_num_threads()
        _set_process_affinity(mine)
        torch.set_num_threads(num_threads or len(mine))
        log.info("tensor-parallel rank %d: cores %s, %d threads", self.rank, sorted(mine), torch.get_num_threads())

    def abort(self) -> None:
        """Rank 0 after a failed step: the workers cannot continue; stop them now."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def close(self) -> None:
        """Rank 0: tell the workers to exit, wait for them (killing any that stay), restore the
        process's cores and threads."""
        if self.rank == 0 and self.failure is None and all(p.poll() is None for p in self.procs):
            try:
                self.send_object(("stop",))
            except TensorParallelError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.failure = self.failure or "the tensor-parallel group is closed"
        self.restore()


def _exited(rank: int, p: subprocess.Popen) -> str:
    how = f"signal {-p.returncode}" if p.returncode < 0 else f"code {p.returncode}"
    return f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with {how}"


def _set_process_affinity(cores: set[int]) -> None:
    """Every thread of this process (OpenMP's pool was started before), not only the caller."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # a thread that just ended
            pass


def _make_groups(store, rank: int, world: int, device: torch.device, host: str | None) -> tuple[object, object]:
    """(the tensors' group, the messages' group): gloo for both on the CPU (bound to `host`'s
    interface when given: loopback for a local group); on CUDA NCCL for the tensors and gloo
    beside it for the messages, which live in host memory."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = START_TIMEOUT  # connecting waits for every rank's process to start
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host) if host
                     else dist.ProcessGroupGloo.create_default_device()]
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world, opts)
    gloo.set_timeout(COLLECTIVE_TIMEOUT)
    if device.type != "cuda":
        return gloo, gloo
    torch.cuda.set_device(device)
    nccl_opts = dist.ProcessGroupNCCL.Options()
    nccl_opts._timeout = COLLECTIVE_TIMEOUT  # (NCCL connects lazily, at its first collective)
    return dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, world, nccl_opts), gloo


def rank_device(device: str, rank: int) -> torch.device:
    """CUDA ranks take one GPU each (LOCAL_RANK under torchrun)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))


def launch(world: int, device: str) -> ParallelGroup:
    """Rank 0's side of a new group: spawn world - 1 workers on this host (or, under torchrun,
    join the launcher's ranks) and meet them."""
    env = torchrun_env()
    if env is not None:
        rank, size = env
        if size != world:
            raise ValueError(f"tensor_parallel_size {world} does not match the launcher's WORLD_SIZE {size}")
        return join(rank, world, device, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    host = "127.0.0.1"
    store = dist.TCPStore(host, 0, world, is_master=True, timeout=START_TIMEOUT, wait_for_workers=False)
    procs = [_spawn(rank, world, device, host, store.port) for rank in range(1, world)]
    dev = rank_device(device, 0)
    try:
        pg, cpu_pg = _make_groups(store, 0, world, dev, host)
    except Exception:
        for p in procs:
            p.kill()
        raise
    log.info("tensor parallelism: %d ranks over %s (workers %s)", world, "nccl" if dev.type == "cuda" else "gloo",
             [p.pid for p in procs])
    return ParallelGroup(pg, cpu_pg, 0, world, dev, store, procs)


def join(rank: int, world: int, device: str, host: str, port: int) -> ParallelGroup:
    """Any rank joining the group whose store rank 0 holds at host:port (torchrun's or ours)."""
    if torchrun_env() is not None:  # the launcher's store rules (its agent's store, or rank 0's)
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=START_TIMEOUT))
    else:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=START_TIMEOUT)
    dev = rank_device(device, rank)
    local = host in ("127.0.0.1", "localhost")
    pg, cpu_pg = _make_groups(store, rank, world, dev, host if local else None)
    return ParallelGroup(pg, cpu_pg, rank, world, dev, store)


def _spawn(rank: int, world: int, device: str, host: str, port: int) -> subprocess.Popen:
    """A worker process for `rank`: this interpreter, told where to meet and whose child it is."""
    env = {**os.environ, "KVSERVE_TP_RANK": str(rank), "KVSERVE_TP_WORLD_SIZE": str(world),
           "KVSERVE_TP_ADDR": host, "KVSERVE_TP_PORT": str(port), "KVSERVE_TP_DEVICE": device,
           "KVSERVE_TP_PARENT": str(os.getpid())}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(name, None)  # a worker is not a torchrun rank
    # The worker imports the kvserve this process runs (a checkout may shadow an installed one).
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.Popen([sys.executable, "-m", WORKER_MODULE], env=env, stdin=subprocess.DEVNULL,
                            stdout=sys.stderr.fileno() if _has_fileno(sys.stderr) else None)


def _has_fileno(stream) -> bool:
    try:
        stream.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False


def exit_with_parent(parent: int) -> None:
    """A worker ends when the process that spawned it is gone (however it ended: a SIGKILL
    runs no cleanup): a daemon thread watches the parent pid."""
    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True, name="tp-parent-watch").start()
