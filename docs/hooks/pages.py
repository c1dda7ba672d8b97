"""mkdocs hook: pages whose text has one owner elsewhere are filled in at build time, so nothing is written twice.

- Home is the repository's README.md, its links rewritten from repository paths (`docs/usage/runs.md`) to pages.
- Configuration is generated from the config dataclasses and conf/ (orthrus_rag.config.reference).
- Changelog is the repository's CHANGELOG.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_as_home(text: str) -> str:
    """README.md with its links to docs/ pages made relative to the site's root, and CHANGELOG.md to its page."""
    text = re.sub(r"\]\(docs/", "](", text)
    return text.replace("](CHANGELOG.md)", "](changelog.md)")


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 (mkdocs' hook signature)
    if page.file.src_uri == "index.md":
        return readme_as_home((ROOT / "README.md").read_text())
    if page.file.src_uri == "reference/configuration.md":
        from orthrus_rag.config.reference import render_reference

        return render_reference()
    if page.file.src_uri == "changelog.md":
        return (ROOT / "CHANGELOG.md").read_text()
    return markdown
