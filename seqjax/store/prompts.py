"""The prompts of an online RL run (``data.format=prompt``), read as TRL's GRPOTrainer reads them.

A record holds ``prompt`` (``data.prompt_field``): standard text, tokenized with the tokenizer's own
special tokens (a Llama tokenizer opens with its BOS), or conversational (a list of ``{role,
content}`` messages), rendered by the run's chat template with the generation prompt, the record's
``tools`` and ``chat_template_kwargs`` as transformers passes them. Every other column (an
``answer``, a ``solution``, test cases) is kept as it is and handed to the reward functions as
keyword arguments, as TRL passes a dataset's extra columns.

The prompts are few (thousands, not billions of tokens) and read whole: no token store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from seqjax.config.tree import Config
from seqjax.core.errors import CorpusError
from seqjax.store.chat import chat_prompt
from seqjax.store.corpus import ALL_FIELDS, file_records
from seqjax.store.pairs import conversational
from seqjax.store.spec import KWARGS_FIELD, ExampleSpec


@dataclass
class Prompt:
    """One prompt: its number in the file(s), its token ids, the prompt as the record gives it (text or
    messages, what a reward function receives), its text as rendered, and the record's other columns."""

    index: int
    ids: np.ndarray
    prompt: Any
    text: str
    columns: dict[str, Any] = field(default_factory=dict)
    where: str = ""


def read_prompts(config: Config, files: list[Path], tokenizer, spec: ExampleSpec) -> list[Prompt]:
    """Every prompt of ``files``, in order; a record without its prompt, an empty one, or one of neither form is
    one line naming the file and line."""
    source = config.data.resolved_sources()[0]
    field_name = config.data.prompt_field
    out: list[Prompt] = []
    for path in files:
        for where, record in file_records(source, path, (field_name, ALL_FIELDS)):
            prompt = record[field_name]
            if conversational(prompt):
                text = chat_prompt(spec, prompt, where, record.get(spec.tools_field), record.get(KWARGS_FIELD))
                ids = tokenizer.encode_text(text)
            elif isinstance(prompt, str) and prompt:
                text, ids = prompt, tokenizer.encode_special(prompt)
            else:
                raise CorpusError(
                    f"{where}: field {field_name!r} is {type(prompt).__name__} {str(prompt)[:40]!r}; expected a "
                    "non-empty text (standard) or a list of {role, content} messages (conversational)")
            if not len(ids):
                raise CorpusError(f"{where}: the prompt tokenizes to nothing; expected at least one token")
            columns = {k: v for k, v in record.items() if k != field_name}
            out.append(Prompt(len(out), np.asarray(ids, np.int32), prompt, text, columns, where))
    if not out:
        raise CorpusError(f"{', '.join(map(str, files))}: no prompts; expected one record with {field_name!r} "
                          "per line")
    return out
