"""docs/RESULTS.md: every suite's question, its answer from the committed records and the answer's figure, as a page
a code host shows (Markdown and PNG; the HTML reports under reports/ are generated, not committed).

`python -m megatrain report` (every suite, as `nox -s report` runs it) rewrites the page and docs/figures/<suite>.png
from results/<suite>/records.jsonl; like the reports, it is never edited by hand.
"""

from __future__ import annotations

import html
import re
import shutil
import tempfile
from pathlib import Path
from urllib.parse import quote

import megatrain.user_files as user_files
from megatrain.analysis import headline, tables
from megatrain.bench.suite import read_suite_records
from megatrain.hardware import get_profile

# the suites in the order the page asks their questions: the paper's claims first, then what a user decides by
ORDER = ("reproduce_14b", "paper_peer", "multi_gpu", "smoke_gpu", "scaling", "context", "moe", "host_optimizer",
         "families")
INTRO = """# Measured results

Each section is one suite's question and its answer, written by `python -m megatrain report` from the records in
`results/<suite>/records.jsonl` (never by hand). Ratios compare systems measured in one session on one machine, at
the same model, batch and kernels (eager or compiled alike). A record names its commit, machine and versions; the
full report of a suite, with every case, table and figure, is `python -m megatrain report SUITE`
(`reports/SUITE/index.html`).
"""


# ASCII punctuation Markdown could read as markup or an entity in a line of text (CommonMark's backslash escapes); an
# underscore between two letters or digits (a name: host_optimizer) is none
MARKUP = re.compile(r"[\\`*\[\]<>&~|]|(?<![^\W_])_|_(?![^\W_])")


def text(plain: str) -> str:
    """Plain text as Markdown that shows it as it is, as the HTML report's escaping does: on one line, each character
    that could start markup, raw HTML or an entity escaped (a record's `<img onerror=...>` is shown, never run)."""
    return MARKUP.sub(lambda m: "\\" + m.group(), " ".join(plain.splitlines()))


def code(plain: str) -> str:
    """Plain text as a Markdown code span, shown as it is: fenced by more backticks than it holds in a row."""
    plain = " ".join(plain.splitlines())
    fence = "`" * (max(map(len, re.findall("`+", plain)), default=0) + 1)
    pad = " " if plain.startswith("`") or plain.endswith("`") else ""
    return f"{fence}{pad}{plain}{pad}{fence}"


def markdown(sentence_html: str) -> str:
    """A headline sentence (HTML: <b>, <code>, escaped text) as Markdown showing the same text, no markup of its own."""
    parts = re.split(r"(</?b>|<code>.*?</code>)", sentence_html)
    return "".join("**" if part in ("<b>", "</b>") else
                   code(html.unescape(part[len("<code>"):-len("</code>")])) if part.startswith("<code>") else
                   text(html.unescape(re.sub(r"<[^>]+>", "", part))) for part in parts)


def _section(suite: str, results_dir: Path, figures_dir: Path) -> str | None:
    """The suite's section, its figure copied into figures_dir; None for a suite that asks no question."""
    records = read_suite_records(results_dir / "records.jsonl")
    if not records or headline.report_spec(suite) is None:
        return None
    scope = tables.latest_records(tables.records_frame(records))
    with tempfile.TemporaryDirectory() as tmp:
        head = headline.headline(suite, scope, Path(tmp))
        figure = None
        if head.figure is not None and head.figure.exists():
            figure = figures_dir / f"{suite}.png"
            shutil.copyfile(head.figure, figure)
    lines = [f"## {text(head.question)}", "", markdown(head.sentence), ""]
    if figure is not None:
        lines += [f"![{text(suite)}: the answer's figure](figures/{quote(figure.name)})", "", f"*{text(head.caption)}*",
                  ""]
    sessions = [_session(rows) for _, rows in sorted(scope.groupby("session"), key=lambda kv: kv[0], reverse=True)]
    earlier = f"; earlier sessions in the records: {'; '.join(sessions[1:])}" if len(sessions) > 1 else ""
    lines += [f"Latest session {sessions[0]}{earlier}. Records: "
              f"[{code(f'results/{suite}/records.jsonl')}](../results/{quote(suite)}/records.jsonl).", ""]
    return "\n".join(lines)


def _session(rows) -> str:
    """A measuring session in a few words: its name, cases, machine and commit."""
    cases = f"{len(rows)} case{'s' * (len(rows) != 1)}"
    machine = get_profile(rows["hardware"].iloc[0]).description
    return f"{code(str(rows['session'].iloc[0]))} ({cases} on {text(machine)} at commit {text(headline.commits(rows))})"


def write(results_root: Path, docs_dir: Path) -> Path:
    """Rewrite docs_dir/RESULTS.md and docs_dir/figures/ from every suite's records under results_root: over what the
    last report wrote there (docs_dir's manifest, megatrain.user_files) and nothing else."""
    present = {p.parent.name for p in results_root.glob("*/records.jsonl") if not p.parent.name.endswith("-local")}
    suites = [s for s in ORDER if s in present] + sorted(present - set(ORDER))
    with user_files.replacing(docs_dir, "report") as stage:
        (stage / "figures").mkdir()
        sections = [s for s in (_section(suite, results_root / suite, stage / "figures") for suite in suites) if s]
        (stage / "RESULTS.md").write_text(INTRO + "\n" + "\n".join(sections))
    return docs_dir / "RESULTS.md"
