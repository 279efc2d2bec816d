"""The engine resolver (runtime.dns)."""
