"""The replica set behind the server: N engines in Ray Serve deployments, one router in front.

`start_replicas` starts Ray (or joins `--ray-address`), deploys one Serve application per replica
(a deployment of one `EngineReplica`; the router, not Serve, picks the replica, so each replica
has a handle of its own) and returns a `ReplicaSet`. A `ReplicaSet` offers what the server uses of
an `AsyncLLMEngine` (generate, tokenize, stats, health, abort_all), so every route works unchanged:
`generate` asks the router for a replica and streams that replica's outputs back.

Local Ray is the server's own: no dashboard, no usage stats, as many CPUs as this machine has,
each replica `cores / N` of them (and as many torch threads). Asked for 127.0.0.1, Ray 2.60 still
advertises the node's address and some of its gRPC servers listen on every interface; its token
authentication (on by default) is what guards them. The HTTP front listens on --host only. Ray's health
checks restart a replica that died or whose engine is unhealthy; the router stops sending to a
replica as soon as a request or a stats poll fails on it, fails that replica's in-flight requests
with 503, and forgets what the replica held (a restarted replica starts empty).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray._private import ray_constants
from ray import serve

from kvserve.config import EngineConfig
from kvserve.engine import input_processor
from kvserve.engine.async_engine import OutputObserver, RequestError
from kvserve.engine.async_engine import _Mailbox  # the same merge-and-backlog rule as one engine
from kvserve.engine.outputs import RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sampling.structured import GrammarError
from kvserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from kvserve.server.replicas.deployment import EngineReplica, ReplicaFailure, ReplicaInfo
from kvserve.server.replicas.router import NoReplicaError, Router, RouterConfig, salt_keys

log = logging.getLogger(__name__)
APP_PREFIX = "kvserve-replica-"
POLL_INTERVAL_S = 0.5  # replicas' stats (loads, liveness, restarts)
POLL_TIMEOUT_S = 5.0  # a replica that does not answer a stats call this long is taken as dead
# Requests one replica may hold: well past what --max-queue lets in, so Serve never queues in front
# of the engine's own scheduler.
MAX_ONGOING_REQUESTS = 4096


@dataclass
class ReplicaOptions:
    data_parallel_size: int = 1
    router: str = "prefix"
    ray_address: str | None = None  # None: a local Ray started for this server
    num_cpus: int | None = None  # local Ray's CPUs (None: this machine's)
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 30.0
    cache_threshold: float = RouterConfig.cache_threshold
    balance_abs_threshold: int = RouterConfig.balance_abs_threshold
    balance_rel_threshold: float = RouterConfig.balance_rel_threshold

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.data_parallel_size}")
        self.router_config(16)  # names the flag of a bad router setting

    def router_config(self, block_size: int) -> RouterConfig:
        return RouterConfig(policy=self.router, block_size=block_size, cache_threshold=self.cache_threshold,
                            balance_abs_threshold=self.balance_abs_threshold,
                            balance_rel_threshold=self.balance_rel_threshold)


@dataclass
class _Replica:
    index: int
    handle: object  # ray.serve.handle.DeploymentHandle
    info: ReplicaInfo
    stats: dict = field(default_factory=dict)
    alive: bool = True
    streaming: object = None  # the handle with stream=True, made once

    def __post_init__(self) -> None:
        self.streaming = self.handle.options(stream=True)


class FrontEngine:
    """What handlers read from `state.engine.engine` (an LLMEngine in one process): the
    tokenizer, the model config and the context length, taken from the replicas."""

    def __init__(self, info: ReplicaInfo):
        self.tokenizer = info.tokenizer
        self.model_config = info.model_config
        self.max_model_len = info.max_model_len
        self.reasoning_parser = info.reasoning_parser
        self._vocab_size = info.vocab_size
        self.clock = time.perf_counter  # CLOCK_MONOTONIC: the one a replica on this host reads too

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return input_processor.tokenize(prompt, self.tokenizer, self._vocab_size)


class RoutedStream:
    """A request running on one replica: an async iterator over its outputs, as
    AsyncLLMEngine's RequestStream (closing it aborts the request on the replica).

    A task pumps the replica's outputs into a mailbox of the engine's kind as they arrive: outputs
    the reader has not taken yet merge into one, and a reader that leaves more than
    `max_unread_tokens` tokens of a sample unread has its request cancelled on the replica and
    gets a 408, as with one engine (Serve would otherwise buffer every output here)."""

    def __init__(self, owner: "ReplicaSet", replica: int, request_id: str, response,
                 max_unread_tokens: int | None = None, delta: bool = False):
        self._owner = owner
        self.replica = replica
        self.request_id = request_id
        self._response = response  # DeploymentResponseGenerator
        self._done = False
        self._max_unread_tokens = max_unread_tokens
        self._mailbox = _Mailbox(delta, max_unread_tokens, self._overflowed)
        self._pump = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        first = True
        try:
            async for item in self._response:
                if isinstance(item, ReplicaFailure):
                    self._mailbox.put(RequestError(item.message, item.status))
                    return
                self._owner.observe(item, first)
                first = False
                self._mailbox.put(item)
                if item.finished:
                    return
            self._mailbox.put(RequestError(f"replica {self.replica} ended the request without a final output", 500))
        except asyncio.CancelledError:
            raise
        except ray.exceptions.RayTaskError as e:  # raised by the replica's code: the replica itself is fine
            log.error("replica %d raised on request %s: %s", self.replica, self.request_id, e)
            cause = type(getattr(e, "cause", e)).__name__
            self._mailbox.put(RequestError(f"replica {self.replica} failed on the request ({cause})", 500))
        except Exception as e:  # the replica died or cannot be reached
            self._mailbox.put(self._owner.replica_failed(self.replica, e))

    def _overflowed(self) -> None:
        log.warning("request %s: its reader fell more than %s tokens behind; aborted", self.request_id,
                    self._max_unread_tokens)
        self._pump.cancel()
        self._response.cancel()

    def __aiter__(self) -> "RoutedStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._mailbox.get()
        except BaseException:  # CancelledError: whoever waited on us is gone
            self.close()
            raise
        if isinstance(item, BaseException):
            self._end()
            raise item
        if item.finished:
            self._end()
        return item

    def _end(self) -> None:
        if not self._done:
            self._done = True
            self._owner.ended(self)

    def close(self) -> None:
        if not self._done:
            self._pump.cancel()
            self._response.cancel()  # the replica's generator closes its stream: an abort there
            self._end()

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class ReplicaSet:
    """N replicas behind one router, offering the server what it uses of an AsyncLLMEngine."""

    observer: OutputObserver | None = None

    def __init__(self, replicas: list[_Replica], router: Router, runtime: "RayRuntime | None" = None,
                 max_unread_tokens: int | None = None):
        if not replicas:
            raise ValueError("a replica set needs at least one replica")
        self.replicas = replicas
        self.router = router
        self.runtime = runtime
        self.max_unread_tokens = max_unread_tokens  # --max-stream-backlog, enforced here (see RoutedStream)
        self.engine = FrontEngine(replicas[0].info)
        self.max_model_len = min(r.info.max_model_len for r in replicas)
        self.engine.max_model_len = self.max_model_len
        self._streams: dict[str, RoutedStream] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._poller: asyncio.Task | None = None
        self._started = False
        self.num_replica_failures = 0
        for r in replicas:
            router.set_capacity(r.index, r.info.num_cache_blocks)

    # ---------------------------------------------------------------- lifecycle (the app's lifespan)
    def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvserve-tokenize")
        self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def shutdown(self, timeout: float = 10.0) -> None:
        self.abort_all()
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:  # their final outputs on the way
            await asyncio.sleep(0.05)
        for stream in list(self._streams.values()):
            stream.close()
        self._started = False
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    @property
    def is_running(self) -> bool:
        return self._started

    @property
    def healthy(self) -> bool:
        """At least one replica takes requests."""
        return any(self.router.alive)

    # ---------------------------------------------------------------- requests
    def clock(self) -> float:
        return self.engine.clock()

    async def tokenize(self, prompt: str | list[int]) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.engine.tokenize, prompt)

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.engine.tokenizer.encode, text,
                                                                add_special_tokens)

    async def compile_grammar(self, params: StructuredOutputsParams) -> None:
        """Compile a constraint on every live replica (any of them may get the request); raises
        GrammarError, as one engine does, for a constraint that cannot compile."""
        live = [r for r in self.replicas if self.router.alive[r.index]]
        try:
            results = await asyncio.gather(*(_await(r.handle.compile_grammar.remote(params)) for r in live))
        except ray.exceptions.RayTaskError as e:
            raise RequestError(f"a replica failed to compile the constraint ({type(getattr(e, 'cause', e)).__name__})",
                               500) from None
        except Exception as e:  # a replica died or cannot be reached: the request may still go elsewhere
            log.warning("compiling a constraint on a replica failed (%s: %s)", type(e).__name__, e)
            return
        for failed in results:
            if failed is not None:
                raise GrammarError(*failed)

    def embed(self, prompt: list[int], params: PoolingParams, request_id: str, arrival_time: float | None = None,
              cache_salt: str | None = None, deadline: float | None = None) -> RoutedStream:
        """An embedding request, routed as any other; its one output is an EmbeddingRequestOutput."""
        return self.generate(prompt, params, request_id, arrival_time, cache_salt, deadline)

    def generate(self, prompt: list[int], params: SamplingParams | PoolingParams, request_id: str,
                 arrival_time: float | None = None, cache_salt: str | None = None,
                 deadline: float | None = None) -> RoutedStream:
        """Route now and submit to the chosen replica; iterate the result for the outputs."""
        if isinstance(prompt, str):
            prompt = self.engine.tokenize(prompt)
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        try:
            decision = self.router.pick(prompt, salt_keys(cache_salt))
        except NoReplicaError:
            raise RequestError("no replica is available (all have failed); retry later", 503) from None
        now = self.clock()
        waited = 0.0 if arrival_time is None else max(0.0, now - arrival_time)
        timeout = None if deadline is None else deadline - now
        replica = self.replicas[decision.replica]
        response = replica.streaming.generate.remote(
            list(prompt), params, request_id, waited, cache_salt, timeout)
        stream = RoutedStream(self, decision.replica, request_id, response, self.max_unread_tokens,
                              getattr(params, "output_kind", None) is RequestOutputKind.DELTA)
        self._streams[request_id] = stream
        return stream

    def abort_all(self) -> None:
        """Abort every request on its replica; each stream ends with its final "abort" output
        (as AsyncLLMEngine.abort_all does), sent by the replica."""
        for stream in list(self._streams.values()):
            self.replicas[stream.replica].handle.abort.remote(stream.request_id)

    # ---------------------------------------------------------------- callbacks from the streams
    def ended(self, stream: RoutedStream) -> None:
        self._streams.pop(stream.request_id, None)
        self.router.finished(stream.replica)

    def observe(self, out: RequestOutput, first: bool) -> None:
        if self.observer is None:
            return
        try:
            self.observer.on_output(out, first)
        except Exception:
            log.exception("metrics observer failed")

    def replica_failed(self, index: int, exc: BaseException) -> RequestError:
        """A request failed in transit: the replica is taken out until a poll finds it back."""
        self.num_replica_failures += 1
        log.error("replica %d failed a request (%s: %s); routing around it until it is back", index,
                  type(exc).__name__, exc)
        self._mark_dead(index)
        return RequestError(f"replica {index} failed while running the request ({type(exc).__name__}); "
                            "retry: new requests go to the other replicas", 503)

    def _mark_dead(self, index: int) -> None:
        self.replicas[index].alive = False
        self.router.mark_dead(index)

    # ---------------------------------------------------------------- stats and liveness
    async def _poll(self) -> None:
        while True:
            await asyncio.gather(*(self._poll_one(r) for r in self.replicas))
            await asyncio.sleep(POLL_INTERVAL_S)

    async def _poll_one(self, r: _Replica) -> None:
        response = r.handle.stats.remote()
        try:
            stats = await asyncio.wait_for(asyncio.ensure_future(_await(response)), POLL_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            response.cancel()
            if r.alive:
                log.error("replica %d does not answer (%s); routing around it", r.index, type(e).__name__)
                self._mark_dead(r.index)
            return
        if stats.get("incarnation") != r.info.incarnation:  # restarted: an empty cache
            r.info = dataclasses.replace(r.info, incarnation=stats.get("incarnation"))
            self.router.indexes[r.index].clear()
        r.stats = stats
        if not r.alive and stats.get("healthy", True):
            log.info("replica %d is back", r.index)
            r.alive = True
            self.router.mark_alive(r.index)

    def stats(self) -> dict:
        """Counters summed over the replicas (as of their last poll), and each replica's own."""
        total: dict = {}
        for r in self.replicas:
            for k, v in r.stats.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    total[k] = total.get(k, 0) + v
        n = len(self.replicas)
        if "kv_cache_usage_perc" in total:
            total["kv_cache_usage_perc"] /= n
        total.setdefault("num_requests_running", 0)
        total.setdefault("num_requests_waiting", 0)
        total["num_replicas"] = n
        total["num_replicas_alive"] = sum(self.router.alive)
        total["replica_failures"] = self.num_replica_failures
        total["replicas"] = [{"alive": self.router.alive[r.index], "outstanding": self.router.load[r.index],
                              "routed": self.router.num_routed[r.index], "pid": r.info.pid,
                              "indexed_blocks": len(self.router.indexes[r.index]),
                              **{k: r.stats.get(k) for k in ("num_requests_running", "num_requests_waiting",
                                                             "prefix_cache_hits", "prompt_tokens_computed")}}
                             for r in self.replicas]
        return total

    @property
    def num_waiting(self) -> int:
        """Requests sent and not yet running anywhere (outstanding minus what replicas run)."""
        running = sum(r.stats.get("num_requests_running", 0) for r in self.replicas)
        return max(0, sum(self.router.load) - running)

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def close(self) -> None:
        """Delete the Serve applications and stop a Ray this server started."""
        if self.runtime is not None:
            self.runtime.stop()


