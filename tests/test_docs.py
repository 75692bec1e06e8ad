"""The benchmark pages stay a reference, and every figure the README states has its command.

BENCHMARKS.md holds, per benchmark, its command, machine, latest figures and goal status;
older runs and experiments move to docs/benchmarks-archive.md under a dated heading. It
fails here past 600 lines (it aims under 500, leaving room for new rows). Its links to its
own headings and every page's links to ``BENCHMARKS.md#...`` lead to a heading, and each
archive section it names ("archive: *title*", "archive 12-03: *title*") is there.

The README rule. A *figure* is a number with a unit (``ms``, ``s``, ``minutes``, ``x``,
``%``, ``tok/s``, ``requests/s``, ``GB/s``, ``MB`` ...) or a number with a decimal part, in
prose, a list or a table; not in code, a link target, or a version such as ``Apache-2.0``.
The README is read as blocks: a heading, a fenced block, or the lines between blank lines.

1. A text block with a figure names the command that made it: as inline code in the block
   (``kvroute serve|bench|simulate ...``, ``python benchmarks/...``, ``python -m pytest``),
   or in a fenced shell block right beside it, just before or just after, with no heading
   or other block between.
2. A benchmark command (``kvroute simulate``, ``kvroute bench``, ``python benchmarks/...``)
   must be one BENCHMARKS.md states (as inline code or in a fenced block, spaces aside),
   and every figure of the block must be a number of the BENCHMARKS.md section that states
   it. Only a run's wall time said approximately ("about 4 minutes") is not looked up: it
   is the reader's machine's. Figures beside ``kvroute serve`` or ``python -m pytest``
   (start-up and test times) need their command only.

``uncommanded_figures`` applies the rule; the tests feed it the README and synthetic
snippets, some of which it must refuse.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .test_readme import commands, fenced_blocks, logical_lines

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"
ARCHIVE = ROOT / "docs" / "benchmarks-archive.md"
README = ROOT / "README.md"
MAX_LINES = 600
MOVED = "Moved from BENCHMARKS.md on 2026-12-03"  # the archive section "archive 12-03" names

SHELL = ("bash", "sh", "shell", "console")
NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"
# a number alone (not part of a word, a version or a path), then its unit
BARE_NUMBER = re.compile(rf"(?<![\w.\-/=])({NUMBER})(?!\d)")
UNIT = re.compile(
    r"(?P<sign>x|%)(?!\w)"
    r"|\s?(?P<word>tok(?:ens)?/s|req(?:uests)?/s|GFLOP/s|[KMGT]i?B/s|[KMGT]i?B|ms|us|µs|ns"
    r"|s|secs?|seconds?|min|minutes?|h|hours?)(?![\w/])"
)
# a run's wall time said approximately is the reader's machine's, not a figure to look up
WALL_TIME = {"s", "sec", "secs", "second", "seconds", "min", "minute", "minutes"}
WALL_TIME |= {"h", "hour", "hours"}


# ---------------------------------------------------------------------------- reading


def prose(text: str) -> str:
    """A text block without what is not prose: code spans, link targets, HTML comments."""
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    text = re.sub(r"`[^`]*`", " ", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def figures(text: str) -> list[tuple[str, str, bool]]:
    """(figure, its number without thousands commas, a wall time said approximately)."""
    out = []
    flat = prose(text)
    for m in BARE_NUMBER.finditer(flat):
        number, rest = m.group(1), flat[m.end() :]
        unit = UNIT.match(rest)
        if unit:
            figure = number + unit.group(0)
            approx = unit.group("word") in WALL_TIME and bool(
                re.search(r"\babout\s*$", flat[: m.start()], flags=re.I)
            )
        elif "." in number and not re.match(r"\w|\.\d", rest):  # 25.5, not 2.13.0
            figure, approx = number, False
        else:
            continue
        out.append((" ".join(figure.split()), number.replace(",", ""), approx))
    return out


def blocks(text: str) -> list[tuple[str, str]]:
    """The page as (kind, text) blocks: "heading", "fence:<lang>" or "text", in order."""
    out: list[tuple[str, str]] = []
    lines = text.splitlines()
    i, para = 0, []

    def flush() -> None:
        if para:
            out.append(("text", "\n".join(para)))
            para.clear()

    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^```(\w*)\s*$", line)
        if fence:
            flush()
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            out.append((f"fence:{fence.group(1)}", "\n".join(lines[i + 1 : j])))
            i = j + 1
            continue
        if re.match(r"#{1,6} ", line):
            flush()
            out.append(("heading", line))
        elif not line.strip():
            flush()
        else:
            para.append(line)
        i += 1
    flush()
    return out


def normal(cmd: str) -> str:
    return " ".join(cmd.split())


def shell_commands(body: str) -> list[str]:
    """A fenced shell block's commands (continuations joined, ``&&`` chains split)."""
    return [normal(" ".join(c)) for ln in logical_lines(body) for c in commands(ln)]


