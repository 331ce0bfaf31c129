"""The engine on its own thread: it steps while there is work and hands each request's
outputs to the asyncio queue of the handler waiting for them.

A failure inside a step fails the requests in flight (the exception is delivered to their
queues), resets the engine's cache and keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from bov_jax.inference.engine import Engine, Output
from bov_jax.inference.sampling import SamplingParams

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05  # the engine thread's wait for work


class EngineLoop:
    """The engine on its own thread; outputs routed to the submitting handlers' queues."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._routes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.failures = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

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
            loop, queue = route
            loop.call_soon_threadsafe(queue.put_nowait, output)

    def _run(self) -> None:
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
