"""Noticing a dead peer in a multi-process run within seconds, and stopping with one line.

jax.distributed notices a process that is gone (kill -9, the OOM killer, a lost host) only at
its coordination service's heartbeat timeout (100 s by default), and then aborts the others
with a dump of about a hundred lines; until then they wait inside the collective they were
running with it (the stop vote, the train step). `PeerWatch` is a thread in every process of a
multi-process run that beats on the coordination service's key-value store every
HEARTBEAT_SECONDS and reads the other processes' beats. A peer whose beat stops advancing for
`timeout` seconds is taken for dead: the watcher prints one `error:` line naming it and ends
its own process at once (`os._exit(1)`: the thread that waits in a collective cannot be
interrupted). Nothing is saved on the way out, so the checkpoints already written stay as they
are (a save in flight leaves its temporary directory, which is not a step); a rerun resumes
from the last one. A process that ends on its own says so first (`finish`): "done" stops the
others watching it, "failed" (an error it printed itself) stops them with a line pointing to
its log instead of a wait in the next collective.

The store is jax.distributed's own (the client `jax._src.distributed.global_state.client`,
as Orbax uses it): no port or service of our own.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

log = logging.getLogger("bov_jax")

HEARTBEAT_SECONDS = 1.0
DEFAULT_TIMEOUT_SECONDS = 10
KEY = "bov_jax/heartbeat/{process}"
DONE, FAILED = "done", "failed"  # the last beat of a process that ended on its own


def stop_process(message: str) -> None:
    """Print `message` as the one error line and end this process now (status 1)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(1)


class PeerWatch:
    """The heartbeat thread of process `process` of `count` (see the module docstring)."""

    def __init__(
        self,
        client: Any,
        process: int,
        count: int,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        interval: float = HEARTBEAT_SECONDS,
        on_dead: Any = stop_process,
    ):
        self.client, self.process, self.count = client, process, count
        self.timeout, self.interval, self.on_dead = timeout, interval, on_dead
        self._beats = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bov_jax-peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        self._beat()
        self._thread.start()
        return self

    def finish(self, status: str) -> None:
        """This process ends on its own (`DONE` or `FAILED`): stop beating and tell the others."""
        self._stopped.set()
        self._thread.join(timeout=5 * self.interval)
        try:
            self.client.key_value_set(KEY.format(process=self.process), status, True)
        except Exception as err:  # the coordinator may be gone already: nothing to tell
            log.debug("could not record this process's end (%s): %s", status, err)

    def await_verdict(self) -> None:
        """Give the watch the time to find a dead peer (it then ends this process with its line):
        for an error out of a collective, which a peer's death causes (gloo: "Connection reset
        by peer"). Returns if every peer still beats after `timeout`."""
        self._thread.join(timeout=self.timeout + 3 * self.interval)

    def _beat(self) -> None:
        self._beats += 1
        self.client.key_value_set(KEY.format(process=self.process), str(self._beats), True)

    def _read(self, peer: int) -> str | None:
        try:
            return self.client.key_value_try_get(KEY.format(process=peer))
        except Exception as err:  # NOT_FOUND before its first beat
            if "NOT_FOUND" in str(err) or "not found" in str(err).lower():
                return None
            raise

    def _run(self) -> None:
        peers = [p for p in range(self.count) if p != self.process]
        seen = {peer: (None, time.monotonic()) for peer in peers}  # last beat, when it changed
        while not self._stopped.wait(self.interval):
            try:
                self._beat()
                beats = {peer: self._read(peer) for peer in seen}
            except Exception as err:  # the coordination service (process 0) is gone
                if not self._stopped.is_set():
                    self.on_dead(
                        f"process {self.process} of {self.count} lost the coordinator, process "
                        f"0 ({str(err).splitlines()[0][:80]}): it died; stopping. The saved "
                        "checkpoints are intact: rerun to resume from the last one"
                    )
                return
            now = time.monotonic()
            for peer, beat in beats.items():
                last, since = seen[peer]
                if beat == DONE:
                    del seen[peer]
                elif beat == FAILED:
                    self.on_dead(
                        f"process {peer} of {self.count} stopped with an error (its own log "
                        "says which); stopping too. The saved checkpoints are intact"
                    )
                    return
                elif beat != last:
                    seen[peer] = (beat, now)
                elif now - since > self.timeout:
                    self.on_dead(
                        f"process {peer} of {self.count} gave no heartbeat for {now - since:.0f} s "
                        "(it died or hangs); stopping. The saved checkpoints are intact: rerun to "
                        "resume from the last one"
                    )
                    return


def watch_peers(timeout: float) -> PeerWatch | None:
    """Start the watch in a multi-process run (None with one process or `timeout` <= 0)."""
    import jax
    from jax._src import distributed

    if jax.process_count() == 1 or timeout <= 0 or distributed.global_state.client is None:
        return None
    client = distributed.global_state.client
    return PeerWatch(client, jax.process_index(), jax.process_count(), timeout).start()
