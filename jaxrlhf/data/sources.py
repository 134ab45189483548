"""Where a task's rows come from: a source spec of files and TFDS datasets, mixed by weight.

A spec is comma-separated sources, each optionally followed by `:weight`:

    "train.jsonl"                                   one file (JSONL, or Parquet by its suffix)
    "a.jsonl,b.parquet"                             both, every row of each
    "a.jsonl:0.7,tfds:my_dataset/train:0.3"         mixed: 70 % of the rows from a, 30 % from the TFDS split

`tfds:<name>/<split>` loads a prepared TFDS dataset by name from `data_dir`
(`data.tfds.load_records`; nothing is downloaded). With weights (all sources or none),
the mixture has as many rows as the sources' usable rows together, source i giving
round(N · wᵢ / Σw) of them, drawn by a permutation seeded with (`seed`, i) and cycled when
a source has fewer rows than its share: a pure function of the spec, the files and `seed`.
Each source is parsed on its own, so every bad row is reported with its own `file:line`.
Every source is read within `max_row_bytes` per row and a file within `max_file_bytes`
(`jsonl.read_records`, `tfds.load_records`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from jaxrlhf.data.jsonl import MAX_FILE_BYTES, read_records
from jaxrlhf.data.records import MAX_ROW_BYTES, SkipReport


def parse_spec(spec: str, field: str = "task.path") -> list[tuple[str, float | None]]:
    """`[(source, weight or None), ...]` of a spec; `field` names it in errors."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        head, _, tail = item.rpartition(":")
        try:
            weight = float(tail) if head else None
        except ValueError:
            weight = None
        if weight is None:
            out.append((item, None))
        elif weight < 0 or not np.isfinite(weight):
            raise ValueError(f"{field}: weight {tail!r} of {head!r} must be a finite number >= 0")
        else:
            out.append((head, weight))
    if not out:
        raise ValueError(f"{field} is empty: give a .jsonl/.parquet file or tfds:<name>/<split>")
    if len({w is None for _, w in out}) > 1:
        raise ValueError(f"{field}={spec!r}: give a weight to every source or to none")
    return out


def source_records(source: str, *, data_dir: str = "", max_row_bytes: int | None = MAX_ROW_BYTES,
                   max_file_bytes: int | None = MAX_FILE_BYTES):
    """The `(location, record)` rows of one source: a .jsonl/.parquet file or `tfds:name/split`,
    a row of more than `max_row_bytes` a DataError, a file over `max_file_bytes` refused."""
    if source.startswith("tfds:"):
        from jaxrlhf.data import tfds

        name, _, split = source[len("tfds:"):].partition("/")
        if not name or not split:
            raise ValueError(f"{source!r}: a TFDS source is tfds:<name>/<split>, e.g. tfds:gsm8k/train")
        return tfds.load_records(name, split=split, data_dir=data_dir or None, max_row_bytes=max_row_bytes)
    return read_records(source, max_row_bytes=max_row_bytes, max_file_bytes=max_file_bytes)


def read_mixture(spec: str, parse: Callable[[Any, str], NamedTuple], *, data_dir: str = "", seed: int = 0,
                 field: str = "task.path", max_row_bytes: int | None = MAX_ROW_BYTES,
                 max_file_bytes: int | None = MAX_FILE_BYTES) -> NamedTuple:
    """`parse(records, source)` (e.g. a `records.*_from_records` with its options bound) of
    every source of `spec`, mixed as the module docstring says; `skipped` sums them."""
    bounds = dict(max_row_bytes=max_row_bytes, max_file_bytes=max_file_bytes)
    parts = [(source, weight, parse(source_records(source, data_dir=data_dir, **bounds), source))
             for source, weight in parse_spec(spec, field)]
    return mix([(p, w) for _, w, p in parts], seed=seed, names=[s for s, _, _ in parts], field=field)


def mix(parts: list[tuple[NamedTuple, float | None]], *, seed: int, names: list[str], field: str) -> NamedTuple:
    """The rows of `parts` (column-wise NamedTuples with a `skipped` SkipReport) joined:
    all rows of each when no weights, else each part's weighted share (module docstring)."""
    first = parts[0][0]
    sizes = [len(p.location) for p, _ in parts]
    if parts[0][1] is None:
        picks = [np.arange(n) for n in sizes]
    else:
        total, weights = sum(sizes), np.asarray([w for _, w in parts], float)
        if weights.sum() <= 0:
            raise ValueError(f"{field}: the weights add up to 0")
        picks = []
        for i, (n, w) in enumerate(zip(sizes, weights)):
            k = int(round(total * w / weights.sum()))
            if k and not n:
                raise ValueError(f"{field}: source {names[i]!r} has weight {w:g} but no usable rows")
            order = np.random.default_rng([seed, i]).permutation(n) if n else np.zeros(0, int)
            picks.append(np.resize(order, k))
    skipped = SkipReport()
    for p, _ in parts:
        skipped.merge(p.skipped)
    columns = {f: [getattr(p, f)[j] for (p, _), idx in zip(parts, picks) for j in idx]
               for f in first._fields if f != "skipped"}
    return type(first)(**columns, skipped=skipped)
