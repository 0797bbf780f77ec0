"""examples/agent_loop.py as a user runs it: its own process, the OpenAI client, against a real CPU server of the
small trained model under SnapKV 512 (Chain Cache each turn) with the cache report on."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sgl_sparse.server_process import CPU_SERVER_FLAGS, ServerProcess
from tests.server_pool import ServerPool, assert_idle_and_sound, fresh, spec

pytestmark = pytest.mark.server
ROOT = Path(__file__).resolve().parents[1]
TURN = re.compile(r"turn (\d+): prompt (\d+) tokens, cached (\d+); history (\d+) tokens held as (\d+) resident \+ "
                  r"(\d+) hidden; pruned (\d+) this turn")


@pytest.fixture(scope="module")
def agent_server(server_pool: ServerPool, small_suite: tuple[str, list]) -> Iterator[ServerProcess]:
    args = [*CPU_SERVER_FLAGS, "--enable-cache-report", "--sparse-method", "snapkv", "--sparse-config",
            json.dumps({"budget": 512})]
    with server_pool.use(spec(small_suite[0], args)) as (srv,):
        yield srv


def test_the_agent_loop_prunes_resumes_and_answers(agent_server: ServerProcess) -> None:
    fresh(agent_server)
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "agent_loop.py"), "--base-url",
                          agent_server.base_url, "--turns", "4", "--lag", "2"], capture_output=True, text=True,
                         timeout=600, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    turns = [tuple(int(x) for x in m.groups()) for m in TURN.finditer(out.stdout)]
    assert [t[0] for t in turns] == [1, 2, 3, 4], out.stdout
    for n, prompt, cached, history, resident, hidden, _ in turns[1:]:
        # Each turn resends the whole history and hits what the turn before it left (its prompt, at least).
        assert cached >= turns[n - 2][1] - 1, out.stdout
        assert history == resident + hidden and history >= prompt - 1, out.stdout
    # The 4th turn's prompt holds 3 tool results: the oldest is pruned (lag 2), so the history hides tokens beyond
    # what SnapKV evicted; the 3rd turn's prompt held only 2.
    assert turns[2][6] == 0 and turns[3][6] > 0 and turns[3][5] >= turns[3][6], out.stdout
    answer = re.search(r"answer '(\d+)', expected '(\d+)'", out.stdout)
    assert answer and answer.group(1) == answer.group(2), out.stdout
    assert_idle_and_sound(agent_server)
