"""A tiny plain-text corpus (one document per file) and the config overrides that point prepare at it."""

from __future__ import annotations

from pathlib import Path

SPLIT_DOCS = {
    "train": [
        "the cat sat on the mat .\nthe dog sat too .\n",
        "a second document\nwith two lines\n",
        "   \n",
        "naïve café 🙂\n",
    ],
    "valid": ["the cat and the dog .\n", "last line has no newline"],
    "test": ["one more document .\n"],
}


def make_text_corpus(root: Path, cache: Path, docs: dict[str, list[str]] = SPLIT_DOCS) -> list[str]:
    """Write ``docs`` as root/<split>/<i>.txt and return overrides for data.corpus=text with a small vocabulary."""
    for split, texts in docs.items():
        (root / split).mkdir(parents=True, exist_ok=True)
        for i, text in enumerate(texts):
            (root / split / f"{i:03d}.txt").write_text(text, encoding="utf-8")
    return [
        "data.corpus=text",
        f"data.dir={root}",
        "data.train_files=[train]",
        "data.valid_files=[valid]",
        "data.test_files=[test]",
        f"data.cache_dir={cache}",
        "tokenizer.vocab_size=300",
        "tokenizer.min_frequency=1",
    ]
