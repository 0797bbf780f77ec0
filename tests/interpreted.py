"""Re-running a kernel test file under the Triton interpreter (CPU): ``TRITON_INTERPRET`` must be set
before Triton is imported, so the interpreted run is a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def rerun_interpreted(test_file: str) -> None:
    """Runs ``test_file``'s tests but the ones named ``*interpreter*`` with ``TRITON_INTERPRET=1``;
    fails with the output's tail unless they all pass."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", "not interpreter"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
