"""A synthetic long-context task suite (in the spirit of RULER and of agent transcripts), from a seed.

Every example is a prompt (plain text, or chat messages for the agent task) and one exact answer.
Haystack text is drawn from documentation that ships with Python (stdlib docstrings), so the
context reads like prose, with needles inserted at random depths. Lengths are in haystack words;
the caller sizes them to a token budget with its tokenizer (:func:`fit_to_tokens`).

Tasks:

* ``niah_single``: one "special magic number" needle; ask for it.
* ``niah_multikey``: several needles with different keys; ask for one key's number.
* ``niah_multivalue``: one key with several numbers; answer all, in order of appearance.
* ``vartrack``: multi-hop assignments (``The value 31415 is stored in VAR AK``, ``VAR AK is copied to
  VAR BM``, ...) in two interleaved chains; name every variable of one value's chain, in order.
* ``freqword``: a list of words; answer the three most frequent, most frequent first.
* ``agent_recall``: a chat transcript whose earlier tool results carry facts; the last user turn
  asks for one of them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vartrack", "freqword", "agent_recall")
KEY_WORDS = ["amber", "birch", "cobalt", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper",
             "kepler", "lumen", "marble", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra",
             "umber", "velvet", "willow", "xenon", "yarrow", "zephyr"]
VAR_NAMES = [f"{a}{b}" for a in "ABCDEFGHJKLMNPQRSTUVWXYZ" for b in "KMPQRTVXZ"]
FREQ_WORDS = ["apple", "river", "stone", "cloud", "lemon", "tiger", "piano", "candle", "forest", "rocket",
              "mirror", "garden", "silver", "window", "pencil", "bridge", "castle", "ocean", "meadow", "lantern"]


@dataclass
class Example:
    task: str
    prompt: str | None  # plain-text tasks
    messages: list[dict[str, str]] | None  # agent task (chat)
    answer: str
    meta: dict[str, object] = field(default_factory=dict)


@lru_cache(maxsize=1)
def haystack_sentences() -> tuple[str, ...]:
    from sgl_sparse.tiny_model import _corpus

    out = []
    for doc in _corpus():
        for part in doc.replace("\n", " ").split(". "):
            part = " ".join(part.split())
            if 4 <= len(part.split()) <= 40 and not any(ch.isdigit() for ch in part):
                out.append(part.rstrip(".") + ".")
    return tuple(out)


def _haystack(rng: random.Random, n_words: int) -> list[str]:
    sents = haystack_sentences()
    out, words = [], 0
    i = rng.randrange(len(sents))
    while words < n_words:
        s = sents[i % len(sents)]
        out.append(s)
        words += len(s.split())
        i += 1
    return out


def _insert(rng: random.Random, sentences: list[str], needles: list[str]) -> str:
    """Needles at random depths, keeping their relative order."""
    slots = sorted(rng.randrange(len(sentences) + 1) for _ in needles)
    out = list(sentences)
    for k, (pos, needle) in enumerate(zip(slots, needles)):
        out.insert(pos + k, needle)
    return " ".join(out)


def _number(rng: random.Random) -> str:
    return str(rng.randrange(10_000, 1_000_000))


def _qa(context: str, question: str) -> str:
    return f"{context}\nQuestion: {question}\nAnswer:"


def niah_single(rng: random.Random, n_words: int) -> Example:
    key, value = rng.choice(KEY_WORDS), _number(rng)
    ctx = _insert(rng, _haystack(rng, n_words), [f"The special magic number for {key} is {value}."])
    return Example("niah_single", _qa(ctx, f"What is the special magic number for {key}?"), None, value)


def niah_multikey(rng: random.Random, n_words: int) -> Example:
    keys = rng.sample(KEY_WORDS, 4)
    values = [_number(rng) for _ in keys]
    needles = [f"The special magic number for {k} is {v}." for k, v in zip(keys, values)]
    i = rng.randrange(len(keys))
    ctx = _insert(rng, _haystack(rng, n_words), needles)
    return Example("niah_multikey", _qa(ctx, f"What is the special magic number for {keys[i]}?"), None, values[i])


def niah_multivalue(rng: random.Random, n_words: int) -> Example:
    key = rng.choice(KEY_WORDS)
    values = [_number(rng) for _ in range(3)]
    needles = [f"One of the special magic numbers for {key} is {v}." for v in values]
    ctx = _insert(rng, _haystack(rng, n_words), needles)
    q = f"What are all the special magic numbers for {key}?"
    return Example("niah_multivalue", _qa(ctx, q), None, ", ".join(values))


def _near_miss(rng: random.Random, value: str) -> str:
    """A different number that shares leading or trailing digits with ``value``."""
    while True:
        other = _number(rng)
        k = rng.randrange(1, min(len(value), len(other)))
        out = value[:k] + other[k:] if rng.random() < 0.5 else other[: len(other) - k] + value[-k:]
        if out != value and out[0] != "0":
            return out


def _near_name(rng: random.Random, name: str, taken: list[str]) -> str:
    """An unused variable name that shares one letter, in place, with ``name``."""
    return rng.choice([n for n in VAR_NAMES if n not in taken and (n[0] == name[0]) != (n[1] == name[1])])


def vartrack(rng: random.Random, n_words: int, confusable: bool = False) -> Example:
    """Two interleaved 4-variable chains; the answer follows one of them hop by hop.

    ``confusable`` (training only) makes the other chain a near miss: its value shares leading or
    trailing digits with the asked one, and each of its names shares a letter with the asked chain's
    name at the same hop, so a model must match whole numbers and names, not their last token.
    """
    names = rng.sample(VAR_NAMES, 8)
    values = [_number(rng), _number(rng)]
    if confusable:
        values[1] = _near_miss(rng, values[0])
        for i in range(4):
            names[4 + i] = _near_name(rng, names[i], names[:4] + names[4:4 + i])
    chains = [[f"The value {v} is stored in VAR {ns[0]}."] + [f"VAR {ns[i - 1]} is copied to VAR {ns[i]}."
                                                             for i in range(1, 4)]
              for v, ns in zip(values, (names[:4], names[4:]))]
    needles = []
    while chains[0] or chains[1]:  # a random merge that keeps each chain's order
        c = chains[rng.randrange(2)] if chains[0] and chains[1] else (chains[0] or chains[1])
        needles.append(c.pop(0))
    ctx = _insert(rng, _haystack(rng, n_words), needles)
    q = f"Which variables hold the value {values[0]}?"
    return Example("vartrack", _qa(ctx, q), None, ", ".join(names[:4]))


def freqword(rng: random.Random, n_words: int) -> Example:
    words = rng.sample(FREQ_WORDS, 10)
    # The top three stand clear of each other and of the rest (as in RULER's common-words task): a unique
    # answer that a model can read off by frequency, not by exact counting.
    counts = dict(zip(words, [10, 7, 5, 2, 2, 2, 1, 1, 1, 1]))
    scale = max(1, round(n_words / sum(counts.values())))
    bag = [w for w, c in counts.items() for _ in range(c * scale)]
    rng.shuffle(bag)
    top = sorted(counts, key=lambda w: -counts[w])[:3]
    ctx = "Words: " + " ".join(bag) + "."
    q = "What are the three most frequent words in the list?"
    return Example("freqword", _qa(ctx, q), None, ", ".join(top))


def agent_recall(rng: random.Random, n_words: int, turns: int = 4) -> Example:
    facts = []
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Inspect the service configuration."}]
    per_turn = max(20, n_words // turns)
    for t, key in enumerate(rng.sample(KEY_WORDS, turns)):
        value = _number(rng)
        facts.append((key, value))
        messages.append({"role": "assistant", "content": f"Running step {t + 1}."})
        body = _insert(rng, _haystack(rng, per_turn), [f"The port of service {key} is {value}."])
        messages.append({"role": "tool", "content": body})
    key, value = rng.choice(facts[:-1]) if turns > 1 else facts[0]
    messages.append({"role": "user", "content": f"What is the port of service {key}?"})
    return Example("agent_recall", None, messages, value)


GENERATORS: dict[str, Callable[[random.Random, int], Example]] = {
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "vartrack": vartrack,
    "freqword": freqword,
    "agent_recall": agent_recall,
}


def make_example(task: str, seed: int, n_words: int, confusable: bool = False) -> Example:
    """``confusable`` (training data only; evaluation never sets it): near-miss distractors where a
    task has them (``vartrack``); other tasks ignore it."""
    if task not in GENERATORS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    rng = random.Random(f"{task}:{seed}")
    if confusable and task == "vartrack":
        return vartrack(rng, n_words, confusable=True)
    return GENERATORS[task](rng, n_words)


def score(example: Example, output: str) -> bool:
    """Exact match of the first line of the output (surrounding space and a final period ignored)."""
    first = output.strip().split("\n")[0].strip().rstrip(".").strip()
    return first == example.answer
