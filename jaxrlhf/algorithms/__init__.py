"""The algorithms as pure functions composed into jitted steps."""
