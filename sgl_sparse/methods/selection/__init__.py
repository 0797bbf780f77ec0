"""Dynamic selection family: every KV entry stays resident; decode attention reads part of it."""
