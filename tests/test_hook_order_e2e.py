"""The contract's hook order (``sgl_sparse/contract/method.py`` docstring) as a real server drives it: a probe
method (``tests/hook_probe.py``, loaded through ``SGLSPARSE_METHOD_MODULES``) logs every hook call of the
scheduler, in order; the test replays a chunked prefill, decode, a prefix hit, a concurrent batch and an
abort, then checks the log against the docstring's grammar."""

from __future__ import annotations

import json
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from sgl_sparse.server_process import CPU_SERVER_FLAGS
from tests.server_pool import ServerPool, spec
from tests.test_eviction_e2e import _abort_after, _assert_idle_and_sound, _ids

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parent.parent
SELECTOR_HOOKS = {"on_kv_write", "select", "attend", "observe"}
LAYERS = 4  # the tiny model's; the probe observes layer 0 and selects in 1..3
PREFILL_FORWARD = [("on_kv_write", layer) for layer in range(1, LAYERS)]


def _decode_forward(read: str) -> list[tuple[str, int]]:
    return [("observe", 0)] + [(h, layer) for layer in range(1, LAYERS) for h in ("on_kv_write", read)]



def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _forwards(events: list[dict]) -> list[tuple[int, int, list[tuple[str, int]]]]:
    """Maximal runs of selector calls (one forward each): (first index, end index, [(hook, layer)])."""
    runs, i = [], 0
    while i < len(events):
        if events[i]["hook"] in SELECTOR_HOOKS:
            j = i
            while j < len(events) and events[j]["hook"] in SELECTOR_HOOKS:
                j += 1
            runs.append((i, j, [(e["hook"], e["layer"]) for e in events[i:j]]))
            i = j
        else:
            i += 1
    return runs


def _check_request(rid: str, evs: list[tuple[int, dict]], forwards: list[tuple[int, int, list]],
                   decode_forward: list[tuple[str, int]]) -> None:
    """One request's hooks follow the docstring: new_state (+ restore_state) first; per prefill chunk
    on_prefill_chunk -> (a prefill forward) -> [on the final chunk: on_prune of a request that prunes its own
    prompt, then on_observation over the keys left] -> on_step_end; per decode step (a decode forward) ->
    on_step_end; on_finish once, last."""
    hooks = [e["hook"] for _, e in evs]
    assert hooks[0] == "new_state" and hooks[-1] == "on_finish", (rid, hooks)
    assert hooks.count("new_state") == 1 and hooks.count("on_finish") == 1, (rid, hooks)
    first = 2 if len(hooks) > 2 and hooks[1] == "restore_state" else 1
    seq = evs[first:-1]
    assert all(e["hook"] != "restore_state" for _, e in seq), (rid, hooks)
    kinds = {start: pattern for start, _, pattern in forwards}

    def forward_between(a: int, b: int) -> list[list[tuple[str, int]]]:
        return [pattern for start, pattern in kinds.items() if a < start < b]

    k, expect, prompt_done, last = 0, None, False, evs[0][0]
    while k < len(seq):
        idx, e = seq[k]
        if e["hook"] == "on_prefill_chunk":
            assert not prompt_done and (expect is None or e["start"] == expect), (rid, e)
            final = e["end"] == e["total"]
            pruned = final and seq[k + 1][1]["hook"] == "on_prune"
            after = ["on_observation", "on_step_end"] if final else ["on_step_end"]
            if pruned:
                prune, observation = seq[k + 1][1], seq[k + 2][1]
                assert rid == "prune-probe" and observation["keys"] == prune["kept"] - len(prune["pruned"]), \
                    (rid, prune, observation)
                after = ["on_prune", *after]
            tail = [x["hook"] for _, x in seq[k + 1:k + 1 + len(after)]]
            assert tail == after, (rid, hooks)
            step_idx, step = seq[k + len(after)]
            assert step["prefill"] and step["final"] == final, (rid, step)
            assert forward_between(idx, step_idx) == [PREFILL_FORWARD], (rid, e)
            expect, prompt_done, last = e["end"], final, step_idx
            k += 1 + len(after)
        else:
            assert e["hook"] == "on_step_end" and not e["prefill"] and prompt_done, (rid, hooks)
            assert forward_between(last, idx)[-1:] == [decode_forward], (rid, e)
            last = idx
            k += 1


