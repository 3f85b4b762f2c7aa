"""prepare at scale: tokens/s and peak memory on 1 and 2 cores, beside HF ``datasets.map`` + ``group_texts``.

    python scripts/bench_prepare.py --work /tmp/seqjax_bench_prepare --out /tmp/bench_prepare.json [--gb 1.0]

1. **Corpus.** WikiText-2 train's articles, shuffled and perturbed (lines
   reordered inside each article, a tenth of the words swapped for others),
   written as ``--files`` parquet files and the same documents as
   ``.jsonl.gz`` files, ``--gb`` of text in all. The first file alone is the
   0.1x corpus. Everything is under ``--work`` and removed at the end unless
   ``--keep``; a corpus (and tokenizer) already there is reused.
2. **prepare** (``python -m seqjax.prepare``, a child process pinned with
   ``taskset`` to 1 or 2 cores) on each format at 0.1x, and on the parquet
   corpus at 1x on 2 cores (``--one-core-full``, ``--jsonl-full`` add the
   other 1x runs): text MB/s,
   tokens/s, and the peak RSS of its process tree (the reader plus its
   tokenizer workers, polled every 50 ms). The tokenizer is trained once
   (``tokenizer.train_bytes``, recorded) and passed by path to every run, so
   the runs time the store build; the tokenizer's training is a row of its own.
3. **HF**, the way run_clm prepares text, on the same files, same cores and same
   tokenizer: ``load_dataset`` (Arrow), ``.map(tokenize, batched=True,
   num_proc=cores)`` with the ``tokenizers`` library's ``encode_batch`` (what a
   fast tokenizer calls), then ``.map(group_texts, batched=True, num_proc=cores)``.
4. **Planning and batches** on the 1x store and on WikiText-2's: one epoch's
   plan, window by window (``data.plan_window_tokens``) and all at once, its
   time and peak traced memory (tracemalloc sees numpy's arrays); and the
   pipeline's batch tokens/s over the first ``--batches`` batches.

Prints one JSON object (also written with --out, after every run). The
machine's load average is recorded before and after each run.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import threading
import time
import tracemalloc
from itertools import islice
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_data import hf_group_texts  # noqa: E402

from seqjax.config.load import load_config  # noqa: E402
from seqjax.data.pipeline import build_pipeline  # noqa: E402
from seqjax.data.plan import EpochPlanner  # noqa: E402
from seqjax.store.build import prepare  # noqa: E402
from seqjax.store.corpus import read_text  # noqa: E402
from seqjax.store.wikitext import wikitext_articles  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BLOCK = 1024  # run_clm's default block size for GPT-2-like models


# ---------------------------------------------------------------------------
# The synthetic corpus


def perturbed(article: str, rng: random.Random, vocabulary: list[str]) -> str:
    """An article with its body lines shuffled and about one word in ten replaced."""
    lines = article.split("\n")
    body = lines[2:]
    rng.shuffle(body)
    out = []
    for line in lines[:2] + body:
        words = line.split(" ")
        for i in range(len(words)):
            if words[i] and rng.random() < 0.1:
                words[i] = rng.choice(vocabulary)
        out.append(" ".join(words))
    return "\n".join(out)


def make_corpus(wikitext: Path, work: Path, gigabytes: float, files: int, seed: int) -> dict:
    articles = [a for a in wikitext_articles(read_text(wikitext)) if a.strip()]
    vocabulary = sorted({w for a in articles[:50] for w in a.split()})
    rng = random.Random(seed)
    per_file = int(gigabytes * 1e9 / files)
    written = []
    for f in range(files):
        docs, size = [], 0
        while size < per_file:
            doc = perturbed(rng.choice(articles), rng, vocabulary)
            docs.append(doc)
            size += len(doc.encode("utf-8"))
        pq.write_table(pa.table({"text": docs}), work / f"part{f:02d}.parquet", row_group_size=2000)
        with gzip.open(work / f"part{f:02d}.jsonl.gz", "wt", encoding="utf-8", compresslevel=1) as out:
            for doc in docs:
                out.write(json.dumps({"text": doc}) + "\n")
        written.append({"documents": len(docs), "bytes": size})
        print(f"# corpus file {f + 1}/{files}: {len(docs):,} documents, {size / 1e6:.0f} MB", file=sys.stderr)
    return {"files": files, "documents": sum(w["documents"] for w in written),
            "text_bytes": sum(w["bytes"] for w in written), "per_file": written}


# ---------------------------------------------------------------------------
# Child processes, measured from outside


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def measured(argv: list[str], cores: int, env: dict | None = None) -> dict:
    """Run ``argv`` pinned to ``cores`` cores; wall time, exit code, stdout, and the peak RSS of its process tree."""
    before = load()
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:cores])
    start = time.perf_counter()
    proc = subprocess.Popen(["taskset", "-c", cpus, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, **(env or {}), "PYTHONPATH": str(REPO)})
    peak = [0]

    def poll():
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
                peak[0] = max(peak[0], sum(p.memory_info().rss for p in tree if p.is_running()))
            except psutil.Error:
                pass
            time.sleep(0.05)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    out, err = proc.communicate()
    watcher.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} failed ({proc.returncode}):\n{err[-3000:]}")
    return {"seconds": round(time.perf_counter() - start, 2), "peak_rss_mb": round(peak[0] / 2**20, 1),
            "cores": cores, "load_before": before, "load_after": load(), "stdout": out}


def seqjax_run(files: list[Path], kind: str, cache: Path, tokenizer: Path | None, cores: int,
               train_bytes: int, keep: bool = False) -> dict:
    entries = "[" + ",".join(str(f) for f in files) + "]"
    argv = [sys.executable, "-m", "seqjax.prepare", "--splits", "train", "--log-level", "WARNING",
            f"data.corpus={kind}", f"data.train_files={entries}", f"data.cache_dir={cache}",
            "tokenizer.vocab_size=8192", f"tokenizer.train_bytes={train_bytes}"]
    if tokenizer:
        argv.append(f"tokenizer.path={tokenizer}")
    result = measured(argv, cores)
    summary = json.loads(result.pop("stdout").strip().splitlines()[-1])["train"]
    if not keep:
        shutil.rmtree(cache, ignore_errors=True)
    result.update(tokens=summary["tokens"], text_bytes=summary["bytes"], documents=summary["documents"],
                  shards=summary["shards"], tokens_per_s=round(summary["tokens"] / result["seconds"]),
                  text_mb_per_s=round(summary["bytes"] / 1e6 / result["seconds"], 2))
    result["tokens_per_s_per_core"] = round(result["tokens_per_s"] / cores)
    return result


def hf_child(args: argparse.Namespace) -> None:
    """The HF path in this (child) process: load_dataset, map(tokenize), map(group_texts); prints its counts."""
    import datasets
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    tokenizer = Tokenizer.from_file(args.tokenizer)
    builder = "parquet" if args.files[0].endswith(".parquet") else "json"
    raw = datasets.load_dataset(builder, data_files=args.files, split="train", cache_dir=args.hf_cache)

    def tokenize(batch):
        encoded = tokenizer.encode_batch(batch["text"], add_special_tokens=False)
        return {"input_ids": [e.ids for e in encoded], "attention_mask": [e.attention_mask for e in encoded]}

    tokenized = raw.map(tokenize, batched=True, num_proc=args.cores if args.cores > 1 else None,
                        remove_columns=raw.column_names)
    grouped = tokenized.map(hf_group_texts, batched=True, num_proc=args.cores if args.cores > 1 else None,
                            fn_kwargs={"block_size": BLOCK})
    tokens = pa.compute.sum(pa.compute.list_value_length(tokenized.data.table.column("input_ids"))).as_py()
    print(json.dumps({"tokens": tokens, "blocks": len(grouped)}))


def hf_run(files: list[Path], tokenizer: Path, work: Path, cores: int, text_bytes: int) -> dict:
    cache = work / "hf_cache"
    argv = [sys.executable, str(Path(__file__).resolve()), "--hf-child", "--tokenizer", str(tokenizer),
            "--hf-cache", str(cache), "--cores", str(cores), "--files", *map(str, files)]
    result = measured(argv, cores, {"HF_DATASETS_OFFLINE": "1", "RAYON_NUM_THREADS": str(cores)})
    counts = json.loads(result.pop("stdout").strip().splitlines()[-1])
    shutil.rmtree(cache, ignore_errors=True)
    result.update(tokens=counts["tokens"], blocks=counts["blocks"], tokens_per_s=round(counts["tokens"] /
                  result["seconds"]), text_mb_per_s=round(text_bytes / 1e6 / result["seconds"], 2))
    result["tokens_per_s_per_core"] = round(result["tokens_per_s"] / cores)
    return result


# ---------------------------------------------------------------------------
# Planning and batches, in this process


def planning(store, strategy: list[str], window_tokens: int) -> dict:
    config = load_config(None, [*strategy, "data.seq_len=2048", "data.batch_size=16",
                                f"data.plan_window_tokens={window_tokens}"])
    tracemalloc.start()
    start = time.perf_counter()
    planner = EpochPlanner(config, store)
    rows = 0
    for position in range(len(planner.windows(0))):
        rows += planner.window_plan(0, position).num_rows
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"windows": len(planner.windows(0)), "rows": rows, "seconds": round(seconds, 3),
            "peak_traced_mb": round(peak / 2**20, 1)}


def batches_per_s(store, strategy: list[str], batches: int) -> dict:
    config = load_config(None, [*strategy, "data.seq_len=2048", "data.batch_size=16"])
    iterator = iter(build_pipeline(config, store))
    next(iterator)  # the first window's plan is planning, timed above
    start, real = time.perf_counter(), 0
    for batch in islice(iterator, batches):
        real += int(batch["weights"].sum())
    seconds = time.perf_counter() - start
    return {"batches": batches, "real_tokens": real, "tokens_per_s": round(real / seconds)}


STRATEGIES = {"pack/best_fit": ["data.strategy=pack", "data.packer=best_fit"], "window": ["data.strategy=window"],
              "random_offset": ["data.strategy=random_offset"]}


def data_side(stores: dict, batches: int) -> dict:
    out = {}
    for label, store in stores.items():
        for name, strategy in STRATEGIES.items():
            out[f"{label} {name}"] = {
                "windowed": planning(store, strategy, 1 << 24),
                "whole_epoch": planning(store, strategy, 1 << 62),
                "batches": batches_per_s(store, strategy, batches),
                "load": load(),
            }
            print(f"# {label} {name}: {out[f'{label} {name}']}", file=sys.stderr)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/seqjax_bench_prepare"))
    p.add_argument("--out", type=Path)
    p.add_argument("--gb", type=float, default=1.0, help="text in the 1x corpus, in GB")
    p.add_argument("--files", nargs="*", default=None)
    p.add_argument("--file-count", type=int, default=10, help="files of each format (the first is the 0.1x corpus)")
    p.add_argument("--wikitext", type=Path, default=Path(os.environ.get("SEQJAX_DATA_DIR", "../shared/data")))
    p.add_argument("--train-bytes", type=int, default=1 << 26, help="tokenizer.train_bytes of every run")
    p.add_argument("--batches", type=int, default=400, help="batches timed per strategy and store")
    p.add_argument("--hf-full", action="store_true", help="also run the HF path on the 1x corpus (slow)")
    p.add_argument("--one-core-full", action="store_true", help="also run prepare on the 1x corpus on one core (slow)")
    p.add_argument("--jsonl-full", action="store_true", help="also run prepare on the 1x jsonl.gz corpus (slow)")
    p.add_argument("--small-only", action="store_true",
                   help="only the 0.1x parquet runs beside HF's (to repeat them at a quieter moment)")
    p.add_argument("--keep", action="store_true", help="keep the corpus and stores under --work")
    p.add_argument("--hf-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    p.add_argument("--hf-cache", help=argparse.SUPPRESS)
    p.add_argument("--cores", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.hf_child:
        args.files = args.files or []
        return hf_child(args)

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    memory = psutil.virtual_memory().total / 2**30
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              "machine": f"{platform.machine()}, {psutil.cpu_count()} cores, {memory:.0f} GiB",
              "python": platform.python_version(), "command": " ".join(sys.argv),
              "train_bytes": args.train_bytes, "load_at_start": load()}
    def save() -> None:  # after every run: a long benchmark that is stopped keeps what it measured
        if args.out:
            args.out.write_text(json.dumps(record, indent=1))

    try:
        corpus_record = work / "corpus.json"
        if corpus_record.is_file():  # a corpus written by an earlier call with the same --work
            record["corpus"] = json.loads(corpus_record.read_text())
        else:
            wikitext = args.wikitext / "wikitext-2" / "wiki.train.tokens"
            record["corpus"] = make_corpus(wikitext, work, args.gb, args.file_count, seed=0)
            corpus_record.write_text(json.dumps(record["corpus"]))
        parquet = sorted(work.glob("part*.parquet"))
        jsonl = sorted(work.glob("part*.jsonl.gz"))
        record["corpus"]["parquet_bytes"] = sum(f.stat().st_size for f in parquet)
        record["corpus"]["jsonl_gz_bytes"] = sum(f.stat().st_size for f in jsonl)
        tenth = record["corpus"]["per_file"][0]["bytes"]

        # the tokenizer, trained once by prepare on the 0.1x corpus (its time and memory are a row of their own)
        found = sorted((work / "cache_tok").rglob("tokenizer.json"))
        if not found:
            record["tokenizer_and_store_0.1x_parquet_2_cores"] = seqjax_run(
                parquet[:1], "parquet", work / "cache_tok", None, 2, args.train_bytes, keep=True)
            found = sorted((work / "cache_tok").rglob("tokenizer.json"))
        tokenizer = found[0]
        runs = record["prepare"] = {}

        def one(key, run):
            runs[key] = run()
            print(f"# {key}: {runs[key]}", file=sys.stderr)
            save()

        # the 1x store first (kept for the planning and batch figures), then 0.1x side by side with HF
        if not args.small_only:
            one("seqjax parquet 1x 2 core(s)",
                lambda: seqjax_run(parquet, "parquet", work / "cache_1x", tokenizer, 2, args.train_bytes, keep=True))
            config = load_config(None, ["data.corpus=parquet", f"data.train_files=[{','.join(map(str, parquet))}]",
                                        f"data.cache_dir={work / 'cache_1x'}", f"tokenizer.path={tokenizer}"])
            big = prepare(config, splits=("train",)).stores["train"]
            small = prepare(load_config(None, [f"data.dir={args.wikitext}", f"data.cache_dir={work / 'cache_wt'}",
                                               f"tokenizer.path={tokenizer}"]), splits=("train",)).stores["train"]
            record["data"] = data_side({"1x": big, "wikitext2": small}, args.batches)
            save()
        for kind, files in (("parquet", parquet[:1]), ("jsonl", jsonl[:1]))[: 1 if args.small_only else 2]:
            for cores in (2, 1):
                one(f"seqjax {kind} 0.1x {cores} core(s)",
                    lambda: seqjax_run(files, kind, work / "cache_run", tokenizer, cores, args.train_bytes))
                one(f"hf {kind} 0.1x {cores} core(s)", lambda: hf_run(files, tokenizer, work, cores, tenth))
        if args.one_core_full:
            one("seqjax parquet 1x 1 core(s)",
                lambda: seqjax_run(parquet, "parquet", work / "cache_run", tokenizer, 1, args.train_bytes))
        if args.jsonl_full:
            one("seqjax jsonl 1x 2 core(s)",
                lambda: seqjax_run(jsonl, "jsonl", work / "cache_run", tokenizer, 2, args.train_bytes))
        if args.hf_full:
            one("hf parquet 1x 2 core(s)", lambda: hf_run(parquet, tokenizer, work, 2, record["corpus"]["text_bytes"]))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    record["load_at_end"] = load()
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
