"""The peer watch of multi-process runs (bov_jax/train/peers.py) on an in-memory key-value store
(tests/test_multiprocess.py kills a real process)."""

from __future__ import annotations

import threading
import time

from bov_jax.train import peers


class Store:
    """The two calls of jax.distributed's client the watch uses."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self.lock = threading.Lock()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self.lock:
            self.values[key] = value

    def key_value_try_get(self, key: str) -> str:
        with self.lock:
            if key not in self.values:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.values[key]


def watch(store: Store, process: int, count: int, verdicts: list[str]) -> peers.PeerWatch:
    return peers.PeerWatch(
        store, process, count, timeout=0.4, interval=0.05, on_dead=verdicts.append
    )


def wait_for(verdicts: list[str], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not verdicts and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_peer_that_stops_beating_is_named_within_the_timeout():
    store, verdicts, seen = Store(), [], []
    alive = watch(store, 1, 3, seen).start()  # process 1 beats, then dies (stops beating)
    other = watch(store, 2, 3, seen).start()
    me = watch(store, 0, 3, verdicts).start()
    time.sleep(0.3)
    assert verdicts == []  # every peer beats
    alive._stopped.set()  # process 1 is gone without a word
    started = time.monotonic()
    wait_for(verdicts)
    assert len(verdicts) == 1 and verdicts[0].startswith("process 1 of 3 gave no heartbeat")
    assert 0.3 < time.monotonic() - started < 2.0
    other.finish(peers.DONE)
    me.finish(peers.DONE)


def test_a_peer_that_failed_or_finished_is_not_waited_for():
    store, verdicts = Store(), []
    watch(store, 0, 3, verdicts).start()
    done, failed = watch(store, 1, 3, []).start(), watch(store, 2, 3, []).start()
    done.finish(peers.DONE)
    time.sleep(0.8)  # beyond the timeout: a finished peer is no dead one
    assert verdicts == []
    failed.finish(peers.FAILED)
    wait_for(verdicts)
    assert verdicts == [
        "process 2 of 3 stopped with an error (its own log says which); "
        "stopping too. The saved checkpoints are intact"
    ]


def test_a_lost_coordinator_is_named():
    class Gone(Store):
        def key_value_set(self, key, value, allow_overwrite=False):
            if self.values:
                raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
            super().key_value_set(key, value, allow_overwrite)

    verdicts = []
    watch(Gone(), 1, 2, verdicts).start()
    wait_for(verdicts)
    assert verdicts and verdicts[0].startswith("process 1 of 2 lost the coordinator, process 0")