async def _await(response):
    return await response


# -------------------------------------------------------------------- starting
@dataclass
class RayRuntime:
    """Ray as this server uses it: started here (local) or joined (`--ray-address`)."""

    started_here: bool
    app_names: list[str]
    start_s: float  # ray.init + serve.start
    deploy_s: float = 0.0  # the replicas' model loads, in parallel

    def stop(self) -> None:
        try:
            for name in self.app_names:
                serve.delete(name, _blocking=True)
            if self.started_here:
                serve.shutdown()
        finally:
            if self.started_here:
                ray.shutdown()


def start_ray(opts: ReplicaOptions) -> RayRuntime:
    """ray.init + serve.start, local (loopback only, no dashboard, no usage stats) or on a cluster."""
    t0 = time.perf_counter()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # read by ray.init; workers inherit it
    started = False
    if not ray.is_initialized():
        if opts.ray_address is None:
            # Workers must import this kvserve (a checkout may shadow an installed one): they inherit
            # the environment of the Ray this call starts.
            root = str(Path(__file__).resolve().parents[3])
            path = os.environ.get("PYTHONPATH", "")
            if root not in path.split(os.pathsep):
                os.environ["PYTHONPATH"] = root + (os.pathsep + path if path else "")
            # A single-node Ray: its node address stays 127.0.0.1 and its servers (GCS, raylet,
            # workers, agents) listen on the loopback only. Without this Ray turns 127.0.0.1 into the
            # host's reachable address and binds them on all interfaces (measured with `ss -ltnp`).
            # The switch is Ray's single-machine mode (its default on macOS and Windows): read from the
            # environment by the processes Ray starts, and from this constant in this process, where
            # Ray may already have been imported.
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
            ray_constants.ENABLE_RAY_CLUSTER = False
            # address="local": a Ray of its own, never one that `ray start` left running here.
            ray.init(address="local", num_cpus=opts.num_cpus or os.cpu_count() or 1, include_dashboard=False,
                     _node_ip_address="127.0.0.1", configure_logging=False, log_to_driver=True)
        else:
            ray.init(address=opts.ray_address, configure_logging=False)
        started = True
    serve.start(proxy_location="Disabled")
    return RayRuntime(started, [], time.perf_counter() - t0)


