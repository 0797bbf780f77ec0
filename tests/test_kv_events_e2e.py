"""KV events (``--kv-events-config``, SGLang's BlockStored / BlockRemoved / AllBlocksCleared over ZMQ) from our tree
on a real CPU server under SnapKV: a subscriber that replays the stream holds, at every point, the logical
prefixes the tree matches (``/v1/prefix_cache/inspect``), hidden positions included: a Chain Cache compaction or a
prune keeps a prefix matchable and publishes nothing; a branch the tree drops is published removed; a flush
clears everything (docs/router.md, "KV events")."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from sgl_sparse.server_process import ServerProcess, free_port
from tests.server_pool import ServerPool, assert_idle_and_sound, spec
from tests.test_eviction_e2e import FLAGS

pytestmark = pytest.mark.server
EVENTS_PORT = free_port()
TOPIC = "kv"


class Subscriber:
    """The stream replayed into the blocks it says are stored: hash -> (parent hash, token ids)."""

    def __init__(self, port: int) -> None:
        import msgspec
        import zmq
        from sglang.srt.disaggregation.kv_events import KVEventBatch

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.connect(f"tcp://127.0.0.1:{port}")
        self._sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.blocks: dict[int, tuple[int | None, list[int]]] = {}
        self.removed: list[int] = []
        self.cleared = 0
        self.batches = 0
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            if not self._sock.poll(100):
                continue
            _, _, payload = self._sock.recv_multipart()
            batch = self._decoder.decode(payload)
            with self._lock:
                self.batches += 1
                for ev in batch.events:
                    name = type(ev).__name__
                    if name == "BlockStored":
                        parent = ev.parent_block_hash
                        for h in ev.block_hashes:  # one block a page: page size 1 here
                            self.blocks[h] = (parent, list(ev.token_ids))
                            parent = h
                    elif name == "BlockRemoved":
                        for h in ev.block_hashes:
                            self.blocks.pop(h, None)
                            self.removed.append(h)
                    elif name == "AllBlocksCleared":
                        self.blocks.clear()
                        self.cleared += 1
        self._sock.close(linger=0)

    def settle(self, seconds: float = 1.5) -> None:
        """Wait until no batch arrived for ``seconds`` (the scheduler publishes after each step)."""
        last, since = -1, time.monotonic()
        while time.monotonic() - since < seconds:
            with self._lock:
                n = self.batches
            if n != last:
                last, since = n, time.monotonic()
            time.sleep(0.1)

    def sequences(self) -> list[list[int]]:
        """Every stored block's whole token path from the root."""
        with self._lock:
            blocks = dict(self.blocks)
        out = []
        for h in blocks:
            path: list[int] = []
            cur: int | None = h
            while cur is not None:
                if cur not in blocks:  # a parent the stream removed or never stored: not a matchable path
                    path = []
                    break
                parent, tokens = blocks[cur]
                path = tokens + path
                cur = parent
            if path:
                out.append(path)
        return out

    def holds(self, tokens: list[int]) -> bool:
        return any(p == tokens for p in self.sequences())

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)
        self._ctx.term()


@pytest.fixture(scope="module")
def events_server(server_pool: ServerPool, tiny_model: str) -> Iterator[tuple[ServerProcess, Subscriber]]:
    config = {"publisher": "zmq", "endpoint": f"tcp://*:{EVENTS_PORT}", "topic": TOPIC}
    args = [*FLAGS, "--sparse-method", "snapkv", "--sparse-config", json.dumps({"budget": 96}),
            "--kv-events-config", json.dumps(config)]
    with server_pool.use(spec(tiny_model, args)) as (srv,):
        sub = Subscriber(EVENTS_PORT)
        try:
            yield srv, sub
        finally:
            sub.close()


def _prefix(server: ServerProcess, route: str, body: dict[str, Any]) -> dict[str, Any]:
    r = requests.post(f"{server.base_url}/v1/prefix_cache/{route}", json=body, timeout=60)
    assert r.status_code in (200, 202), r.text
    return dict(r.json())


def test_events_follow_what_the_tree_matches(events_server: tuple[ServerProcess, Subscriber]) -> None:
    server, sub = events_server
    time.sleep(1.0)  # the subscription reaches the publisher (ZMQ drops what a PUB sends before a SUB joins)
    assert requests.post(f"{server.base_url}/flush_cache", timeout=30).status_code == 200
    sub.settle()
    assert sub.cleared >= 1 and not sub.sequences()

    rng = random.Random(5)
    prompt = [rng.randrange(10, 200) for _ in range(300)]
    out = server.generate(input_ids=prompt, max_new_tokens=8, ignore_eos=True)
    seq = prompt + out["output_ids"]
    sub.settle()
    a = _prefix(server, "inspect", {"token_ids": seq})
    # SnapKV 96 kept a fraction of the 300: the tree hides the rest, and the whole prefix still matches, so the
    # stream holds it whole.
    assert a["hidden_tokens"] > 0 and sub.holds(seq[:a["matched_tokens"]]), a

    # Another conversation sharing the first 200 prompt tokens: its branch is stored beside the first.
    other = prompt[:200] + [rng.randrange(10, 200) for _ in range(40)]
    out_b = server.generate(input_ids=other, max_new_tokens=4, ignore_eos=True)
    seq_b = other + out_b["output_ids"]
    sub.settle()
    b = _prefix(server, "inspect", {"token_ids": seq_b})
    assert sub.holds(seq_b[:b["matched_tokens"]]) and sub.holds(seq[:a["matched_tokens"]]), b

    # The second conversation matched the first's path up to its first hidden position (a conversation that is
    # not a continuation never reads a hole) and branched there. A prune of the first conversation from just
    # before that point hides more of it: still matchable, nothing published removed; with evict_branches the
    # second conversation's branch (hanging off the path after the range's start) goes, and the stream says so.
    branch = int(out_b["meta_info"]["cached_tokens"])
    assert 4 <= branch < 200, out_b["meta_info"]
    removed_before = len(sub.removed)
    res = _prefix(server, "prune", {"token_ids": seq, "ranges": [[branch - 4, branch + 20]], "evict_branches": True})
    assert res["status"] == "completed" and res["evicted_branch_slots"] > 0, res
    sub.settle()
    after = _prefix(server, "inspect", {"token_ids": seq})
    assert after["matched_tokens"] == a["matched_tokens"] and after["hidden_tokens"] > a["hidden_tokens"], after
    assert sub.holds(seq[:after["matched_tokens"]])
    assert len(sub.removed) > removed_before and not sub.holds(seq_b[:b["matched_tokens"]])
    gone = _prefix(server, "match", {"token_ids": seq_b})
    assert gone["matched_tokens"] < b["matched_tokens"], gone  # the branch is gone from the tree, as from the stream

    assert requests.post(f"{server.base_url}/flush_cache", timeout=30).status_code == 200
    sub.settle()
    assert not sub.sequences()
    assert_idle_and_sound(server)
