"""One definition of every option: each field of every algorithm's config is reachable from
`--config.*`, round-trips through its section, and takes its bounds and resume safety from
its field's `metadata` (`jaxrlhf.options`, `runs.sections`); docs/options.md is generated
from the same fields."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from jaxrlhf import options
from jaxrlhf.algorithms.common import OptimConfig
from jaxrlhf.algorithms.experience import SamplingConfig
from jaxrlhf.monitor import MonitorConfig
from jaxrlhf.runs import config_base, sections, validation, workdir

REPO = Path(__file__).resolve().parents[1]
LIBRARY = [cls for classes in sections.PHASE_SECTIONS.values() for cls in classes[1:]] + [
    SamplingConfig, OptimConfig, MonitorConfig]


def _config(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config("tiny")


BASE = {"grpo": {"beta": 0.1}, "opd": {"beta": 0.1}}  # kl_target (changed below) adapts a β > 0


def _changed(entry: options.Entry):
    """A value other than the default that the field's rules allow."""
    f, default = entry.field, entry.default
    allowed = options.choices(f)
    if allowed:
        return next(c for c in allowed if c != default)
    tp = options._base_type(options._hints(entry.cls)[f.name])
    if tp is bool:
        return not default
    if tp is str:
        return (default or "x") + ",y"
    low = f.metadata.get("min"), f.metadata.get("above")
    high = f.metadata.get("max") if f.metadata.get("max") is not None else f.metadata.get("below")
    if tp is int:
        return (default or low[0] or low[1] or 0) + 1 if high is None else max(int(high) - 1, low[0] or 0)
    base = default if default is not None else (low[0] or low[1] or 0.1) + 0.5
    return base * 0.5 if high is not None else base * 1.5 + 0.25


def test_every_library_field_is_an_option_or_set_by_the_run():
    """Each field has `metadata` (doc, rules, resume safety), a doc, and is either in a
    section (reachable from --config.*) or explicitly set by the run (`cli=False`)."""
    for cls in LIBRARY:
        for f in dataclasses.fields(cls):
            assert f.metadata, f"{cls.__name__}.{f.name} is declared without options.option"
            assert f.metadata["doc"], f"{cls.__name__}.{f.name} has no doc"


@pytest.mark.parametrize("phase", list(sections.PHASE_SECTIONS))
def test_every_field_of_a_phase_round_trips_through_its_section(phase):
    """The section of a phase holds every option of its classes; changing any one of them
    in the section (as --config.<phase>.<key>=value does) builds the library config with
    that value, and the defaults build the default library config."""
    classes = sections.PHASE_SECTIONS[phase]
    base = BASE.get(phase, {})
    library = classes[1]
    given = {f.name: options._field_default(f) for f in dataclasses.fields(library) if not f.metadata["cli"]}

    def run_set(section):  # what the run sets: the sampler's tokens inside the nested section
        if "sampling" not in section:
            return given
        return dict(given, sampling=options.build(SamplingConfig, section.sampling, eos_id=2, pad_id=0))

    section = options.section(*classes, **base)
    assert options.build(library, section, f"{phase}.", **run_set(section)) == library(**base, **run_set(section))
    for entry in options.walk(library):
        if options.nested(entry.cls, entry.field.name):
            continue
        value = _changed(entry)
        changed = options.section(*classes, **base)
        node = changed
        *path, last = entry.key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
        got = options.build(library, changed, f"{phase}.", **run_set(changed))
        for part in entry.key.split("."):
            got = getattr(got, part)
        assert got == value, (phase, entry.key)


@pytest.mark.parametrize("phase", list(sections.PHASE_SECTIONS))
def test_bounds_come_from_the_fields(phase):
    """A value outside a field's rule is refused naming `<phase>.<key>`, before anything is
    built (`options.check_values`) and by the class itself; None only where the field can be off."""
    classes = sections.PHASE_SECTIONS[phase]
    for entry in options.walk(*classes):
        m = entry.field.metadata
        bad = None
        if m.get("min") is not None:
            bad = m["min"] - 1
        elif m.get("above") is not None:
            bad = m["above"]
        elif options.choices(entry.field):
            bad = "no-such-choice"
        if bad is None:
            continue
        section = options.section(*classes)
        node = section
        *path, last = entry.key.split(".")
        for part in path:
            node = node[part]
        node[last] = bad
        shown = re.escape(f"{phase}.{entry.key}={node[last]!r} is impossible")  # as the section holds it
        with pytest.raises(ValueError, match=rf"^{shown}"):
            options.check_values(classes, section, f"{phase}.")
        if entry.cls not in classes[:1]:  # a library class refuses it too, naming itself
            with pytest.raises(ValueError, match=rf"{entry.cls.__name__}.{entry.field.name}=.* is impossible"):
                entry.cls(**{entry.field.name: node[last]})


def test_none_is_the_one_off_value():
    """No option of an algorithm's config is off at 0 or "": a field that can be off has
    type `X | None`, and None is refused where the field cannot be off."""
    with pytest.raises(ValueError, match=r"^ppo.clip_low=None is impossible: this option cannot be off"):
        options.check_values(sections.PHASE_SECTIONS["ppo"], config_base.ppo(clip_low=None), "ppo.")
    options.check_values(sections.PHASE_SECTIONS["ppo"], config_base.ppo(vf_clip=None, kl_target=None), "ppo.")
    with pytest.raises(ValueError, match=r"ppo.vf_clip=0.0 is impossible: it must be > 0 \(or None: off\)"):
        options.check_values(sections.PHASE_SECTIONS["ppo"], config_base.ppo(vf_clip=0.0), "ppo.")


def test_resume_safety_comes_from_the_fields():
    """A key is a resume-safe setting exactly when its field (or a section above it) is
    marked safe; every other key of a phase that runs is part of the identity."""
    config = _config("addition_ppo")
    record = workdir.record_of(config)
    for key in record["settings"]:
        if key.endswith(".steps"):
            continue  # a phase's steps: judged by its progress (`workdir._steps_change`)
        assert sections.is_safe(config, key), key
    for key in record["identity"]:
        assert not sections.is_safe(config, key), key
    assert sections.is_safe(config, "train.monitor.kl_factor") and sections.is_safe(config, "ppo.optim.lr")
    assert not sections.is_safe(config, "ppo.optim.b1")


@pytest.mark.parametrize("name", ["addition_grpo", "addition_ppo", "addition_dpo", "addition_sft",
                                  "addition_reward_model", "hf_gsm8k_grpo", "hf_rlhf_files"])
def test_every_shipped_config_is_within_its_fields_rules(name):
    validation.check_values(_config(name))


def test_docs_options_md_is_generated_from_the_fields():
    """docs/options.md is the table `python -m jaxrlhf.runs.sections` writes: regenerate it
    after changing an option."""
    assert (REPO / "docs" / "options.md").read_text() == sections.markdown(), (
        "docs/options.md is stale: python -m jaxrlhf.runs.sections > docs/options.md")
