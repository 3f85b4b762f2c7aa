"""WikiText-2's split files cut into articles, byte for byte.

An article starts at a `` = Title = `` line that stands between blank lines (section headings are ``
= = Section = = ``); the article takes the blank line before its title with it, so joining the
articles gives back the file byte for byte. The standard splits hold 600 / 60 / 60 articles (Merity
et al., 2016)."""

from __future__ import annotations

from seqjax.store.lines import split_lines


def _is_blank(line: str) -> bool:
    return not line.strip()


def _is_title(line: str) -> bool:
    body = line.rstrip("\n")
    return body.startswith(" = ") and not body.startswith(" = = ") and body.endswith(" = ") and len(
        body) > 4


def wikitext_articles(text: str) -> list[str]:
    """Cut a WikiText-2 split into its articles; ``"".join(result) == text``.

    An article starts at the blank line before a `` = Title = `` line that has
    a blank line on each side (at the very start of the file the title itself
    may open it). Text before the first title, if any, joins the first article.
    """
    lines = split_lines(text)
    starts = []
    for i, line in enumerate(lines):
        if _is_title(line) and (i == 0 or _is_blank(
                lines[i - 1])) and i + 1 < len(lines) and _is_blank(lines[i + 1]):
            starts.append(max(i - 1, 0))
    if not starts:
        return [text] if text else []
    starts[0] = 0
    bounds = starts + [len(lines)]
    return ["".join(lines[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
