"""The chat template's generation prompt as later requests see it (for Chain Cache's resume point).

An OpenAI chat request ends with the template's generation prompt (``add_generation_prompt``). Two kinds of
later match leave that prompt a few tokens before its end: a selector of the same messages rendered without
the generation prompt (``POST /v1/prefix_cache/prune``, ``match``, ``inspect`` with ``messages``: an agent
prunes the turn it just sent), and, where the template writes the assistant turn differently from its
generation prompt (a header without the role's prefix, a ``<think>`` it strips from history), the next turn.
This finds those tokens once per server by rendering two small conversations each way; the tree lets a
continuation resume from before them (``SparseRadixCache.resume_suffix``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

# Longer than any generation prompt we know of (DeepSeek-R1's is 2-3 tokens): a longer difference
# means the template rewrites the history, and resuming from before it would not be this
# conversation's state.
MAX_SUFFIX_TOKENS = 16
_SAMPLES = (("Hello there.", "Sure."), ("List the files in src.", " Done: 3 files.\n"))


def _ids(out: Any) -> list[int]:
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


def generation_suffix(tokenizer: Any, chat_template: str | None = None) -> tuple[int, ...]:
    """Token ids at the end of a generation prompt that a later request of the same conversation may not
    share: the generation prompt itself (what ``add_generation_prompt`` appends to the messages), or, where
    longer, what the next turn's rendering does not share with it; ``()`` when there is no template, or
    when the samples disagree (then nothing is assumed)."""
    if tokenizer is None or (chat_template is None and not getattr(tokenizer, "chat_template", None)):
        return ()
    found: set[tuple[int, ...]] = set()
    for question, answer in _SAMPLES:
        first = [{"role": "user", "content": question}]
        turn = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}]
        try:
            a = _ids(tokenizer.apply_chat_template(first, add_generation_prompt=True, tokenize=True,
                                                   chat_template=chat_template))
            b = _ids(tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=True,
                                                   chat_template=chat_template))
        except Exception as e:  # a template that needs other roles or arguments: assume nothing
            logger.info("sgl_sparse: chat template not rendered for Chain Cache's resume point (%s)", e)
            return ()
        try:  # a template that must end with the generation prompt: the next turn's part alone
            plain = _ids(tokenizer.apply_chat_template(first, add_generation_prompt=False, tokenize=True,
                                                       chat_template=chat_template))
        except Exception:
            plain = a
        # Both are suffixes of the generation prompt's rendering: the longer one holds the other.
        found.add(tuple(a[min(_common_prefix(a, plain), _common_prefix(a, b)):]))
    if len(found) != 1:
        return ()
    suffix = found.pop()
    return suffix if len(suffix) <= MAX_SUFFIX_TOKENS else ()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def load_suffix(server_args: Any) -> tuple[int, ...]:
    """:func:`generation_suffix` for a server: its tokenizer and ``--chat-template`` when that is a
    Jinja file (SGLang's named templates are rendered elsewhere: nothing assumed then)."""
    if getattr(server_args, "skip_tokenizer_init", False):
        return ()
    from transformers import AutoTokenizer

    template = None
    path = getattr(server_args, "chat_template", None)
    if path:
        if not str(path).endswith(".jinja"):
            return ()
        with open(path, encoding="utf-8") as f:
            template = f.read()
    try:
        tok = AutoTokenizer.from_pretrained(server_args.tokenizer_path,
                                            trust_remote_code=getattr(server_args, "trust_remote_code", False))
    except Exception as e:
        logger.info("sgl_sparse: tokenizer not loaded for Chain Cache's resume point (%s)", e)
        return ()
    return generation_suffix(tok, template)
