"""Liveness: every storage's live interval, the one sweep over them, timelines composed across graphs, symbolic sizes and the symbolic model, layer reuse."""
