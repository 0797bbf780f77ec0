"""Natural-ish text of a requested token length, for a given tokenizer.

Words come from documentation that ships with Python (stdlib docstrings, the corpus the tiny model's
tokenizer is trained on), drawn from a seeded position, so the same trace gives the same text.
"""

from __future__ import annotations

import random
from typing import Any

from sgl_sparse.tiny_model import _corpus


class TextSource:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.words = " ".join(_corpus()).split()
        sample = " ".join(self.words[:4000])
        self.tokens_per_word = max(0.2, len(self._encode(sample)) / 4000)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def text(self, n_tokens: int, rng: random.Random) -> str:
        """About ``n_tokens`` tokens (within a few) of text."""
        if n_tokens <= 0:
            return ""
        n_words = max(1, int(n_tokens / self.tokens_per_word))
        start = rng.randrange(len(self.words))
        words = [self.words[(start + i) % len(self.words)] for i in range(n_words + 64)]
        lo, hi = 1, len(words)
        for _ in range(3):  # a few corrections around the estimate are enough
            k = min(hi, max(lo, n_words))
            got = len(self._encode(" ".join(words[:k])))
            if got == n_tokens:
                break
            n_words = max(1, k + int((n_tokens - got) / self.tokens_per_word))
            if n_words > len(words):
                words += [self.words[(start + len(words) + i) % len(self.words)] for i in range(n_words)]
                hi = len(words)
        return " ".join(words[: max(1, n_words)])
