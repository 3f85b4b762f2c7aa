"""Text generation from a trained run: ``python -m seqjax.generate --run DIR --prompt "..."``.

Decoding is :func:`seqjax.model.decode.generate`, with a KV cache: one prefill over
all prompts, then one jitted step per new token (compiled once; the sampling
settings are traced values, so they never recompile either). A batch of
prompts of different lengths goes right-padded in one prefill; each row
continues at its own next position and padding slots are masked by their
segment id 0.

Every prompt is preceded by ``<|endoftext|>``, the token every training
sequence and every evaluation unit starts with, so an article's opening is
generated in the setting the model learned it (an empty prompt generates
from that token alone); a model with a beginning-of-text token
(``tokenizer.bos_token``, e.g. an imported Llama's ``<s>``) gets that instead.
A row stops at its first end-of-text; the loop stops when every row has, or
after ``--max-new-tokens``.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any, Sequence

from seqjax.core.errors import UsageError
from seqjax.core.files import json_text
from seqjax.main import cli, trained
from seqjax.model.decode import generate
from seqjax.model.sampling import SamplingConfig

log = logging.getLogger("seqjax.generate")  # the command's name, as its log lines show it


def read_prompts(prompt: str | None, prompts_file: str | None) -> list[str]:
    """``--prompt`` plus one prompt per non-empty line of ``--prompts FILE``."""
    prompts = [] if prompt is None else [prompt]
    if prompts_file is not None:
        path = Path(prompts_file)
        if not path.is_file():
            raise UsageError(f"--prompts {prompts_file!r}: no such file (expected one prompt per line)")
        prompts += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise UsageError("expected --prompt TEXT or --prompts FILE with at least one non-empty line")
    return prompts


def main(argv: Sequence[str] | None = None) -> int:
    cli.run(build_parser(), argv, continue_prompts)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The generate CLI's flags."""
    p = cli.parser("python -m seqjax.generate", "Continue prompts with a trained model (last line: one JSON object).")
    trained.add_checkpoint_args(p)
    p.add_argument("--prompt", help="text to continue ('' starts a new article)")
    p.add_argument("--prompts", metavar="FILE", help="a file with one prompt per line, generated as one batch")
    # One flag style across the CLIs (dashes); the underscore spellings of earlier releases still work.
    p.add_argument("--max-new-tokens", "--max_new_tokens", dest="max_new_tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    p.add_argument("--top-p", "--top_p", dest="top_p", type=float, default=1.0, help="nucleus mass to keep (1: off)")
    p.add_argument("--top-k", "--top_k", dest="top_k", type=int, default=0, help="most likely tokens to keep (0: off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: run.seed)")
    return p


def continue_prompts(args: argparse.Namespace) -> dict[str, Any]:
    """Every request is checked (prompts, sampling, checkpoint, lengths) before the first token is decoded."""
    texts = read_prompts(args.prompt, args.prompts)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    config, model = trained.load_checkpoint(args)
    tokenizer = trained.trained_tokenizer(args, config)  # the run's tokenizer, reused from the cache
    seed = config.run.seed if args.seed is None else args.seed
    start = time.perf_counter()
    outputs = generate(
        model,
        [[tokenizer.bos_id] + tokenizer.encode(text) for text in texts],
        eot_id=tokenizer.eot_id,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        seed=seed,
    )
    seconds = time.perf_counter() - start
    samples = []
    for text, out in zip(texts, outputs):
        completion = tokenizer.decode(out.tokens)
        log.info("--- %r\n%s%s", text, text, completion)
        samples.append({"prompt": text, "completion": completion, "new_tokens": len(out.tokens),
                        "stopped_at_eot": out.stopped})
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
