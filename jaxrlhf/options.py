"""One definition of every option: its name, default, bounds, doc and resume safety live on
its dataclass field, and nowhere else.

A library config (`GRPOConfig`, `PPOConfig`, `OptimConfig`, ...) declares its fields with
`option(default, doc, min=..., choices=..., safe=...)`. From those fields

- `check(obj)` validates a constructed config (its `__post_init__` calls it), and
  `check_values(cls, values, prefix)` the same values before anything is built, each
  error naming the field (`grpo.num_minibatches=0 is impossible: it must be >= 1`);
- `section(*classes, **overrides)` makes the `ml_collections` section a config file and the
  command line (`--config.grpo.clip_low=0.3`) set, and `build(cls, section)` turns it
  back into the dataclass (`Cfg(**section)`, nested sections built recursively);
- `walk(*classes)` lists every field a section holds, for the generated options table
  (docs/options.md) and the resume rules (`safe`: may change when a workdir resumes).

`None` is the one "off" value: a field that can be off has type `X | None` and default or
value None, in the library and on the command line (`--config.grpo.clip_high=None`). A
field with `cli=False` is set by the run, not by the user (e.g. the sampler's EOS ids,
from the task's tokenizer): it is not part of any section.

This module imports nothing of the package: every layer may use it.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import types
import typing
from typing import Any, Iterator, NamedTuple

import ml_collections as mlc

_UNSET = dataclasses.MISSING


def option(default: Any = _UNSET, doc: str = "", *, factory=None, min=None, above=None, max=None, below=None,
           choices=None, safe: bool = False, cli: bool = True) -> Any:
    """A dataclass field with its doc and rules in `metadata`.

    `min` / `max`: inclusive bounds, `above` / `below`: exclusive ones, `choices`: the
    allowed values (None among them when the field may be off), or a function returning
    them (a registry's names, read when a value is checked). `safe`: the field may
    change when a workdir resumes (how a run is watched, evaluated, saved or placed, not
    what its checkpoints hold); on a nested section's field every key below it is safe.
    `cli=False`: set by the run, not part of a config section. `factory`: a default made
    per instance (a nested config)."""
    meta = dict(doc=" ".join(doc.split()), min=min, above=above, max=max, below=below,
                choices=choices if choices is None or callable(choices) else tuple(choices), safe=safe, cli=cli)
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _allows_none(tp) -> bool:
    return tp is type(None) or (typing.get_origin(tp) in (typing.Union, types.UnionType)
                                and type(None) in typing.get_args(tp))


def _base_type(tp):
    """`int` of `int | None`; the type itself otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def nested(cls, name: str):
    """The dataclass type of field `name` of `cls` when it is a nested config, else None."""
    tp = _base_type(_hints(cls)[name])
    return tp if dataclasses.is_dataclass(tp) else None


def _type_error(tp, value) -> str | None:
    if tp is bool:
        return None if isinstance(value, bool) else "a bool (True or False)"
    if tp is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        return None if ok else "an integer"
    if tp is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        return None if ok else "a number"
    if tp is str:
        return None if isinstance(value, str) else "a string"
    return None


def choices(field: dataclasses.Field) -> tuple | None:
    """The values `field` allows (None: any of its type)."""
    c = field.metadata.get("choices")
    return tuple(c()) if callable(c) else c


def describe_rule(field: dataclasses.Field) -> str:
    """The field's bounds in words ("> 0", "in [0, 1]", "one of 'k1', 'k2', 'k3'"), or ""."""
    m = field.metadata
    if choices(field) is not None:
        return "one of " + ", ".join(repr(c) for c in choices(field))
    low = f"[{m['min']}" if m.get("min") is not None else (f"({m['above']}" if m.get("above") is not None else None)
    high = f"{m['max']}]" if m.get("max") is not None else (f"{m['below']})" if m.get("below") is not None else None)
    if low and high:
        return f"in {low}, {high}"
    if low:
        return (">= " if low[0] == "[" else "> ") + low[1:]
    if high:
        return ("<= " if high[-1] == "]" else "< ") + high[:-1]
    return ""


def check_value(cls, field: dataclasses.Field, value, key: str) -> None:
    """`value` for `field` of `cls`, checked against its type and rules: a ValueError naming
    `key` (e.g. "grpo.clip_low") when it breaks one."""
    tp = _hints(cls)[field.name]
    if value is None:
        if _allows_none(tp):
            return
        raise ValueError(f"{key}=None is impossible: this option cannot be off (None); "
                         f"default {_default_text(field)}")
    base = _base_type(tp)
    if dataclasses.is_dataclass(base):
        return
    want = _type_error(base, value)
    if want:
        raise ValueError(f"{key}={value!r} is impossible: it must be {want}")
    m = field.metadata
    allowed = choices(field)
    bad = (allowed is not None and value not in allowed) or (
        m.get("min") is not None and not value >= m["min"]) or (
        m.get("above") is not None and not value > m["above"]) or (
        m.get("max") is not None and not value <= m["max"]) or (
        m.get("below") is not None and not value < m["below"])
    if bad:
        off = " (or None: off)" if _allows_none(tp) and None not in (allowed or ()) else ""
        raise ValueError(f"{key}={value!r} is impossible: it must be {describe_rule(field)}{off}")


def _default_text(field: dataclasses.Field) -> str:
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return "a section"
    return "required" if field.default is dataclasses.MISSING else repr(field.default)



def check(obj, prefix: str | None = None) -> None:
    """Every field of the dataclass `obj` within its type and rules (`check_value`); errors
    name `<prefix><field>`, the prefix defaulting to the class name ("GRPOConfig.")."""
    prefix = f"{type(obj).__name__}." if prefix is None else prefix
    for f in dataclasses.fields(obj):
        if f.metadata:
            check_value(type(obj), f, getattr(obj, f.name), prefix + f.name)


class Entry(NamedTuple):
    """One option of a section: its dotted key below the section, its class and field, and
    its default there (a nested config's default instance gives its fields' defaults)."""
    key: str
    cls: type
    field: dataclasses.Field
    default: Any


def _field_default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def _cli_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def walk(*classes, prefix: str = "", instance: Any = None) -> Iterator[Entry]:
    """Every option a section of `classes` holds (fields with `cli=False` left out), nested
    configs flattened: `Entry("optim.lr", OptimConfig, <field lr>, 1e-5)`. `instance`: an
    object of the (one) class whose values are the defaults."""
    seen = {}
    for cls in classes:
        for f in _cli_fields(cls):
            if f.name in seen:
                raise TypeError(f"option {prefix}{f.name} is declared twice: by {seen[f.name].__name__} and "
                                f"{cls.__name__}")
            seen[f.name] = cls
            default = getattr(instance, f.name) if instance is not None else _field_default(f)
            yield Entry(prefix + f.name, cls, f, default)
            sub = nested(cls, f.name)
            if sub is not None:
                yield from walk(sub, prefix=f"{prefix}{f.name}.", instance=default)


def _placeholder(cls, f: dataclasses.Field):
    base = _base_type(_hints(cls)[f.name])
    return mlc.config_dict.placeholder(base if isinstance(base, type) else object)


def section(*classes, **overrides) -> mlc.ConfigDict:
    """The config section of `classes` (their fields merged, `cli=False` ones left out):
    each field's default, a nested config's default instance as a sub-section, a None
    default as a typed placeholder (so `--config.x=0.3` parses as the field's type).
    `overrides` change defaults (a dict, or an instance, for a sub-section); an unknown key
    is an error."""
    return _section(classes, overrides, instances=(None,) * len(classes))


def _section(classes, overrides: dict, instances) -> mlc.ConfigDict:
    out, names = {}, set()
    for cls, inst in zip(classes, instances):
        for f in _cli_fields(cls):
            if f.name in names:
                raise TypeError(f"option {f.name} is declared twice in one section ({cls.__name__})")
            names.add(f.name)
            value = getattr(inst, f.name) if inst is not None else _field_default(f)
            sub = nested(cls, f.name)
            if sub is not None:  # its overrides: a dict of them, or an instance of the nested class
                given = overrides.pop(f.name, {})
                if dataclasses.is_dataclass(given):
                    value, given = given, {}
                out[f.name] = _section((sub,), dict(given), instances=(value,))
            elif f.name in overrides:
                new = overrides.pop(f.name)
                out[f.name] = _placeholder(cls, f) if new is None else new
            else:
                out[f.name] = _placeholder(cls, f) if value is None else value
    if overrides:
        known = ", ".join(sorted(names))
        raise TypeError(f"unknown option(s) {', '.join(sorted(overrides))}; the section's options: {known}")
    return mlc.ConfigDict(out)


def values(cls, section, prefix: str = "", **given) -> dict:
    """The keyword arguments of `cls` from `section` (a ConfigDict or mapping): its `cli`
    fields, nested configs built (`build`), then `given` (the fields the run sets)."""
    kw = {}
    for f in _cli_fields(cls):
        if f.name in given:
            continue
        if f.name not in section:
            continue  # an older config file without it: the field's default
        sub = nested(cls, f.name)
        v = section[f.name]
        kw[f.name] = build(sub, v, prefix=f"{prefix}{f.name}.") if sub is not None and v is not None else v
    return {**kw, **given}


def build(cls, section, prefix: str = "", **given):
    """`cls(**section)`: the dataclass from its config section, every option checked first
    with errors naming `<prefix><field>` (a cross-field error of the class's own checks
    is re-raised naming the section too). `given`: fields the run sets (`cli=False`)."""
    kw = values(cls, section, prefix, **given)
    for f in _cli_fields(cls):
        if f.name in kw and f.name not in given and f.metadata:
            check_value(cls, f, kw[f.name], prefix + f.name)
    try:
        return cls(**kw)
    except (TypeError, ValueError) as e:
        if not prefix:
            raise
        msg = str(e)
        name = cls.__name__
        msg = msg[len(name) + 1:].lstrip(": .") if msg.startswith(name) else msg
        raise ValueError(f"{prefix.rstrip('.')}: {msg}") from e


def check_values(classes, section, prefix: str = "") -> None:
    """Every option of `section` (made from `classes`) within its type and rules, before
    anything is built: a ValueError naming the first that is not (`grpo.steps=-3`)."""
    for entry in walk(*classes):
        node = section
        try:
            for part in entry.key.split("."):
                node = node[part]
        except (KeyError, AttributeError):
            continue  # a config without this key (an older config file): its default
        check_value(entry.cls, entry.field, node, prefix + entry.key)


__all__ = ["Entry", "build", "check", "check_value", "check_values", "choices", "describe_rule", "nested", "option", "section",
           "values", "walk"]