def start_replicas(config: EngineConfig, opts: ReplicaOptions, max_unread_tokens: int | None) -> ReplicaSet:
    """Start Ray and N replicas; blocks until every replica has loaded its model."""
    runtime = start_ray(opts)
    n = opts.data_parallel_size
    cpus = float(opts.num_cpus or os.cpu_count() or 1) / n if runtime.started_here and opts.ray_address is None \
        else float(config.num_threads or 1)
    threads = config.num_threads or max(1, int(cpus))
    replica_config = replica_engine_config(config, threads)
    t0 = time.perf_counter()
    apps = []
    for i in range(n):
        dep = serve.deployment(EngineReplica).options(
            name=f"{APP_PREFIX}{i}", num_replicas=1, max_ongoing_requests=MAX_ONGOING_REQUESTS,
            health_check_period_s=opts.health_check_period_s, health_check_timeout_s=opts.health_check_timeout_s,
            ray_actor_options={"num_cpus": min(cpus, float(threads)) if runtime.started_here else cpus},
            logging_config={"enable_access_log": False})  # a line per call would drown the server's log
        apps.append(serve.RunTarget(dep.bind(replica_config, max_unread_tokens), name=f"{APP_PREFIX}{i}",
                                    route_prefix=None))
    runtime.app_names = [a.name for a in apps]
    try:
        handles = serve.run_many(apps)
        infos = [h.describe.remote().result() for h in handles]
    except BaseException:
        runtime.stop()
        raise
    runtime.deploy_s = time.perf_counter() - t0
    log.info("Ray up in %.1f s; %d replicas (%d threads each) loaded in %.1f s", runtime.start_s, n, threads,
             runtime.deploy_s)
    replicas = [_Replica(i, h, info) for i, (h, info) in enumerate(zip(handles, infos))]
    router = Router(n, opts.router_config(infos[0].block_size))
    return ReplicaSet(replicas, router, runtime, max_unread_tokens)


def replica_engine_config(config: EngineConfig, threads: int) -> EngineConfig:
    """What each replica builds: `threads` threads, the model path absolute, and a GGUF's blocks
    computed from the memory-mapped file (`gguf_mmap`): replicas on one host then share the file's
    page-cache pages, where blocks read into each process's own memory would cost every replica a
    copy of the weights (four replicas of an 8B Q4_K_M file: 4 x 4.6 GB)."""
    if config.weights == "gguf" and not config.gguf_mmap:
        log.info("replicas compute a GGUF's blocks from the mapped file (gguf_mmap), sharing its pages")
    return dataclasses.replace(config, num_threads=threads, model=_absolute(config.model),
                               gguf_mmap=config.gguf_mmap or config.weights == "gguf")


def _absolute(model: str | None) -> str | None:
    """A relative model path as seen from here (a Ray worker may start elsewhere)."""
    if model is not None and Path(model).exists():
        return str(Path(model).resolve())
    return model