@pytest.mark.parametrize("attends", [False, True], ids=["select", "attend"])
def test_the_server_drives_the_contracts_hook_order(tiny_model: str, tmp_path: Path, attends: bool,
                                                    server_pool: ServerPool) -> None:
    """``attends``: the probe's selector attends itself and maintains (RetroInfer's kind): ``attend``
    instead of ``select`` in each decode forward, and ``after_step`` once after every forward."""
    decode_forward = _decode_forward("attend" if attends else "select")
    log = tmp_path / "hooks.jsonl"
    env = {"SGLSPARSE_METHOD_MODULES": "tests.hook_probe",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = [*CPU_SERVER_FLAGS, "--chunked-prefill-size", "128", "--sparse-method", "hook_probe",
            "--sparse-config", json.dumps({"log_path": str(log), "attends": attends})]
    rng = random.Random(21)
    with server_pool.use(spec(tiny_model, args, env=env), once=True) as (srv,):
        prompt = _ids(rng, 300)  # 3 chunks
        first = srv.generate(input_ids=prompt, max_new_tokens=6, ignore_eos=True)
        assert first["meta_info"]["cached_tokens"] == 0
        second = srv.generate(input_ids=prompt + first["output_ids"] + _ids(rng, 40), max_new_tokens=5,
                              ignore_eos=True)
        assert second["meta_info"]["cached_tokens"] >= 300  # a prefix hit: restore_state
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda n: srv.generate(input_ids=_ids(random.Random(n), n), max_new_tokens=8,
                                                 ignore_eos=True), (50, 200, 420)))
        t = threading.Thread(target=_abort_after, args=(srv, "abort-probe", 0.3))
        t.start()
        requests.post(f"{srv.base_url}/generate", timeout=120, json={
            "rid": "abort-probe", "input_ids": _ids(rng, 200),
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}})
        t.join()
        # A request that prunes its own prompt: on_prune in its final prefill step, before on_observation.
        cp = {"sgl_sparse_prune": json.dumps({"ranges": [[10, 60], [200, 210]]})}
        sampling = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True, "custom_params": cp}
        r = requests.post(f"{srv.base_url}/generate", timeout=120,
                          json={"rid": "prune-probe", "input_ids": _ids(rng, 260), "sampling_params": sampling})
        assert r.status_code == 200, r.text[:300]
        _assert_idle_and_sound(srv)
        reference = srv.generate(input_ids=prompt, max_new_tokens=6, ignore_eos=True)
        _assert_idle_and_sound(srv)  # the log is read below with the server up: its last hooks written first
    # The probe selects every token: its outputs are dense, whatever it logs.
    assert reference["output_ids"] == first["output_ids"]

    events = _events(log)
    assert events[0]["hook"] == "allocate" and len({e["pid"] for e in events}) == 1  # one scheduler
    if attends:  # after_step: exactly once after each forward, before the next one
        marks = [e["hook"] for e in events if e["hook"] == "after_step" or e["hook"] in ("observe", "on_kv_write")]
        runs = "".join("s" if h == "after_step" else "f" for h in marks)
        collapsed = "".join(c for i, c in enumerate(runs) if i == 0 or c != runs[i - 1] or c == "s")
        assert collapsed == "fs" * (len(collapsed) // 2), collapsed[:80]
        steps = [e for e in events if e["hook"] == "after_step"]
        assert all(o < n for e in steps for o, n in zip(e["old"], e["new"])), steps[:3]
        events = [e for e in events if e["hook"] != "after_step"]
    else:
        assert not any(e["hook"] == "after_step" for e in events)
    forwards = _forwards(events)
    assert all(p in (PREFILL_FORWARD, decode_forward) for _, _, p in forwards), [p for _, _, p in forwards]
    assert any(p == decode_forward for _, _, p in forwards) and any(p == PREFILL_FORWARD for _, _, p in forwards)
    by_rid: dict[str, list[tuple[int, dict]]] = {}
    for i, e in enumerate(events):
        if "rid" in e:
            by_rid.setdefault(e["rid"], []).append((i, e))
    assert len(by_rid) >= 6  # the server's warm-up request too
    assert any(e["hook"] == "restore_state" for evs in by_rid.values() for _, e in evs)
    assert "abort-probe" in by_rid
    prunes = [e for evs in by_rid.values() for _, e in evs if e["hook"] == "on_prune"]
    assert [(e["rid"], e["pruned"], e["kept"]) for e in prunes] == [
        ("prune-probe", [*range(10, 60), *range(200, 210)], 260)]
    for rid, evs in by_rid.items():
        _check_request(rid, evs, forwards, decode_forward)
