"""Every command example in the README and docs/ runs: each ``python -m seqjax.*`` line of their bash blocks, and
each line of the scripts in :data:`TOOL`, with only the environment the line itself sets.

Each line runs in a subprocess, in a fresh working folder that holds
``configs/``, ``scripts/`` and ``docs/`` (links to the repo's) and, for a line that reads
a trained run (``--run``), ``runs/wikitext2_cpu`` (a link to the session's
tiny trained run), so relative paths work as written. To finish in seconds, a
line is adapted, and only like this:

1. The setup prefix (``bash scripts/setup.sh &&``) and leading ``VAR=value``
   settings are dropped from the argv: the interpreter is this one; the
   multi-host variables would need four hosts, so that line runs as one
   process. ``SEQJAX_DATA_DIR`` is in the environment only where the line sets
   it (resolved from the repository, as the line is written to run there).
2. ``python`` / ``.venv/bin/python`` becomes this interpreter; a trailing
   ``# comment`` and ``[key=value ...]`` placeholders are dropped.
3. A ``python -m seqjax.*`` tool with ``--config`` reads the tiny JSONL corpus with rows of 64 tokens
   (:func:`tiny_data`, put before the line's own overrides, so those still
   apply), and a training run gets a tiny model and two steps
   (:data:`TINY_TRAIN`, put after them). ``plan_memory.py`` runs as written: it compiles the config's
   full size and reads no data.
4. Generation gets ``--max-new-tokens 8`` (the tiny model accepts 64 tokens;
   the default is 100), and the tiny corpus's validation file stands in for
   a test split.
5. ``hf/llama`` is a tiny random Hugging Face Llama folder the session builds
   (:func:`hf_support.write_llama_folder`, shaped like :data:`TINY_TRAIN`'s
   model, so the fine-tuning line's overrides match it), and a line that
   reads ``runs/llama`` (all but the import itself) gets a link to the
   session's import of it. A line that sets ``SEQJAX_DATA_DIR`` gets the folder
   it names (checked to hold WikiText-2) cut to each split's first three
   articles (:func:`short_wikitext`): the lines that score raw WikiText-2 with
   it read real raw text, a few articles of it.
6. The other corpus kinds' examples read ``corpus/`` in the working folder,
   where the tiny corpus's training documents are written as parquet files,
   a folder of JSONL files keyed ``content``, and an HF ``save_to_disk``
   folder (:func:`write_corpus_kinds`). A line that sets ``data.sources``
   gets the tiny corpus's settings without its file lists (a mixture lists
   its files per source).
7. The instruction-data lines read ``chat_demo/`` (the session's
   ``scripts/make_chat_demo.py`` output: a tiny random chat Llama shaped like
   :data:`TINY_TRAIN`'s model, and synthetic chats), ``runs/chat_base`` (its
   import), ``runs/chat_ft`` (a two-step fine-tune of it on the chats) and
   ``runs/chat_lora`` (two steps of LoRA adapters on it): links in the working
   folder, except in the line that makes each of them.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_support import write_llama_folder
from seqjax.config.tree import DATA_DIR_ENV
from test_train_support import REPO, cli_env

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# The tools, and the scripts a reader is told to run here (the GPU suite has its own dry-run test; pip and
# pytest lines install or run the suite itself).
TOOL = re.compile(r"python -m seqjax\.|scripts/(eval_table|make_chat_demo|plan_memory|study_strategies"
                  r"|probe_mosaic_interpret)\.py")


def readme_commands() -> list[str]:
    """The tool commands of the README's and docs/'s ```bash blocks, continuation lines joined."""
    commands = []
    for document in DOCUMENTS:
        commands += bash_commands(document)
    return commands


def bash_commands(document: Path) -> list[str]:
    commands, in_bash, pending = [], False, ""
    for line in document.read_text().splitlines():
        if line.startswith("```"):
            in_bash = line.strip() == "```bash"
            continue
        if not in_bash:
            continue
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if TOOL.search(line) and "pytest" not in line:
            commands.append(line)
    return commands


def tiny_data(root: Path, files: bool = True) -> list[str]:
    listed = [
        f"data.train_files=[{root / 'train.jsonl'}]",
        f"data.valid_files=[{root / 'valid.jsonl'}]",
        f"data.test_files=[{root / 'valid.jsonl'}]",  # the tiny corpus's stand-in for a test split
    ]
    return [
        "data.corpus=jsonl",
        *(listed if files else []),
        f"data.cache_dir={root / 'cache'}",
        "tokenizer.vocab_size=300",
        "data.seq_len=64",
    ]


