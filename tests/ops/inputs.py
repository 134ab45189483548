"""Random response-aligned test inputs: masks with prefix lengths or with holes, garbage
padding, and the compaction of a mask with holes to the rows it stands for."""

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


def holes_mask(rng, b, t, p=0.3):
    """A `[B, T]` policy mask with holes, as an episode's environment tokens make them: a
    `random_mask` whose valid tokens each turn 0 with probability `p`. Row 0 stays empty;
    for p > 0 the last row, when T ≥ 3, starts and ends on a policy token with a hole
    between. p = 0 gives the `random_mask` itself."""
    mask = random_mask(rng, b, t) & (rng.random((b, t)) >= p)
    if p > 0 and b > 1 and t >= 3:
        mask[-1, [0, -1]] = True
        mask[-1, rng.integers(1, t - 1)] = False
    return mask


def compact(x, mask, fill=0.0):
    """Each row's policy tokens (`mask` 1) moved to the front in order, `fill` after them:
    the row an episode's mask with holes stands for. Returns `(x, mask)` compacted."""
    out = np.full(x.shape, fill, dtype=x.dtype)
    new_mask = np.zeros(mask.shape, bool)
    for row in range(x.shape[0]):
        policy = np.flatnonzero(mask[row])
        out[row, : len(policy)] = x[row, policy]
        new_mask[row, : len(policy)] = True
    return out, new_mask


def expand(x, mask):
    """The inverse of `compact` for a `[B, T]` output: row `b`'s first `n_b` entries back on
    its policy tokens, 0 elsewhere."""
    out = np.zeros(x.shape, np.asarray(x).dtype)
    for row in range(x.shape[0]):
        policy = np.flatnonzero(mask[row])
        out[row, policy] = np.asarray(x)[row, : len(policy)]
    return out
