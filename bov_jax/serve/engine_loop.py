"""The engine on its own thread: it steps while there is work and hands each request's
outputs to the asyncio queue of the handler waiting for them.

The thread first runs the warm-up it is given (`warmup.compile_steps`: every step shape
compiled) and then sets `ready`; requests that arrive before are queued and served after.
A failure inside a step fails the requests in flight (the exception is delivered to their
queues), resets the engine's cache and keeps serving. `cut` ends every request in flight
at once with a `ServerStopping` error (the end of a drain); `draining` marks the server as
refusing new requests while those in flight finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable

from bov_jax.inference.engine import Engine, Output
from bov_jax.inference.sampling import SamplingParams

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05  # the engine thread's wait for work


class ServerStopping(RuntimeError):
    """Delivered to the requests still in flight when the server stops (`EngineLoop.cut`)."""


class EngineLoop:
    """The engine on its own thread; outputs routed to the submitting handlers' queues.
    warmup: run on the thread before it serves (`ready` is set when it returns), given a
    callable that says whether the loop is stopping (a warm-up stops early then)."""

    def __init__(self, engine: Engine, warmup: Callable[[Callable[[], bool]], None] | None = None):
        self.engine = engine
        self._warmup = warmup
        self._routes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.failures = 0
        self.ready = threading.Event()
        self.draining = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def in_flight(self) -> int:
        """Requests submitted whose last output has not been delivered."""
        with self._lock:
            return len(self._routes)

    def cut(self, reason: str) -> int:
        """End every request in flight now (any thread): each handler gets ServerStopping
        (reason) and the engine aborts the request at its next step; how many were cut."""
        with self._lock:
            routes, self._routes = self._routes, {}
        for request_id, route in routes.items():
            self.engine.abort(request_id)
            self._send(route, ServerStopping(reason))
        self._wake.set()
        return len(routes)

    def drain(self, limit_s: float, reason: str) -> int:
        """Mark the loop draining, wait up to limit_s seconds for the requests in flight to
        finish, and cut those left (module doc); how many were cut."""
        self.draining = True
        deadline = time.monotonic() + limit_s
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(IDLE_WAIT_S)
        return self.cut(reason)

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> asyncio.Queue:
        """Queue a request (from a handler on the event loop); its outputs arrive in the
        returned queue, the last with a finish reason. ValueError if the engine refuses it."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._routes[request_id] = (asyncio.get_running_loop(), queue)
        try:
            self.engine.add(request_id, prompt, params)
        except ValueError:
            with self._lock:
                del self._routes[request_id]
            raise
        self._wake.set()
        return queue

    def cancel(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def _deliver(self, output: Output | BaseException, request_id: str) -> None:
        with self._lock:
            route = self._routes.get(request_id)
            done = isinstance(output, BaseException) or output.finish_reason is not None
            if done:
                self._routes.pop(request_id, None)
        if route is not None:
            self._send(route, output)

    @staticmethod
    def _send(route: tuple[asyncio.AbstractEventLoop, asyncio.Queue], output: object) -> None:
        loop, queue = route
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody waits any more
            loop.call_soon_threadsafe(queue.put_nowait, output)

    def _run(self) -> None:
        if self._warmup is not None:
            try:
                self._warmup(lambda: self._stopping)
            except Exception:  # serving may still work: the steps compile when first run
                log.exception("the warm-up failed; steps will compile as requests need them")
        self.ready.set()
        while not self._stopping:
            if not self.engine.has_work():
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as err:  # a failed step must not end the server
                log.exception("engine step failed; failing the requests in flight")
                self.failures += 1
                for request_id in self.engine.reset():
                    self._deliver(err, request_id)
                continue
            for output in outputs:
                self._deliver(output, output.request_id)
