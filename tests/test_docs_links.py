"""Every relative link of the README and docs/ reaches a file of the repository and, where it names a section, a
heading of that file: the README's sections moved into docs/ once, and a link left pointing at the old place reads
as a dead end to a user."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.independent_of_transformers

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped (word characters, spaces and hyphens
    kept, so `τ` stays), spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(document: Path) -> str:
    """The document without its code blocks, whose `#` comments are no headings and whose brackets are no links."""
    return re.sub(r"^```.*?^```", "", document.read_text(), flags=re.MULTILINE | re.DOTALL)


def anchors(document: Path) -> set[str]:
    return {github_anchor(line.lstrip("#")) for line in prose(document).splitlines() if re.match(r"^#{1,6} ", line)}


def test_github_anchor_follows_githubs_rule():
    assert github_anchor(" On a GPU: `make gpu-check`") == "on-a-gpu-make-gpu-check"
    assert github_anchor("kvpress's own test suite") == "kvpresss-own-test-suite"
    assert github_anchor("Choosing τ") == "choosing-τ"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_a_heading(document):
    broken = []
    for target in LINK.findall(prose(document)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (document.parent / path).resolve() if path else document
        if not linked.exists():
            broken.append(f"{target}: no {linked.relative_to(ROOT) if linked.is_relative_to(ROOT) else linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(ROOT)}")
    assert not broken, f"{document.relative_to(ROOT)}: " + "; ".join(broken)
