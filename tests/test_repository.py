"""The repository stands alone: it names no file outside itself, and every relative link and
anchor in its docs (and every docs page with anchor named in its Python files) resolves.

Anchors follow GitHub's heading slugs: the heading's text (Markdown and HTML stripped),
lowercased, every character dropped that is not a letter, digit, mark, `_`, `-` or space,
each space turned into `-`; a repeated slug gets `-1`, `-2`, ... Explicit `<a id="...">` /
`<a name="...">` tags are anchors too.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]

# Built from parts, so that this file does not contain them.
FORBIDDEN = ("SPEC" + " §", "WORKLOAD" + ".md", ".." + "/shared")

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
ATX = re.compile(r"^ {0,3}#{1,6}(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
HTML_ANCHOR = re.compile(r"""<a\s[^>]*?\b(?:id|name)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
DOCS_MENTION = re.compile(r"(?<![\w-])docs/([\w.-]+\.md)(?:#([\w-]+))?")


@functools.cache
def tracked_files() -> tuple[str, ...]:
    """The repository's files: git's list, or (no git checkout) every file outside hidden
    folders, caches and build metadata."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
        names = out.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        skip = lambda parts: any(p.startswith(".") or p == "__pycache__" or p.endswith(".egg-info") for p in parts)
        names = [p.relative_to(REPO).as_posix() for p in REPO.rglob("*") if not skip(p.relative_to(REPO).parts)]
    return tuple(p for p in names if p and (REPO / p).is_file())


def _outside_fences(text: str) -> list[tuple[int, str]]:
    """`(line number, line)` of the lines of Markdown `text` outside fenced code blocks."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None:
            if m:
                fence = m.group(1)
            else:
                lines.append((number, line))
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip(" `~"):
            fence = None
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's Markdown text (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return kept.replace(" ", "-")


def _markdown(path: Path) -> str:
    """A page's Markdown: the file, or a notebook's markdown cells joined."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return path.read_text(encoding="utf-8")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    occurrences: dict[str, int] = {}  # as github-slugger counts them
    out = set()
    for _, line in _outside_fences(_markdown(path)):
        out.update(HTML_ANCHOR.findall(line))
        m = ATX.match(line)
        if not m:
            continue
        base = name = slug(m.group(1) or "")
        while name in occurrences:
            occurrences[base] += 1
            name = f"{base}-{occurrences[base]}"
        occurrences[name] = 0
        out.add(name)
    return frozenset(out)


def _check_target(page: Path, where: str, target: str) -> str | None:
    """None when `target` (a relative link as written on `page`) resolves, else the problem."""
    path, _, anchor = target.partition("#")
    path, anchor = unquote(path), unquote(anchor)
    dest = page if not path else (REPO / path.lstrip("/") if path.startswith("/") else page.parent / path)
    if not dest.exists():
        return f"{where}: link to {target}: no such file"
    if anchor and dest.is_file() and dest.suffix in (".md", ".ipynb") and anchor not in anchors(dest.resolve()):
        return f"{where}: link to {target}: no heading or <a id> '{anchor}' in {dest.resolve().relative_to(REPO)}"
    return None


def _linked_pages() -> list[Path]:
    pages = [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "benchmarks" / "README.md"]
    pages += sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "notebooks").glob("*.ipynb"))
    return [p for p in pages if p.is_file()]


def test_no_file_outside_the_repository_is_named():
    this = Path(__file__).resolve().relative_to(REPO).as_posix()
    problems = []
    for name in tracked_files():
        if name == this:
            continue
        data = (REPO / name).read_bytes()
        if b"\0" in data:
            continue  # binary
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            problems += [f"{name}:{number}: {needle!r}" for needle in FORBIDDEN if needle in line]
    assert not problems, "names of files the repository does not contain:\n" + "\n".join(problems)


def test_markdown_links_and_anchors_resolve():
    problems = []
    for page in _linked_pages():
        name = page.relative_to(REPO).as_posix()
        for number, line in _outside_fences(_markdown(page)):
            line = INLINE_CODE.sub("", line)
            for target in LINK.findall(line) + REFERENCE.findall(line):
                if SCHEME.match(target):
                    continue  # http(s), mailto: not checked here
                where = f"{name}:{number}" if page.suffix == ".md" else f"{name} (markdown line {number})"
                problem = _check_target(page, where, target)
                if problem:
                    problems.append(problem)
    assert not problems, "broken relative links:\n" + "\n".join(problems)


def test_docs_pages_named_in_python_files_resolve():
    problems = []
    for name in tracked_files():
        if not name.endswith(".py"):
            continue
        text = (REPO / name).read_text(encoding="utf-8")
        for number, line in enumerate(text.splitlines(), 1):
            for page, anchor in DOCS_MENTION.findall(line):
                target = page + (f"#{anchor}" if anchor else "")
                problem = _check_target(REPO / "docs" / "README.md", f"{name}:{number}", target)
                if problem:
                    problems.append(problem)
    assert not problems, "docs pages or anchors named in code that do not exist:\n" + "\n".join(problems)


@pytest.mark.parametrize("heading, expected", [
    ("Shapes, masks, and the one shift", "shapes-masks-and-the-one-shift"),
    ("Guidance on failed prompts (`guide_coef`)", "guidance-on-failed-prompts-guide_coef"),
    ("DPO — `jaxrlhf.algorithms.dpo`", "dpo--jaxrlhfalgorithmsdpo"),
    ("Held-out evaluation: greedy, pass@k, maj@k", "held-out-evaluation-greedy-passk-majk"),
    ("TRL `GRPOConfig` → jaxrlhf", "trl-grpoconfig--jaxrlhf"),
    ("See [the page](x.md#y) now", "see-the-page-now"),
])
def test_slugs_follow_github(heading, expected):
    assert slug(heading) == expected


def test_repeated_headings_get_numbered_anchors(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A\n## Notes\n```\n# Notes\n```\n## Notes\n<a id=\"here\"></a>\n## Notes 1\n")
    assert anchors(page) == {"a", "notes", "notes-1", "notes-1-1", "here"}
