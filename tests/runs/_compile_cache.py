"""A persistent XLA compilation cache for tests that run the same programs several times.

An interrupted run and its resumption compile exactly the programs of the uninterrupted
run they are compared with; read from the cache, a tiny run costs seconds instead of a
full compile. `persistent_compile_cache(folder)` turns the cache on for a `with` block
(in-process runs) and `cache_env(folder)` gives the environment variables that turn it on
in a subprocess. `session_folder(tmp_path_factory)` is one folder for the whole pytest
session, so that the tiny configs' programs compiled by one test module serve the next.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")


@contextlib.contextmanager
def persistent_compile_cache(folder: str | Path):
    """Every program compiled inside the block is cached in `folder` (even the fastest),
    and found there by a later identical program; the settings before are put back after."""
    before = {name: getattr(jax.config, name) for name in _SETTINGS}
    for name, value in zip(_SETTINGS, (str(folder), 0.0, 0)):
        jax.config.update(name, value)
    compilation_cache.reset_cache()  # the cache is set up once per process: again, with the folder
    try:
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


def cache_env(folder: str | Path) -> dict:
    """The environment variables that make a subprocess use the cache in `folder`."""
    return {name.upper(): str(value) for name, value in zip(_SETTINGS, (folder, 0, 0))}


def session_folder(tmp_path_factory) -> Path:
    """The cache folder of this pytest session (shared by every module that asks for it)."""
    folder = tmp_path_factory.getbasetemp() / "compile_cache"
    folder.mkdir(exist_ok=True)
    return folder
