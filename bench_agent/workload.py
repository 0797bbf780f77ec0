"""Agent-session workloads: a config (TOML), a seeded generator, and a JSONL trace format.

A session is: a system prompt, a task, then turns of (model output, wait, tool result). The model
output length is what the replay asks the server to generate (``max_tokens`` + ``ignore_eos``);
the tool result is appended after the wait, and the next turn sends the whole history. Lengths are
in tokens; text is materialised at replay time with the served model's tokenizer
(:mod:`bench_agent.text`), so one trace replays against any model. See docs/bench_agent.md for the
statistics the defaults follow and how to change them.
"""

from __future__ import annotations

import json
import math
import random
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TRACE_VERSION = 1


@dataclass(frozen=True)
class LogNormal:
    """Lengths/times with a heavy right tail: ``median * exp(sigma * N(0,1))`` clipped to [lo, hi]."""

    median: float
    sigma: float
    lo: float
    hi: float

    def sample(self, rng: random.Random) -> float:
        return min(self.hi, max(self.lo, self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))))


@dataclass(frozen=True)
class WorkloadConfig:
    seed: int = 0
    sessions: int = 32
    mean_interarrival_s: float = 5.0  # Poisson arrivals
    system_prompt_tokens: tuple[int, int] = (1000, 4000)  # uniform
    task_tokens: tuple[int, int] = (50, 400)  # uniform
    max_turns: int = 64
    context_limit_tokens: int = 120_000  # a session ends before its context would exceed this
    tool_result_tokens: LogNormal = LogNormal(1500, 1.1, 500, 16_000)
    output_tokens: LogNormal = LogNormal(250, 0.6, 100, 1000)
    wait_s: LogNormal = LogNormal(2.0, 0.6, 0.2, 20.0)  # tool execution / think time between turns

    @classmethod
    def from_toml(cls, path: str | Path) -> WorkloadConfig:
        data = tomllib.loads(Path(path).read_text())
        return cls.from_dict(data.get("workload", data))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkloadConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown workload field(s) {unknown}; known: {sorted(known)}")
        kw: dict[str, Any] = {}
        for k, v in data.items():
            if k in ("tool_result_tokens", "output_tokens", "wait_s"):
                kw[k] = LogNormal(**v)
            elif k in ("system_prompt_tokens", "task_tokens"):
                kw[k] = (int(v[0]), int(v[1]))
            else:
                kw[k] = v
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.sessions < 1 or self.max_turns < 1:
            raise ValueError("sessions and max_turns must be >= 1")
        for name in ("system_prompt_tokens", "task_tokens"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"{name} must be [lo, hi] with 0 < lo <= hi")
        if self.context_limit_tokens <= self.system_prompt_tokens[1] + self.task_tokens[1]:
            raise ValueError("context_limit_tokens must exceed the largest system prompt + task")


@dataclass
class Turn:
    output_tokens: int
    tool_tokens: int  # the tool result appended after this turn's output (0 on the last turn)
    wait_s: float


@dataclass
class Session:
    id: str
    arrival_s: float
    system_tokens: int
    task_tokens: int
    text_seed: int
    turns: list[Turn] = field(default_factory=list)

    def final_context_tokens(self) -> int:
        return self.system_tokens + self.task_tokens + sum(t.output_tokens + t.tool_tokens for t in self.turns)


@dataclass
class Trace:
    config: dict[str, Any]
    sessions: list[Session]

    def save(self, path: str | Path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps({"type": "header", "version": TRACE_VERSION, "config": self.config}) + "\n")
            for s in self.sessions:
                f.write(json.dumps({"type": "session", **asdict(s)}) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        lines = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
        if not lines or lines[0].get("type") != "header" or lines[0].get("version") != TRACE_VERSION:
            raise ValueError(f"{path}: not a bench_agent trace (version {TRACE_VERSION})")
        sessions = []
        for d in lines[1:]:
            d.pop("type")
            d["turns"] = [Turn(**t) for t in d["turns"]]
            sessions.append(Session(**d))
        return cls(config=lines[0]["config"], sessions=sessions)


def generate(cfg: WorkloadConfig) -> Trace:
    rng = random.Random(cfg.seed)
    sessions, t = [], 0.0
    for i in range(cfg.sessions):
        if i:
            t += rng.expovariate(1.0 / cfg.mean_interarrival_s) if cfg.mean_interarrival_s > 0 else 0.0
        s = Session(id=f"s{i:03d}", arrival_s=round(t, 3), system_tokens=rng.randint(*cfg.system_prompt_tokens),
                    task_tokens=rng.randint(*cfg.task_tokens), text_seed=rng.randrange(2**31))
        ctx = s.system_tokens + s.task_tokens
        for _ in range(cfg.max_turns):
            out = int(cfg.output_tokens.sample(rng))
            tool = int(cfg.tool_result_tokens.sample(rng))
            if ctx + out > cfg.context_limit_tokens:
                break
            if ctx + out + tool > cfg.context_limit_tokens:
                tool = 0  # the session's last turn: no tool result follows
            s.turns.append(Turn(output_tokens=out, tool_tokens=tool, wait_s=round(cfg.wait_s.sample(rng), 3)))
            ctx += out + tool
            if tool == 0:
                break
        if s.turns:
            s.turns[-1].tool_tokens = 0
        sessions.append(s)
    return Trace(config=asdict(cfg), sessions=sessions)
