"""Text generation from a trained run: ``python -m seqjax.generate --run DIR --prompt "..."``.

Decoding is the generation engine's (:func:`seqjax.engine.generate`; docs/generation.md): every
prompt prefilled once, packed, then continuous batching over a paged KV cache on the device, sized by
``engine.*``. ``--num-return-sequences N`` samples N continuations of each prompt, sharing its
prompt's pages. The sampling settings are traced values, so they never recompile.

Every prompt is preceded by ``<|endoftext|>``, the token every training
sequence and every evaluation unit starts with, so an article's opening is
generated in the setting the model learned it (an empty prompt generates
from that token alone); a model with a beginning-of-text token
(``tokenizer.bos_token``, e.g. an imported Llama's ``<s>``) gets that instead.
A prompt that already opens with that token (a chat template's rendering)
keeps one. A row stops at its first end-of-text; the loop stops when every
row has, or after ``--max-new-tokens``.

``--chat FILE.jsonl`` takes conversations instead (one a line: ``{"messages":
[...], "tools": [...]}``, tools optional, or the list of messages itself): each is rendered with the
run's chat template and its generation prompt, as transformers' ``apply_chat_template(...,
add_generation_prompt=True)`` does, the reply stops at the template's end-of-turn token
(``<|im_end|>``, ``</s>``) too, and the reply alone is printed. A run trained on chats with images
(``data.image_processor``) reads their image parts as training does (TRL's ``images`` column or a
part's own path, relative to the file): the prompt's images go through the vision tower.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from seqjax.core.errors import UsageError
from seqjax.core.files import json_text, read_utf8
from seqjax.data.image_rows import ImageLayout, image_example, prompt_image_fields
from seqjax.engine import generate
from seqjax.main import cli, trained
from seqjax.model.sampling import SamplingConfig
from seqjax.store.chat import chat_prompt, end_of_turn
from seqjax.store.examples import example_spec
from seqjax.store.image_chats import expand_images, image_sources, without_nulls
from seqjax.store.spec import IMAGE_BASE, KWARGS_FIELD

log = logging.getLogger("seqjax.generate")  # the command's name, as its log lines show it


def read_chats(path_text: str) -> list[dict[str, Any]]:
    """Each conversation of ``--chat FILE.jsonl`` as a record: each line a ``{"messages": [...]}``
    object (with the chat's ``"tools"``, ``"chat_template_kwargs"`` and ``"images"``, if any) or the
    list of messages itself; image paths are relative to the file."""
    path = Path(path_text)
    if not path.is_file():
        raise UsageError(
            f"--chat {path_text!r}: no such file (expected one conversation per line, as JSON)")
    chats = []
    for number, line in enumerate(read_utf8(path, UsageError, "--chat").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise UsageError(f"--chat {path_text}:{number}: not JSON ({err})") from None
        record = record if isinstance(record, dict) else {"messages": record}
        chats.append({**record, IMAGE_BASE: str(path.resolve().parent)})
    if not chats:
        raise UsageError(
            f"--chat {path_text!r}: no conversation in it; expected one JSON line per conversation")
    return chats


def chat_prompts(path_text: str, config, tokenizer) -> tuple[list[str], list[list[int]], dict | None, list[int]]:
    """(each conversation rendered with the generation prompt, its ids, the image fields of the
    batch of them or None, the ids a reply stops at). With ``data.image_processor`` each image part
    becomes one image token per merged patch group, as the store expands it."""
    # the store's spec of the run's chats: the template, its tokens and the image settings it read
    # them with
    chats = dataclasses.replace(config.data.resolved_sources()[0], format="chat")
    spec = example_spec(config, chats, Path(tokenizer.path), tokenizer.eot_token)
    texts, ids, examples = [], [], []
    for k, record in enumerate(read_chats(path_text)):
        where = f"--chat {path_text}:conversation {k + 1}"
        # (an RL run's prompts file holds its conversations under data.prompt_field, TRL's "prompt")
        messages = record.get("messages", record.get(config.data.prompt_field))
        record = {**record, "messages": without_nulls(messages)}
        texts.append(chat_prompt(spec, record["messages"], where, record.get("tools"), record.get(KWARGS_FIELD)))
        ids.append(tokenizer.encode_text(texts[-1]))
        # (the record's images: its parts' paths, or its images column)
        if spec.image_spec is not None:
            sources = image_sources(spec, record, where)
            expanded, _, images = expand_images(np.asarray(ids[-1]), np.zeros(len(ids[-1])), sources, spec,
                                                tokenizer.token_id(spec.image_token), where)
            ids[-1] = expanded.tolist()
            examples.append(image_example(expanded, images, spec.image_spec))
    turn_end = end_of_turn(spec, tokenizer)
    fields = None if spec.image_spec is None else prompt_image_fields(
        examples, ImageLayout(tokenizer.token_id(spec.image_token), spec.image_spec.merge_size,
                              spec.image_spec.patch_dim))
    return texts, ids, fields, [tokenizer.eot_id] + ([turn_end] if turn_end is not None else [])


def read_prompts(prompt: str | None, prompts_file: str | None) -> list[str]:
    """``--prompt`` plus one prompt per non-empty line of ``--prompts FILE``."""
    prompts = [] if prompt is None else [prompt]
    if prompts_file is not None:
        path = Path(prompts_file)
        if not path.is_file():
            raise UsageError(f"--prompts {prompts_file!r}: no such file (expected one prompt per line)")
        prompts += [line for line in read_utf8(path, UsageError, "--prompts").splitlines() if line.strip()]
    if not prompts:
        raise UsageError("expected --prompt TEXT or --prompts FILE with at least one non-empty line")
    return prompts


def stop_tokens(text: str, tokenizer) -> list[int]:
    """``--stop TEXT`` as the token ids a continuation must end with: TEXT encoded alone, refused in
    one line unless they decode to TEXT again."""
    ids = tokenizer.encode_text(text)
    if not ids or tokenizer.decode(ids) != text:
        raise UsageError(f"--stop {text!r}: the tokenizer encodes it as {ids}, which decodes to "
                         f"{tokenizer.decode(ids)!r}; expected a non-empty text it encodes exactly")
    return ids


def main(argv: Sequence[str] | None = None) -> int:
    cli.run(build_parser(), argv, continue_prompts)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The generate CLI's flags."""
    p = cli.parser("python -m seqjax.generate",
                   "Continue prompts with a trained model (last line: one JSON object).")
    trained.add_checkpoint_args(p)
    p.add_argument("--prompt", help="text to continue ('' starts a new article)")
    p.add_argument(
        "--chat", metavar="FILE.jsonl",
        help="conversations, one JSON per line ({\"messages\": [...]} or "
        "the list): rendered with the run's chat template and generation prompt; the reply is printed"
    )
    p.add_argument("--prompts", metavar="FILE",
                   help="a file with one prompt per line, generated as one batch")
    # One flag style across the CLIs (dashes); the underscore spellings of earlier releases still
    # work.
    p.add_argument("--max-new-tokens", "--max_new_tokens", dest="max_new_tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    p.add_argument("--top-p", "--top_p", dest="top_p", type=float, default=1.0,
                   help="nucleus mass to keep (1: off)")
    p.add_argument("--top-k", "--top_k", dest="top_k", type=int, default=0,
                   help="most likely tokens to keep (0: off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: run.seed)")
    p.add_argument("--num-return-sequences", dest="num_return_sequences", type=int, default=1,
                   help="continuations of each prompt (transformers' num_return_sequences)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a continuation once its tokens end with TEXT's tokens (left out of it; "
                   "repeatable)")
    p.add_argument("--stream", action="store_true",
                   help="print each continuation as one JSON line as soon as it ends (the others still "
                   "decoding); the last line is still the summary")
    return p


def continue_prompts(args: argparse.Namespace) -> dict[str, Any]:
    """Every request is checked (prompts, sampling, checkpoint, lengths) before the first token is
    decoded."""
    if args.chat is not None and (args.prompt is not None or args.prompts is not None):
        raise UsageError("--chat: got it with --prompt/--prompts, expected one of them")
    texts = None if args.chat is not None else read_prompts(args.prompt, args.prompts)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    if args.num_return_sequences < 1:
        raise UsageError(f"--num-return-sequences: got {args.num_return_sequences}, expected at least 1")
    config, model = trained.load_checkpoint(args)
    # the run's tokenizer, reused from the cache
    tokenizer = trained.trained_tokenizer(args, config)
    stop_ids, images = [tokenizer.eot_id], None
    if texts is None:
        texts, ids, images, stop_ids = chat_prompts(args.chat, config, tokenizer)
    elif config.data.image_processor is not None:
        raise UsageError("--prompt/--prompts: got text for a model trained on chats with images; expected "
                         "--chat FILE.jsonl (its image parts read as training reads them)")
    else:  # a prompt as the store encodes text, after the opening token every document has
        ids = [tokenizer.opened(tokenizer.encode(text)) for text in texts]
    stop_sequences = [stop_tokens(text, tokenizer) for text in args.stop]
    seed = config.run.seed if args.seed is None else args.seed
    copies = args.num_return_sequences
    prompts = [t for t in texts for _ in range(copies)]

    def stream(index: int, out) -> None:  # (--stream: a line as each continuation ends)
        print(json_text({"index": index, "prompt": prompts[index], "completion": tokenizer.decode_whole(out.tokens),
                         "new_tokens": len(out.tokens), "stopped_at_eot": out.stopped}), flush=True)

    start = time.perf_counter()
    outputs = generate(
        model,
        # A chat's ids exactly as its template renders them (the store keeps examples so, and
        # transformers' apply_chat_template(tokenize=True) gives them)
        ids,
        eot_id=stop_ids,
        images=images,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        seed=seed,
        copies=copies,
        engine=config.engine,
        on_done=stream if args.stream else None,
        stop_sequences=stop_sequences,
    )
    seconds = time.perf_counter() - start
    samples = []
    for text, out in zip(prompts, outputs):
        completion = tokenizer.decode_whole(out.tokens)
        log.info("--- %r\n%s%s", text, text, completion)
        samples.append({"prompt": text, "completion": completion, "new_tokens": len(out.tokens),
                        "stopped_at_eot": out.stopped, "token_ids": out.tokens})
    new_tokens = sum(s["new_tokens"] for s in samples)
    result = {
        "samples": samples,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "seed": seed,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(new_tokens / seconds, 1) if seconds > 0 else None,
    }
    print(json_text(result), flush=True)
    return result
