"""A Tinker-compatible training service over rlhf's primitives (``rlhf serve-tinker``; docs/tinker.md)."""