def write_corpus_kinds(folder: Path, root: Path) -> None:
    """The tiny corpus's training documents as corpus/parquet/train-*.parquet, corpus/jsonl/ and corpus/hf/train."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [json.loads(line)["text"] for line in (root / "train.jsonl").read_text().splitlines() if line.strip()]
    for name in ("parquet", "jsonl", "hf"):
        (folder / name).mkdir(parents=True)
    half = len(docs) // 2
    for i, part in enumerate((docs[:half], docs[half:])):
        pq.write_table(pa.table({"text": part}), folder / "parquet" / f"train-{i}.parquet")
        (folder / "jsonl" / f"part-{i}.jsonl").write_text("".join(json.dumps({"content": d}) + "\n" for d in part))
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(folder / "hf" / "train"))


TINY_TRAIN = [
    "model.vocab_size=null", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=null",
    "model.d_ff=64", "model.attention=xla", "model.compute_dtype=float32",
    "data.batch_size=8", "train.steps=2", "train.warmup_steps=0", "train.checkpoint_every=2", "train.eval_every=0",
    "train.log_every=1", "eval.batch_size=8",
]


def adapt(command: str, root: Path) -> list[str]:
    """The argv that runs ``command`` on the tiny corpus (the rules in the module docstring)."""
    command = command.split(" #")[0].split("&&")[-1]
    words = [w for w in shlex.split(command) if w != "[key=value" and w != "...]"]
    while "=" in words[0] and not words[0].startswith("-"):  # VAR=value before the command
        words.pop(0)
    assert words[0].endswith("python"), command
    argv = [sys.executable, *words[1:]]
    if "--config" in argv and argv[1] == "-m":  # a script's --config (plan_memory) runs at its full size
        at = argv.index("--config") + 2
        extra_after = TINY_TRAIN if "seqjax.train" in argv else []
        mixture = any(a.startswith("data.sources=") for a in argv)
        argv = [*argv[:at], *tiny_data(root, files=not mixture), *argv[at:], *extra_after]
    elif "--run" in argv and "eval.mode=lm_eval" not in argv:  # (lm_eval reads raw WikiText-2, not these files)
        argv += [f"data.test_files=[{root / 'valid.jsonl'}]"]
    flag = next((f for f in ("--max-new-tokens", "--max_new_tokens") if f in argv), None)
    if flag:
        argv[argv.index(flag) + 1] = "8"
    elif "seqjax.generate" in argv:
        argv[3:3] = ["--max-new-tokens", "8"]  # after [python, -m, seqjax.generate]
    return argv


COMMANDS = readme_commands()
# Lines that differ only in what the adaptation drops (a placeholder, the setup prefix) run once.
_first: dict[tuple[str, ...], str] = {}
for _command in COMMANDS:
    _first.setdefault(tuple(adapt(_command, Path("ROOT"))), _command)
DISTINCT = list(_first.values())


def first_articles(text: str, articles: int = 3) -> str:
    """The opening ``articles`` articles of a WikiText-2 file (each starts at a `` = Title = `` line)."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if re.fullmatch(r" = [^=].* = \n", line)]
    return "".join(lines[:starts[articles]] if len(starts) > articles else lines)


@pytest.fixture(scope="module")
def short_wikitext(tmp_path_factory):
    """``short_wikitext(folder)``: a copy of the WikiText-2 data folder with every split cut to its first three
    articles, made once."""
    made: dict[Path, Path] = {}

    def short(folder: Path) -> Path:
        if folder not in made:
            assert (folder / "wikitext-2").is_dir(), f"{folder} holds no wikitext-2/"
            out = tmp_path_factory.mktemp("wikitext_short")
            for file in [*folder.glob("wikitext-2*/wiki.*")]:
                (out / file.parent.name).mkdir(exist_ok=True)
                (out / file.parent.name / file.name).write_text(first_articles(file.read_text(encoding="utf-8")),
                                                                encoding="utf-8")
            made[folder] = out
        return made[folder]

    return short


def test_the_readme_has_an_example_of_every_tool():
    for tool in ("seqjax.prepare", "seqjax.data", "seqjax.train", "seqjax.eval", "seqjax.generate", "eval_table.py",
                 "seqjax.export", "seqjax.import"):
        assert any(tool + " " in command for command in COMMANDS), tool


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny random HF Llama folder, its seqjax import), built once for the README's HF lines."""
    from seqjax.main import import_hf

    root = tmp_path_factory.mktemp("readme_hf")
    folder = write_llama_folder(root / "llama", num_key_value_heads=4)  # TINY_TRAIN's model: n_kv_heads null
    assert import_hf.main([str(folder), "--out", str(root / "imported"), "model.attention=xla"]) == 0
    return folder, root / "imported"


