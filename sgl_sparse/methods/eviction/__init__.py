"""Eviction family: methods that physically drop KV entries (one token set for all layers and heads)."""