def inline_commands(text: str) -> list[str]:
    return [normal(c) for c in re.findall(r"`([^`\n]+)`", text) if is_command(normal(c))]


def is_command(cmd: str) -> bool:
    return bool(
        re.match(r"(kvroute (serve|bench|simulate)\b|python benchmarks/|python -m pytest\b)", cmd)
    )


def is_benchmark(cmd: str) -> bool:
    return bool(re.match(r"(kvroute (bench|simulate)\b|python benchmarks/)", cmd))


def sections(text: str) -> list[str]:
    """Each heading with the text up to the next heading of any level."""
    out, cur = [], []
    in_fence = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        if not in_fence and re.match(r"#{1,6} ", line) and cur:
            out.append("\n".join(cur))
            cur = []
        cur.append(line)
    out.append("\n".join(cur))
    return out


def stated_commands(text: str) -> set[str]:
    """What a page states as commands: its code spans and its fenced blocks' commands."""
    spans = {
        normal(c) for c in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    }
    fenced = {
        c for lang, body in fenced_blocks(text) if lang in SHELL for c in shell_commands(body)
    }
    return spans | fenced


def numbers(text: str) -> set[str]:
    return {n.replace(",", "") for n in re.findall(NUMBER, text)}


# ---------------------------------------------------------------------------- the rule


def uncommanded_figures(readme: str, benchmarks: str) -> list[str]:
    """Every way the README's figures break the rule (module docstring); empty when none."""
    problems = []
    page = blocks(readme)
    bench_commands = stated_commands(benchmarks)
    bench_sections = [(stated_commands(s), s) for s in sections(benchmarks)]
    for i, (kind, text) in enumerate(page):
        if kind.startswith("fence:"):
            continue
        found = figures(text)
        if not found:
            continue
        near = inline_commands(text)
        for j in (i - 1, i + 1):
            if 0 <= j < len(page) and page[j][0].removeprefix("fence:") in SHELL:
                near += [c for c in shell_commands(page[j][1]) if is_command(c)]
        where = f"README block {text[:70]!r}"
        if not near:
            problems.append(f"{where}: {[f for f, _, _ in found]} with no command beside them")
            continue
        for cmd in (c for c in near if is_benchmark(c)):
            if cmd not in bench_commands:
                problems.append(f"{where}: `{cmd}` is not a command BENCHMARKS.md states")
                continue
            stated = set().union(*(numbers(raw) for cmds, raw in bench_sections if cmd in cmds))
            missing = [f for f, n, approx in found if not approx and n not in stated]
            if missing:
                problems.append(
                    f"{where}: {missing} are not figures of the BENCHMARKS.md section of `{cmd}`"
                )
    return problems


# ---------------------------------------------------------------------------- tests


def test_benchmarks_md_stays_a_reference():
    lines = BENCHMARKS.read_text().count("\n")
    assert lines <= MAX_LINES, (
        f"BENCHMARKS.md has {lines} lines (at most {MAX_LINES}; aim under 500): move older runs "
        f"and experiments to docs/benchmarks-archive.md under a dated heading"
    )


def test_readme_figures_have_commands():
    problems = uncommanded_figures(README.read_text(), BENCHMARKS.read_text())
    assert not problems, "\n".join(problems)


def test_the_rule_finds_the_readme_figures():
    """Not vacuous: today's README has figures, beside benchmark commands among others."""
    page = blocks(README.read_text())
    with_figures = [text for kind, text in page if kind == "text" and figures(text)]
    assert len(with_figures) >= 4, with_figures
    flat = " ".join(with_figures)
    for figure in ("25.5", "94%", "6.1 requests/s", "0.5x", "2 minutes"):
        assert figure in flat, figure