@pytest.fixture(scope="module")
def chat_demo(tmp_path_factory) -> dict[str, Path]:
    """The instruction-data lines' inputs: the demo set, its import, and a two-step chat fine-tune of it."""
    from seqjax.main import import_hf

    root = tmp_path_factory.mktemp("readme_chat")
    proc = subprocess.run([sys.executable, "scripts/make_chat_demo.py", "--out", str(root / "chat_demo")], cwd=REPO,
                          env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert import_hf.main([str(root / "chat_demo" / "llama"), "--out", str(root / "chat_base"),
                           "model.attention=xla"]) == 0
    demo = root / "chat_demo"
    proc = subprocess.run(
        [sys.executable, "-m", "seqjax.train", "--config", str(root / "chat_base" / "config.yaml"),
         f"train.init_from={root / 'chat_base'}", "data.corpus=jsonl", "data.format=chat",
         f"data.train_files=[{demo / 'train.jsonl'}]", f"data.valid_files=[{demo / 'valid.jsonl'}]",
         f"data.cache_dir={root / 'cache'}", "data.seq_len=128", f"run.dir={root / 'chat_ft'}", *TINY_TRAIN],
        cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = subprocess.run(  # LoRA adapters on chat_base, for the lines that export them
        [sys.executable, "-m", "seqjax.train", "--config", str(root / "chat_base" / "config.yaml"),
         f"train.init_from={root / 'chat_base'}", "data.corpus=jsonl", "data.format=chat",
         f"data.train_files=[{demo / 'train.jsonl'}]", f"data.valid_files=[{demo / 'valid.jsonl'}]",
         f"data.cache_dir={root / 'cache'}", "data.seq_len=128", f"run.dir={root / 'chat_lora'}",
         "model.lora.rank=4", *TINY_TRAIN],
        cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {"chat_demo": demo, "runs/chat_base": root / "chat_base", "runs/chat_ft": root / "chat_ft",
            "runs/chat_lora": root / "chat_lora"}


@pytest.mark.slow
@pytest.mark.parametrize("command", DISTINCT, ids=lambda c: c.split("python")[-1][:70])
def test_readme_example_runs(command, tiny_root, reference, tiny_llama, chat_demo, short_wikitext, tmp_path):
    work = tmp_path / "work"
    (work / "runs").mkdir(parents=True)
    for name in ("configs", "scripts", "docs"):
        (work / name).symlink_to(REPO / name)
    (work / "hf").mkdir()
    (work / "hf" / "llama").symlink_to(tiny_llama[0])
    if re.search(r"runs/llama(?=[\s/]|$)", command) and "seqjax.import" not in command:
        (work / "runs" / "llama").symlink_to(tiny_llama[1])
    if "--run" in command:  # a copy: eval keeps its results in the run (eval_results.json), never in the shared one
        shutil.copytree(tiny_root / "reference", work / "runs" / "wikitext2_cpu")
    (work / "prompts.txt").write_text("the cat\na dog ran\n")
    makes = {"chat_demo": "make_chat_demo.py", "runs/chat_base": "seqjax.import", "runs/chat_ft": "seqjax.train",
             "runs/chat_lora": "seqjax.train"}
    for name, target in chat_demo.items():
        if re.search(rf"{name}(?=[\s/]|$)", command) and makes[name] not in command:
            (work / name).symlink_to(target)
    if "corpus/" in command:
        write_corpus_kinds(work / "corpus", tiny_root)
    argv = adapt(command, tiny_root)
    env = cli_env()
    env.pop(DATA_DIR_ENV, None)  # only what the line sets: a user who copies it has nothing else
    setting = re.search(rf"(?:^|\s){DATA_DIR_ENV}=(\S+)\s", command.split("&&")[-1])
    if setting:  # written to run from the repository (the work folder is elsewhere); its articles cut short
        env[DATA_DIR_ENV] = str(short_wikitext((REPO / setting.group(1)).resolve()))
    proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{shlex.join(argv)}\nexit {proc.returncode}\nSTDERR:\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), "every tool prints its results on stdout"
    if "seqjax.train" in argv:
        # stderr is a pipe here, as under SLURM: besides the progress bar, a plain line every train.log_every steps
        # (an RL objective's loss may be negative; a preference objective's adds its reward accuracy and margin)
        plain = r"seqjax\.train\.metrics: step (\d+)/2: loss -?\d+\.\d+,(?: [^,\n]+,)* \d+ tokens/s"
        assert re.findall(plain, proc.stderr) == ["1", "2"], proc.stderr[-3000:]


def test_the_readme_is_a_front_page_and_links_only_to_files_that_exist():
    """The manual lives in docs/; the README stays a page a newcomer reads to the end (nanoGPT's is 234 lines)."""
    assert len(DOCUMENTS[0].read_text().splitlines()) <= 250
    for document in DOCUMENTS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", document.read_text()):
            if not target.startswith("http"):
                assert (document.parent / target).exists(), f"{document.name} links to {target}, which is missing"
