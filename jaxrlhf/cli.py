"""What a user of `python -m jaxrlhf.train` sees when something is wrong: one line.

A failed run ends with exit status 1 and, as the last line on stderr,
`error: <what went wrong, naming the key/file/line/tensor> (<where the full traceback is>)`.
The full traceback goes to the run log `<workdir>/train.log` (`jaxrlhf.runlog`) once the run
owns its workdir; before that (a bad flag, a config error, a refused start) it is shown
only with `JAXRLHF_TRACEBACK=1`, which also prints it on stderr for any failure, for
developers. A full disk is named as such, with the checkpoints that are intact. A
SIGTERM ends with status 0 and a line saying what was kept, Ctrl-C with status 130 and
`error: interrupted (Ctrl-C) ...` (`jaxrlhf.exits`). Whatever fails, the last line is
printed: writing the run log is best effort.

- `parse_flags(argv)`: absl's flag parsing (`app.run(main, flags_parser=parse_flags)`)
  with one-line errors: an unknown `--config.a.b.c=` key at any depth names the nearest
  valid keys of that section (`unknown_key`); a config file that is missing or raises
  names the file and the config's own error.
- `run_main(main, argv)`: runs `main` and turns any exception into the one line
  (`one_line`) after writing its traceback to the run log; a `SystemExit` that is not a
  signal's stop (e.g. `sys.exit` in code the run calls) is a failure too.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import sys
import traceback
from typing import Any, Callable, Mapping

from absl import flags

from jaxrlhf import exits, runlog

TRACEBACK_ENV = "JAXRLHF_TRACEBACK"
_MAX_LINE = 600  # characters of an exception's message on the error line
_CONFIG_ARG = re.compile(r"^--?config(=|$)")
_OVERRIDE_ARG = re.compile(r"^--?(?:no)?config\.([^=\s]+)")
# Exception types whose message says it all: no "TypeName: " before it on the error line.
_PLAIN = (ValueError, OSError)


def _show_traceback() -> bool:
    return os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


def _end(line: str, status: int) -> None:
    """Print `line` as the last line on stderr and end the process with `status`.

    Cannot fail: a log handler that cannot flush (a full disk) or a closed stream is passed
    over. The process ends with `os._exit` after flushing, so that no background thread (e.g.
    an asynchronous checkpointer) can print after the line or hold the exit up at
    interpreter shutdown."""
    try:
        logging.shutdown()
    except BaseException:  # noqa: BLE001 - the line comes first
        pass
    for stream, text in ((sys.stdout, ""), (sys.stderr, line + "\n")):
        try:
            stream.write(text)
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass
    os._exit(status)


def fail(message: str, *, where: str | None = None) -> None:
    """Print `error: <message> (<where>)` as the last line on stderr and exit with status 1
    (`where`: where the full traceback is; "" for none worth showing, e.g. a bad flag)."""
    if where is None:
        where = f"set {TRACEBACK_ENV}=1 for the full traceback"
    _end(f"error: {message}" + (f" ({where})" if where else ""), 1)


def one_line(exc: BaseException) -> str:
    """The first line of `exc`'s message (at most `_MAX_LINE` characters), led by its type
    name unless it is one of jaxrlhf's or a builtin ValueError/OSError, whose messages name
    what failed (any other type is kept: `KeyError: 'x'`, a library's own exception)."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    if len(first) > _MAX_LINE:
        first = first[:_MAX_LINE] + " ..."
    cls = type(exc)
    plain = cls.__module__.startswith("jaxrlhf") or (cls.__module__ == "builtins" and issubclass(cls, _PLAIN))
    if not first:
        return cls.__name__
    return first if plain else f"{cls.__name__}: {first}"


def _exit_call(exc: SystemExit) -> str:
    """`sys.exit(3) was called in own_rewards.py:5 (bye)`: a SystemExit from code the run
    calls, named by where it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" in {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
    return f"sys.exit({exc.code!r}) was called{where}: the run stopped there, unfinished"


def _failure(exc: BaseException) -> tuple[str, str | None]:
    """(the error line's message, where the full traceback is) of a failure, its traceback
    written to the run log when it can be (a full disk: the line says so, not the log)."""
    log_path = runlog.write_failure(exc)  # best effort: None when it could not be written
    where = f"full traceback in {log_path}" if log_path else None
    if log_path is None and runlog.path() is not None:
        where = f"the traceback could not be written to {runlog.path()}; set {TRACEBACK_ENV}=1 to print it"
    if _show_traceback():
        traceback.print_exception(type(exc), exc, exc.__traceback__)
        where = where or "full traceback above"
    message = exits.no_space(exc) or (_exit_call(exc) if isinstance(exc, SystemExit) else one_line(exc))
    return message, where


def run_main(main: Callable[[list], Any], argv: list) -> Any:
    """`main(argv)`, with every way out ending in one last line (`jaxrlhf.exits`): a SIGTERM's
    stop (status 0, what was kept), Ctrl-C (status 130), and any other exception or
    SystemExit written to the run log with its traceback and reported as one line (`fail`)."""
    try:
        result = main(argv)
        exits.raise_if_interrupted()  # a Ctrl-C that never reached us still ends with status 130
        return result
    except exits.Stopped as stop:
        line = exits.stopped_line(stop)
        runlog.note(line)
        _end(line, 0)
    except KeyboardInterrupt as interrupt:
        line = exits.interrupted_line(interrupt)
        runlog.note(line)
        _end(line, 130)
    except BaseException as e:  # noqa: BLE001 - the entry point: every failure becomes one line
        try:
            message, where = _failure(e)
        except BaseException as worse:  # noqa: BLE001 - the handler itself must not fail
            message, where = f"{one_line(e)} (and reporting it failed: {one_line(worse)})", None
        fail(message, where=where)


# ----------------------------------------------------------------------------- flags


def _sections(node) -> list[str]:
    return list(node.keys()) if isinstance(node, Mapping) or hasattr(node, "keys") else []


def _nested_paths(node, prefix: str = "") -> list[str]:
    """Every dotted key below `node` (sections and fields), e.g. "optim.lr"."""
    out = []
    for key in _sections(node):
        out.append(prefix + key)
        out += _nested_paths(node[key], f"{prefix}{key}.")
    return out


def unknown_key(config, dotted: str) -> str | None:
    """None when `config` has the key `dotted` ("grpo.optim.lr"); else the one-line help:
    the section that lacks it, its nearest keys (also deeper ones: `grpo.lrr` suggests
    `grpo.optim.lr`) or, when none is near, all of the section's keys."""
    node, done = config, []
    for part in dotted.split("."):
        keys = _sections(node)
        section = "config" + "".join(f".{k}" for k in done)
        if not keys:
            return f"--config.{dotted}: {section} is a value ({node!r}), not a section with key {part!r}"
        if part not in keys:
            near = difflib.get_close_matches(part, keys, n=3, cutoff=0.6)
            deeper = {p: p.rsplit(".", 1)[-1] for p in _nested_paths(node) if "." in p}
            near += [p for p in deeper if p not in near and difflib.get_close_matches(part, [deeper[p]], cutoff=0.6)]
            prefix = "".join(f"{k}." for k in done)
            hint = ("did you mean " + " or ".join(f"--config.{prefix}{k}" for k in near[:3]) + "?") if near else (
                "its keys: " + ", ".join(keys))
            return f"--config.{dotted}: {section} has no key {part!r}; {hint}"
        node = node[part]
        done.append(part)
    return None


def _config_arg(argv: list) -> str | None:
    for i, arg in enumerate(argv):
        if _CONFIG_ARG.match(arg):
            return arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def _unknown_override(argv: list) -> str | None:
    """The help for the first `--config.<key>` of `argv` that its config lacks (None when
    all exist or the config cannot be loaded)."""
    value = _config_arg(argv)
    if value is None:
        return None
    try:
        config = flags.FLAGS["config"].parser.parse(value)  # the flag's own loader
    except Exception:  # noqa: BLE001 - reported by the flag's own parsing
        return None
    for arg in argv:
        m = _OVERRIDE_ARG.match(arg)
        if m and (msg := unknown_key(config, m.group(1))):
            return msg
    return None


def _flag_error(error: flags.Error) -> str:
    """absl's flag error as one line: a config file that raised gives the flag and the
    config's own exception line (the last line of the traceback absl includes)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) > 1 and any(line.startswith("Traceback") for line in lines):
        flag = lines[0].split(": Error whilst parsing", 1)[0]
        return f"{flag}: {lines[-1]}"
    return lines[0] if lines else type(error).__name__


_NONE_ARG = re.compile(r"^--?config\.([^=\s]+)=None$")


def _set_none(keys: list[str]) -> None:
    """`--config.<key>=None`: the option turned off (None, the one "off" value), set after
    absl parsed the others (ml_collections would read "None" as the field's type)."""
    if not keys:
        return
    config = flags.FLAGS["config"].value
    for key in keys:
        if msg := unknown_key(config, key):
            fail(msg, where="")
        *path, last = key.split(".")
        node = config
        for part in path:
            node = node[part]
        node[last] = None


def parse_flags(argv: list) -> list:
    """absl's flag parsing with one-line errors (`app.run(main, flags_parser=parse_flags)`):
    an unknown `--config.<key>`, a bad flag value, a config file that is missing or raises.
    `--config.<key>=None` turns an option off (`_set_none`)."""
    value = _config_arg(argv)
    if value and not os.path.isfile(value.split(":", 1)[0]):
        fail(f"--config={value}: no such file {value.split(':', 1)[0]!r}", where="")
    nones = [m.group(1) for arg in argv if (m := _NONE_ARG.match(arg))]
    try:
        rest = flags.FLAGS([arg for arg in argv if not _NONE_ARG.match(arg)])
        _set_none(nones)
        return rest
    except flags.Error as e:
        if _show_traceback():
            traceback.print_exc()
        fail(_unknown_override(argv) or _flag_error(e), where="")
    except (AttributeError, KeyError) as e:  # ml_collections: a --config.<key> the config lacks
        if _show_traceback():
            traceback.print_exc()
        fail(_unknown_override(argv) or one_line(e), where="")


__all__ = ["TRACEBACK_ENV", "fail", "one_line", "parse_flags", "run_main", "unknown_key"]
