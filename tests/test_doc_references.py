"""Every docs reference in the code, the config and the docs resolves to a file in the repository: `docs/x.md`,
`README.md`, a markdown link `[..](x.md)`, a `DESIGN.md`-like name. A cited page that does not exist (as
docs/precision.md once was) or a file that lives outside the checkout fails here."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# a path-like name ending in .md (docs/precision.md, README.md, ../README.md, precision.md#anchor), not part of a URL
REFERENCE = re.compile(r"(?<![\w/.:-])((?:\.\.?/)*(?:[\w-]+/)*[\w.-]+\.md)(?![\w/])")


def sources() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    for folder, pattern in (("runner", "*.py"), ("conf", "*.yaml"), ("docs", "*.md"), ("docs", "*.py"),
                            ("tests", "*.py"), (".ci", "*")):
        files += [p for p in (ROOT / folder).rglob(pattern) if p.is_file()]
    return files


def unresolved(path: Path) -> list[str]:
    text = path.read_text(errors="replace")
    text = re.sub(r"https?://\S+", "", text)  # a URL's own .md pages are not ours
    missing = []
    for ref in REFERENCE.findall(text):
        candidates = [ROOT / ref, path.parent / ref, ROOT / "docs" / ref]  # the last: code's ROOT / "docs" / "x.md"
        if not any(c.resolve().is_file() and ROOT in c.resolve().parents for c in candidates):
            missing.append(ref)
    return missing


def test_every_docs_reference_resolves_to_a_file_in_the_repository():
    missing = {str(p.relative_to(ROOT)): refs for p in sources() if p != Path(__file__) for refs in [unresolved(p)]
               if refs}
    assert missing == {}, missing


def test_the_check_finds_a_missing_page(tmp_path):
    page = ROOT / "docs" / "precision.md"
    assert page.is_file()  # cited by runner/precision.py and conf/config.yaml
    fake = tmp_path / "x.py"
    fake.write_text('"""see docs/nope.md and DESIGN.md and README.md and https://x.org/a.md"""')
    assert unresolved(fake) == ["docs/nope.md", "DESIGN.md"]
