"""Random response-aligned test inputs: masks with prefix lengths, garbage padding."""

import numpy as np


def prefix_mask(lengths, t):
    """`[B, T]` bool mask whose row `b` is valid on its first `lengths[b]` tokens."""
    return np.arange(t)[None, :] < np.asarray(lengths)[:, None]


def random_mask(rng, b, t):
    """A `[B, T]` mask with random lengths, always including length 0 and length T."""
    lengths = rng.integers(0, t + 1, size=b)
    lengths[0] = 0
    lengths[-1] = t
    return prefix_mask(lengths, t)


def pad_right(x, extra, rng):
    """Appends `extra` columns of garbage (huge, inf, NaN, random) to a `[B, T]` array."""
    garbage = rng.choice([1e30, -1e30, np.inf, -np.inf, np.nan, 7.0], size=(x.shape[0], extra))
    return np.concatenate([x, garbage.astype(x.dtype)], axis=1)


def pad_mask(mask, extra):
    return np.concatenate([mask, np.zeros((mask.shape[0], extra), mask.dtype)], axis=1)
