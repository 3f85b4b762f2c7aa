"""How one source's records become examples (:class:`ExampleSpec`): the fields read, what is scored,
the chat template and the tokens that frame it; shared by :mod:`seqjax.store.chat` and
:mod:`seqjax.store.examples`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

CHAT_TEMPLATE_FILE = "chat_template.jinja"
# A chat record's own template variables (TRL's column name), over data.chat_template_kwargs.
KWARGS_FIELD = "chat_template_kwargs"
# (chat_template.json: where a VL model's processor keeps its template, as Qwen-VL's Hub folders do)
TEMPLATE_FILES = (CHAT_TEMPLATE_FILE, "tokenizer_config.json", "chat_template.json")
NOT_SCORED = -100  # HF's label for a token the loss skips
# Chats with images: the folder a record's relative image paths start from (its data file's), added
# by the reader
IMAGE_BASE = "__image_base__"


@dataclass(frozen=True)
class ExampleSpec:
    """How one source's records become examples: picklable, so tokenizer processes take it whole."""

    format: str
    loss_on: str  # resolved: completion / assistant / last_assistant / all / labels
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    prompt_separator: str = ""
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    messages_field: str = "messages"
    tools_field: str = "tools"
    input_ids_field: str = "input_ids"
    labels_field: str = "labels"
    loss_weights_field: str = "loss_weights"
    chat_template: str | None = None
    template_name: str = ""
    bos_token: str | None = None
    eos_token: str = "<|endoftext|>"
    weights_dtype: str = "uint8"  # data.loss_weights_dtype: how the store keeps each target's weight
    # A shipped training template that renders this template's chats the same text
    # (:func:`twin_template`): a template without generation blocks is scored as its twin marks each
    # chat it renders identically.
    twin: str | None = None
    # data.chat_template_kwargs as JSON text (sorted keys: hashable, and one store key per meaning)
    template_kwargs: str = "{}"
    # chats with images (data.image_processor): the processor's settings
    # (seqjax.store.images.ImageSpec), the images' column and the token the template puts for each
    image_spec: Any = None
    images_field: str = "images"
    image_token: str = "<|image_pad|>"
    # preference: an EOS after each completion as TRL's DPOTrainer (template) or its CPO and ORPO
    # trainers (always) put one; what a pair of equal or empty completions becomes (keep, drop,
    # error)
    pair_eos: str = "template"
    degenerate_pairs: str = "keep"

    @property
    def fields(self) -> tuple[str, ...]:
        """The record fields read, the required one first."""
        return {
            "prompt_completion": (self.prompt_field, self.completion_field),
            "chat": (self.messages_field, self.tools_field, KWARGS_FIELD, self.images_field),
            "tokenized": (self.input_ids_field, self.labels_field, self.loss_weights_field),
            "preference": (self.chosen_field, self.rejected_field, self.prompt_field, self.tools_field,
                           KWARGS_FIELD),
            "prompt": (self.prompt_field, self.tools_field, KWARGS_FIELD),
        }[self.format]

    def identity(self) -> dict[str, Any]:
        """What the store's cache key takes from the spec: everything that changes the ids or the
        mask."""
        return {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in self.__dict__.items()}


