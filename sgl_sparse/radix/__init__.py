"""The sparse-aware prefix tree (an SGLang ``RadixCache`` subclass)."""
