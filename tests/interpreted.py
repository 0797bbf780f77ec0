"""The Triton kernel tests under the Triton interpreter (CPU): ``TRITON_INTERPRET`` must be set before Triton is
imported, so they run in a subprocess, one for the whole session (python, torch, triton and pytest start once).

Each file of :data:`INTERPRETED_FILES` has a ``test_*_under_the_interpreter`` test that calls
:func:`assert_interpreted_passed`: the first call runs every file's tests but those ``*interpreter*`` ones with
``TRITON_INTERPRET=1``, and each call checks its own file's results. Under xdist the calls share one worker (the
conftest puts every test without a server in one group), hence one run.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).resolve().parents[1]
# Every file with tests that run only when INTERPRETED (and so a test_*_under_the_interpreter).
INTERPRETED_FILES = (
    "tests/test_fp8_attention.py",
    "tests/test_kernels.py",
    "tests/test_kivi.py",
    "tests/test_kivi_decode.py",
    "tests/test_layer_sets_kernel.py",
    "tests/test_omnikv.py",
    "tests/test_palu_kernels.py",
    "tests/test_palu_write.py",
    "tests/test_quest_kernels.py",
    "tests/test_retroinfer_kernels.py",
    "tests/test_selection_overhead.py",
    "tests/test_split_merge.py",
    "tests/test_turboquant_kernels.py",
)
RUN_TIMEOUT_S = 1800


@dataclass
class FileResults:
    """One file's tests in the interpreted run: names passed, skipped, and (name, message) failed or errored."""

    passed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class InterpretedRun:
    files: dict[str, FileResults]
    returncode: int
    output: str


def _module(test_file: str) -> str:
    """``tests/test_x.py`` (relative to the repository root, or absolute) -> ``tests.test_x``, junit's classname
    for its tests."""
    return ".".join((ROOT / test_file).resolve().relative_to(ROOT).with_suffix("").parts)


def _text(out: bytes | str | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""


@functools.cache
def interpreted_run() -> InterpretedRun:
    """Runs :data:`INTERPRETED_FILES` under the interpreter in one pytest process (no xdist: one process is the
    point), its results per file from a junit report."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    with tempfile.TemporaryDirectory(prefix="sgl-sparse-interpreted-") as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "addopts=", "-q",
               "--continue-on-collection-errors", "--disable-warnings", "-rfE", f"--junitxml={report}",
               *INTERPRETED_FILES, "-k", "not interpreter"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=ROOT)
            returncode, stdout, stderr = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:  # cached as a failed run: the next file must not wait it out again
            returncode = -1
            stdout = f"timed out after {RUN_TIMEOUT_S} s\n" + _text(e.stdout)
            stderr = _text(e.stderr)
        output = stdout[-6000:] + stderr[-3000:]
        files = {_module(f): FileResults() for f in INTERPRETED_FILES}
        if report.exists():
            for case in ET.parse(report).getroot().iter("testcase"):
                classname, name = case.get("classname", ""), case.get("name", "")
                # A test's classname is its module (or module.Class); a collection error's case has no classname
                # and the module as its name.
                owner = next((m for m in files if m in (classname, name) or classname.startswith(m + ".")), None)
                if owner is None:
                    continue
                res = files[owner]
                bad = [x for x in case if x.tag in ("failure", "error")]
                if bad:
                    res.failed.extend((name, f"{x.tag}: {x.get('message', '')}"[:800]) for x in bad)
                elif any(x.tag == "skipped" for x in case):
                    res.skipped.append(name)
                else:
                    res.passed.append(name)
    return InterpretedRun(files, returncode, output)


def assert_interpreted_passed(test_file: str) -> None:
    """Fails unless ``test_file``'s tests all passed in :func:`interpreted_run` (at least one ran), naming the
    failed ones and their messages, with the run's output tail."""
    module = _module(test_file)
    run = interpreted_run()
    assert module in run.files, f"{test_file} is not in interpreted.INTERPRETED_FILES"
    res = run.files[module]
    failures = "\n".join(f"  {name}: {msg}" for name, msg in res.failed)
    assert res.passed and not res.failed, (
        f"{module} under TRITON_INTERPRET=1: {len(res.passed)} passed, {len(res.failed)} failed\n{failures}\n"
        f"run exited {run.returncode}; output tail:\n{run.output}")
