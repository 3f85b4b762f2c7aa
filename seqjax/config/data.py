"""``data.*``: where the text is, what a record is, and how the token stream is cut into rows (one
section of the config tree, :mod:`seqjax.config.tree`).

The names of the strategies and packers are listed here for validation and ``--help-config``; what
each one does and every rule that relates them to other keys is :mod:`seqjax.data.strategies`'
table, which every command checks right after loading a config
(:func:`seqjax.data.strategies.check_config`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from seqjax.config.fields import DATA, DATA_DIR_ENV, setting
from seqjax.core.errors import ConfigError

# What seqjax passes a chat template itself: data.chat_template_kwargs names others.
TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                      "raise_exception")
# The names data.strategy and data.packer take; seqjax.data.strategies has a row for each
# (tests/test_packing.py).
STRATEGIES = ("window", "random_offset", "sequential", "random_window", "concat_chunk", "block", "pack",
              "length_grouped")
PACKERS = ("greedy", "first_fit", "best_fit", "best_fit_decreasing", "fill", "grain_first_fit",
           "grain_best_fit", "grain_concat_split")

CORPORA = ("wikitext2", "text", "jsonl", "parquet", "hf")
# What one record of a corpus is (seqjax.store.examples): a document, or an instruction example.
FORMATS = ("text", "prompt_completion", "chat", "tokenized", "preference", "prompt")
LOSS_ON = ("auto", "completion", "assistant", "last_assistant", "all")
WEIGHT_DTYPES = ("uint8", "float32")
# Which loss_on each format takes; "auto" is completion / assistant / the records' own labels.
LOSS_ON_FOR = {"text": ("auto", "all"), "prompt_completion": ("auto", "completion", "all"),
               "chat": ("auto", "assistant", "last_assistant", "all"), "tokenized": ("auto", "all"),
               "preference": ("auto", "completion"), "prompt": ("auto", )}

@dataclass
class SourceConfig:
    """One corpus of a mixture (``data.sources``); a null key takes the value of the same ``data.*``
    key."""

    name: str = setting("", "the source's name in reports and cache folders (default: source<i>)")
    weight: float = setting(
        1.0, "share of the training rows drawn from this source (weights are normalized)", min=0.0)
    corpus: str | None = setting(None, "text source (null: data.corpus)", choices=CORPORA)
    variant: str | None = setting(None, "WikiText-2 variant (null: data.variant)",
                                  choices=("tokens", "raw"))
    dir: str | None = setting(None, "folder the file entries are relative to (null: data.dir)")
    text_field: str | None = setting(
        None, "jsonl/parquet/hf: the column or key holding the text (null: data.text_field)")
    format: str | None = setting(None, "what a record is (null: data.format)", choices=FORMATS)
    train_files: list[str] = setting([], "the training files, folders or globs")
    valid_files: list[str] = setting([], "the validation files, folders or globs")
    test_files: list[str] = setting([], "the test files, folders or globs")

    def check(self) -> None:
        pass  # a source's rules need the data.* values it inherits: DataConfig.check runs them


@dataclass
class DataConfig:
    dir: str | None = setting(
        None,
        f"folder holding the corpus (default: ${DATA_DIR_ENV}); for wikitext2 it holds wikitext-2/ and wikitext-2-raw/",
    )
    cache_dir: str = setting(".cache/seqjax",
                             "where the tokenizer and token store are built and reused")
    cache_identity: str = setting(
        "stat", "how a cached tokenizer or store knows its source files: stat (path, size and modification time: "
        "no file read) or content (name, size and a hash of the bytes: a cache moved with its sources to another "
        "folder or machine is reused, as scripts/gpu_suite.py --prepare carries it)", choices=("stat", "content"))
    corpus: str = setting("wikitext2", "text source", choices=CORPORA)
    variant: str = setting("tokens", "WikiText-2 variant: word-level (tokens, with <unk>) or raw",
                           choices=("tokens", "raw"))
    train_files: list[str] = setting(
        [], "for corpus text/jsonl/parquet/hf: the training files, folders or globs")
    valid_files: list[str] = setting(
        [], "for corpus text/jsonl/parquet/hf: the validation files, folders or globs")
    test_files: list[str] = setting(
        [], "for corpus text/jsonl/parquet/hf: the test files, folders or globs")
    # The files' content is judged by the train store's identity; which field of them is the text is
    # a key.
    text_field: str = setting("text",
                              "jsonl/parquet/hf: the key or column holding each document's text",
                              resume=DATA)
    # Instruction data (docs/data.md, "Fine-tuning on instruction data"): which tokens the loss
    # sees.
    format: str = setting("text", "what a record is: a document (text), or an instruction example",
                          choices=FORMATS, resume=DATA)
    loss_on: str = setting(
        "auto",
        "instruction data: which tokens are scored (auto: completion for prompt_completion, "
        "assistant for chat, the records' labels for tokenized)", choices=LOSS_ON, resume=DATA)
    prompt_field: str = setting(
        "prompt", "prompt_completion, preference: the key or column holding the prompt (preference: "
        "absent means implicit, the shared start of chosen and rejected, as TRL's extract_prompt)",
        resume=DATA)
    chosen_field: str = setting("chosen",
                                "preference: the key or column holding the preferred completion",
                                resume=DATA)
    rejected_field: str = setting("rejected",
                                  "preference: the key or column holding the other completion",
                                  resume=DATA)
    shared_prompt: bool = setting(
        False,
        "preference: pack each pair's prompt once, both completions attending to it and not to "
        "each other (the same numbers as the prompt twice, its compute saved; the xla or pallas "
        "attention, pallas without sliding windows)",
        resume=DATA)
    pair_eos: str = setting(
        "auto",
        "preference: template (TRL's DPOTrainer: standard text gets the EOS, a chat ends as its template renders "
        "it), always (its CPO and ORPO trainers: an EOS after every completion that does not end with one), or "
        "auto (always for simpo and orpo, else template)", choices=("auto", "template", "always"), resume=DATA)
    degenerate_pairs: str = setting(
        "keep",
        "preference: a pair whose chosen equals its rejected, or whose completion is empty: keep it (TRL trains "
        "it), drop it, or error (one line naming the record); prepare's summary counts them",
        choices=("keep", "drop", "error"), resume=DATA)
    completion_field: str = setting("completion",
                                    "prompt_completion: the key or column holding the answer",
                                    resume=DATA)
    prompt_separator: str = setting(
        "", "prompt_completion: text put between the prompt and the completion", resume=DATA)
    messages_field: str = setting("messages",
                                  "chat: the key or column holding the list of {role, content}",
                                  resume=DATA)
    tools_field: str = setting(
        "tools", "chat: the key or column holding a record's tool definitions (a list of JSON "
        "schemas, or JSON text of one), rendered as apply_chat_template(tools=...) renders them; "
        "a record without it has none", resume=DATA)
    chat_template: str | None = setting(
        None,
        "chat: a Jinja chat template file (null: the tokenizer's, from its tokenizer_config.json or "
        "chat_template.jinja)", resume=DATA)
    chat_template_kwargs: dict[str, Any] = setting(
        {},
        "chat: extra variables the template reads, passed as apply_chat_template(**kwargs) passes them "
        "(Qwen3's {enable_thinking: false}); a record's own chat_template_kwargs field (TRL's) adds to and "
        "overrides these", resume=DATA)
    image_processor: str | None = setting(
        None, "chat with images: the processor's preprocessor_config.json, or the model folder holding it "
        "(Qwen2.5-VL's, Qwen3-VL's); null: a chat with an image part is refused", resume=DATA)
    images_field: str = setting(
        "images", "chat with images: the key or column listing a record's images in the order of its "
        "{type: image} parts (TRL's): paths relative to the data file, or bytes in parquet; a part may name "
        "its own (image, path or url)", resume=DATA)
    patches_per_row: int = setting(
        0, "chat with images: the patches each row's images may hold, a static budget beside data.seq_len's "
        "tokens (the packer fills both)", min=0, resume=DATA)
    image_token: str = setting(
        "<|image_pad|>", "chat with images: the token the template puts for an image, repeated once per "
        "merged patch group as the processor does (Qwen-VL's)", resume=DATA)
    input_ids_field: str = setting("input_ids",
                                   "tokenized: the key or column holding the token ids",
                                   resume=DATA)
    labels_field: str = setting(
        "labels", "tokenized: the labels (-100: not scored), if the records have them", resume=DATA)
    loss_weights_field: str = setting(
        "loss_weights", "tokenized: a weight per token (0: not scored), if the records "
        "have no labels", resume=DATA)
    loss_weights_dtype: str = setting(
        "uint8",
        "how the store keeps each target's weight: uint8 holds 0/1 (a byte per token); float32 any weight "
        ">= 0, such as Levanter's fractional loss_weights (4 bytes per token)",
        choices=WEIGHT_DTYPES, resume=DATA)
    validation_split_percentage: float = setting(
        0.0,
        "a source without valid_files: this percent of its train documents (chosen by a hash of each "
        "document's text, so the same ones in every run and process) becomes its validation split "
        "(run_clm's validation_split_percentage); 0: none (a run without validation data trains without it)",
        min=0.0, max=50.0, resume=DATA)
    sources: list[SourceConfig] = setting(
        [], "a mixture: corpora with weights, each read like data.* (then data.*_files stay empty)",
        resume=DATA)
    workers: int = setting(0, "tokenizer processes for the store build (0: one per core)", min=0)
    shard_bytes: int = setting(
        1 << 28,
        "source bytes per store shard: consecutive files are grouped up to this size (a bigger file alone)",
        min=1,
    )
    plan_window_tokens: int = setting(
        1 << 24,
        "epochs are planned a window of about this many tokens at a time (windows shuffled, then rows within)",
        min=1,
        resume=DATA,
    )

    # How rows are cut: any change gives other batches, so a resume under it is refused unless
    # allowed. (Which text and tokenizer the rows come from is judged by the train store's identity,
    # which checkpoints record.)
    strategy: str = setting("pack", "how the token stream is cut into rows", choices=STRATEGIES,
                            resume=DATA)
    seq_len: int = setting(256, "tokens per row (model inputs)", min=2, resume=DATA)
    stride: int | None = setting(None, "window: distance between window starts (default: seq_len)",
                                 min=1, resume=DATA)
    batch_size: int = setting(16, "rows per global batch (all processes together)", min=1,
                              resume=DATA)
    shuffle: bool = setting(True, "shuffle rows each epoch", resume=DATA)
    cross_document_attention: bool = setting(
        False,
        "stream strategies and the blocks/sliding evaluation windows: one segment per row (HF/GPT-2) "
        "instead of one per document piece",
        resume=DATA,
    )
    break_mode: str = setting(
        "none",
        "block: fairseq TokenBlockDataset break mode",
        choices=("none", "complete", "complete_doc", "eos"),
        resume=DATA,
    )
    packer: str = setting("best_fit", "pack: the packing algorithm", choices=PACKERS, resume=DATA)
    pack_buffer: int = setting(
        1024,
        "pack: rows open at once in first_fit/best_fit (best_fit_decreasing sorts windows of this many documents; "
        "grain_*: bins)",
        min=1,
        resume=DATA,
    )
    overlong: str | None = setting(
        None,
        "pack, length_grouped: a document or example longer than a row is dropped, truncated (its start "
        "kept), split into several (each its own segment), or an error; null: truncate instruction examples, as "
        "TRL does (a split example's later answers lose their prompt), split text documents",
        choices=("drop", "truncate", "split", "error"), resume=DATA)
    max_segments_per_row: int | None = setting(None, "pack: cap on segments in one row", min=1,
                                               resume=DATA)
    bucket_lengths: list[int] = setting(
        [], "length_grouped: padded row lengths (default: powers of two up to seq_len)",
        resume=DATA)
    mega_batch_mult: int = setting(50, "length_grouped: batches per sorted mega-batch", min=1,
                                   resume=DATA)

    def check(self) -> None:
        taken = sorted(set(self.chat_template_kwargs) & set(TEMPLATE_VARIABLES))
        if taken:
            raise ConfigError(
                f"data.chat_template_kwargs: got {taken[0]!r}, which seqjax itself passes the "
                f"template; expected other names than {', '.join(TEMPLATE_VARIABLES)}")
        if self.sources:
            for split in ("train", "valid", "test"):
                if getattr(self, f"{split}_files"):
                    raise ConfigError(
                        f"data.{split}_files: got {getattr(self, f'{split}_files')}, expected [] when data.sources is "
                        "set; list each source's files under its own train_files/valid_files/test_files"
                    )
            names = [source.name or f"source{i}" for i, source in enumerate(self.sources)]
            for i, source in enumerate(self.sources):
                key = f"data.sources[{i}]"
                if (source.corpus or self.corpus) != "wikitext2" and not source.train_files:
                    raise ConfigError(
                        f"{key}.train_files: got [], expected at least one file for "
                        f"corpus={source.corpus or self.corpus!r}"
                    )
                if names.index(names[i]) != i:
                    raise ConfigError(
                        f"{key}.name: got {names[i]!r}, expected a name no other source has")
            if not any(source.weight > 0 for source in self.sources):
                raise ConfigError(
                    "data.sources: every weight is 0, expected at least one positive weight")
        # (data.train_files itself is required where the train split or a tokenizer trained on it is
        # read: seqjax.store.build.prepare; eval and prepare of other splits need only theirs)
        for source in self.resolved_sources():
            for split in ("train", "valid", "test"):
                files = getattr(source, f"{split}_files")
                if source.corpus == "wikitext2" and files:
                    key = "data" if source.name == "main" else f"data.sources[{source.name}]"
                    raise ConfigError(
                        f"{key}.{split}_files: got {files}, but corpus=wikitext2 reads WikiText-2's own files; "
                        "expected [] (or data.corpus=text, jsonl, parquet or hf to read these files)"
                    )
        self._check_formats()
        for length in self.bucket_lengths:
            if not 2 <= length <= self.seq_len:
                raise ConfigError(
                    f"data.bucket_lengths: got {length}, expected values in [2, data.seq_len={self.seq_len}]"
                )

    def _check_formats(self) -> None:
        """Instruction formats: a corpus of records, and a loss_on the format has. (The strategy
        that keeps examples whole: :func:`seqjax.data.strategies.check_config`.)"""
        formats = {source.format for source in self.resolved_sources()}
        for source in self.resolved_sources():
            if source.format != "text" and source.corpus not in ("jsonl", "parquet", "hf"):
                key = "data.format" if source.name == "main" else f"data.sources[{source.name}].format"
                raise ConfigError(
                    f"{key}: got {source.format!r} with corpus={source.corpus!r}, expected corpus "
                    "jsonl, parquet or hf (records with fields) for instruction data")
        for fmt in formats - {"text"}:
            if self.loss_on not in LOSS_ON_FOR[fmt]:
                raise ConfigError(f"data.loss_on: got {self.loss_on!r}, expected one of "
                                  f"{', '.join(LOSS_ON_FOR[fmt])} for data.format={fmt}")
        if "preference" in formats:
            if formats != {"preference"} or self.sources:
                raise ConfigError(
                    "data.format: got preference with data.sources or other formats, expected "
                    "preference pairs as the one source of a run")
            if self.resolved_overlong == "split":
                raise ConfigError(
                    "data.overlong: got split, expected truncate (TRL's: each sequence cut to "
                    "data.seq_len / 2, a pair whose prompt fills that dropped), drop or error for "
                    "preference pairs, which are packed whole")
        if "prompt" in formats and (formats != {"prompt"} or self.sources):
            raise ConfigError("data.format: got prompt with data.sources or other formats, expected the prompts of "
                              "an online RL run (rl.*) as the one source")
        if self.image_processor is not None:
            if formats != {"chat"} or self.sources:
                raise ConfigError(f"data.image_processor: got {self.image_processor!r} with data.format={self.format}"
                                  f"{' and data.sources' if self.sources else ''}; expected data.format=chat, one "
                                  "source")
            if self.resolved_overlong not in ("drop", "error"):
                raise ConfigError(f"data.overlong: got {self.overlong!r} with images; expected drop (the default "
                                  "with images) or error: a cut example would cut an image's tokens from its patches")
            if self.patches_per_row < 1:
                raise ConfigError("data.patches_per_row: got 0 with data.image_processor set; expected the patches "
                                  "a row's images may hold (at least the largest example's)")
        if self.shared_prompt and "preference" not in formats:
            raise ConfigError(f"data.shared_prompt: got true with data.format={self.format}, expected "
                              "data.format=preference (it shares a pair's prompt)")
        if formats != {"text"}:
            if self.cross_document_attention:
                raise ConfigError(
                    "data.cross_document_attention: got true, expected false for instruction data: "
                    "each example attends only to itself")

    @property
    def instruction(self) -> bool:
        """Whether some source holds instruction examples (data.format other than text)."""
        return any(source.format != "text" for source in self.resolved_sources())

    @property
    def resolved_overlong(self) -> str:
        """``data.overlong``, or its default: drop for chats with images (a cut would cut an image), truncate
        for other instruction data, split for text."""
        return self.overlong or ("drop" if self.image_processor else "truncate" if self.instruction else "split")

    @property
    def resolved_stride(self) -> int:
        return self.seq_len if self.stride is None else self.stride

    def resolved_sources(self) -> list[SourceConfig]:
        """Every source with no null left: each of ``data.sources`` filled in from ``data.*``, or
        the ``data.*`` corpus.

        ``data.corpus=jsonl data.train_files=[a.jsonl]`` gives one source
        named ``main`` of weight 1; a source that leaves ``corpus`` null reads
        ``data.corpus``.
        """
        if not self.sources:
            return [
                SourceConfig(name="main", weight=1.0, corpus=self.corpus, variant=self.variant,
                             dir=self.dir, text_field=self.text_field, format=self.format,
                             train_files=list(self.train_files), valid_files=list(self.valid_files),
                             test_files=list(self.test_files))
            ]
        return [
            dataclasses.replace(
                source,
                name=source.name or f"source{i}",
                corpus=source.corpus or self.corpus,
                variant=source.variant or self.variant,
                dir=source.dir if source.dir is not None else self.dir,
                text_field=source.text_field or self.text_field,
                format=source.format or self.format,
            )
            for i, source in enumerate(self.sources)
        ]
