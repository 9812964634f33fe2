"""Results files made of sections that different benchmark scripts write.

A section is the text between `<!-- section: NAME -->` and `<!-- end: NAME -->`; a script
replaces its own section and keeps the rest of the file, so re-running one benchmark never
erases another's numbers.
"""

from __future__ import annotations

from pathlib import Path


def replace_section(path: Path, name: str, text: str, *, title: str | None = None) -> None:
    """Writes `text` as section `name` of `path` (appended if the file lacks it).

    Args:
        path: The markdown file (created with `title` as its first line if missing).
        name: The section's marker name.
        text: The section's markdown.
        title: The file's `# ` heading, used when the file is created.
    """
    start, end = f"<!-- section: {name} -->", f"<!-- end: {name} -->"
    block = f"{start}\n{text.rstrip()}\n{end}\n"
    content = path.read_text(encoding="utf-8") if path.exists() else (
        f"# {title}\n\n" if title else "")
    if start in content and end in content:
        before, rest = content.split(start, 1)
        after = rest.split(end, 1)[1].lstrip("\n")
        content = before + block + ("\n" + after if after else "")
    else:
        content = content.rstrip("\n") + ("\n\n" if content.strip() else "") + block
    path.write_text(content, encoding="utf-8")
