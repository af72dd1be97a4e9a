"""Command-line tools that prepare software for GPU machines (no torch, no process groups)."""