BENCH = """\
## Hashing — `python benchmarks/bench_hashing.py`

| prompt tokens | ms / prompt | vs naive |
| ---: | ---: | ---: |
| 32,768 | 0.1297 | 17.2x |

### Limits

`kvroute simulate --workload agents --replicas 8 --sweep-speed auto`: kv 25.5 req/s (94%).
"""
SIM = "```bash\nkvroute simulate --workload agents --replicas 8 \\\n  --sweep-speed auto\n```\n"


@pytest.mark.parametrize(
    "snippet",
    [
        pytest.param(SIM + "\nkv sustains 25.5 requests/s (94%); about 4 minutes.\n", id="beside"),
        pytest.param("Intro.\n\nkv sustains 25.5 requests/s.\n\n" + SIM, id="before-the-command"),
        pytest.param(
            "`python benchmarks/bench_hashing.py` hashes 32,768 tokens in 0.1297 ms (17.2x).\n",
            id="inline",
        ),
        pytest.param("```bash\nkvroute serve\n```\n\nReady after about 35 s.\n", id="serve"),
        pytest.param(
            "## Plain\n\nNo figures here: 8 replicas, 4,000 requests, Apache-2.0.\n", id="none"
        ),
    ],
)
def test_the_rule_passes_figures_with_their_command(snippet):
    assert uncommanded_figures(snippet, BENCH) == []


@pytest.mark.parametrize(
    ("snippet", "says"),
    [
        pytest.param(
            "## Speed\n\nkvroute answers 3.2x faster than vLLM.\n", "no command", id="bare"
        ),
        pytest.param(
            "| policy | goodput |\n| --- | --- |\n| kv | 25.5 req/s |\n", "no command", id="table"
        ),
        pytest.param(
            SIM + "\nThe sweep above.\n\nkv sustains 25.5 requests/s.\n",
            "no command",
            id="one-block-away",
        ),
        pytest.param(
            SIM + "\n## Results\n\nkv sustains 25.5 requests/s.\n", "no command", id="new-heading"
        ),
        pytest.param(
            "```bash\ncurl -s http://127.0.0.1:8000/health\n```\n\nIt answers in 4 ms.\n",
            "no command",
            id="not-a-figure-command",
        ),
        pytest.param(
            "```bash\nkvroute simulate --workload chat --replicas 3\n```\n\nkv: 25.5 requests/s.\n",
            "not a command BENCHMARKS.md states",
            id="command-not-in-benchmarks",
        ),
        pytest.param(
            SIM + "\nkv sustains 99.9 requests/s (94%).\n",
            "not figures of the BENCHMARKS.md",
            id="made-up",
        ),
        pytest.param(
            SIM + "\nkv is 17.2x the best other, about 4 minutes.\n",
            "not figures of the BENCHMARKS.md",
            id="figure-of-another-section",
        ),
    ],
)
def test_the_rule_refuses_a_figure_without_its_command(snippet, says):
    problems = uncommanded_figures(snippet, BENCH)
    assert problems and all(says in p for p in problems), problems


# ---------------------------------------------------------------------------- links


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(text: str) -> list[str]:
    out, in_fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        m = None if in_fence else re.match(r"#{1,6} (.*)", line)
        if m:
            out.append(m.group(1).strip())
    return out


def test_links_to_benchmarks_md_headings_lead_to_one():
    anchors = {slug(h) for h in headings(BENCHMARKS.read_text())}
    links = re.findall(r"\]\(#([^)]+)\)", BENCHMARKS.read_text())
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        links += re.findall(r"\]\((?:\.\./)?BENCHMARKS\.md#([^)]+)\)", page.read_text())
    assert links
    assert not [a for a in links if a not in anchors]


def test_archive_sections_named_exist():
    text = " ".join(BENCHMARKS.read_text().split())
    archive = ARCHIVE.read_text()
    every = [" ".join(h.split()).lower() for h in headings(archive)]
    moved = archive[archive.index(f"## {MOVED}") :]
    since = [" ".join(h.split()).lower() for h in headings(moved)]
    named = []
    for which, titles in re.findall(r"archive( 12-03)?[:,] ((?:\*[^*]+\*(?:, | and )?)+)", text):
        named += [(which, t) for t in re.findall(r"\*([^*]+)\*", titles) if t != "title"]
    other = text[text.index("## Other measurements") :]
    named += [(" 12-03", t) for t in re.findall(r"\(\*([^*]+)\*\)", other)]
    assert len(named) > 20, named
    missing = [
        t for which, t in named if not any(t.lower() in h for h in (since if which else every))
    ]
    assert not missing, f"BENCHMARKS.md names archive sections that are not there: {missing}"
