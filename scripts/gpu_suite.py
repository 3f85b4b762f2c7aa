"""Everything that needs a GPU, from one command of about 9 minutes and a rerun of 4: the GPU tests, the generation
engine against the bandwidth bound, Qwen3.5's delta-rule scan, attention at T = 8k, fine-tuning at Llama-3.2-1B's
shape, Llama-3-8B with LoRA, packed DPO, gpt2_small throughput. One JSON summary + logs.

    python3 scripts/gpu_suite.py --out /tmp/suite                  # on a machine with one NVIDIA GPU
    python3 scripts/gpu_suite.py --out /tmp/suite --dry-run        # CPU: every stage at toy size (CI runs this)

Made for a bare GPU machine with no network: it installs the wheels found in ``--wheels`` (default ``.whl/``:
grain and its needs, kvax, tokamax, ...) with ``pip --no-index --no-deps`` into ``OUT/site``, installs seqjax
there the same way, and runs every stage as a subprocess with that ``PYTHONPATH``, its own time limit and its own
log (``OUT/<stage>.log``). A stage that fails or runs out of time is recorded and the suite goes on. The whole run
keeps within ``--budget-s`` (default 480 s: one lent GPU gives 15 minutes in all, start-up included, so the
measurement is one call of 8 minutes and one rerun); each stage has its own budget, in the order of value below,
and ``OUT/summary.json`` is rewritten as each stage ends, so an interrupted call keeps what it measured.

The default stages, in order (``--only``/``--skip`` pick; the others are opt-in):

  setup       install the carried wheels and seqjax (no dependencies, no index)
  env         GPU, driver, package versions; which peers (kvax, tokamax) import, and why not
  tests       ``pytest`` on the GPU, compiled: the ``gpu``-marked tests, those no GPU has run first (the paged
              decode kernel and the engine on it, the delta-rule scan, the shared prompt, float32 against
              torch), then the flash kernel + three gradients over hypothesis packings in bf16 and float32,
              cudnn, ``auto`` -> pallas, 50 bf16 steps pallas vs xla, and the Mosaic kernel's variants
  engine      scripts/bench_engine.py at the 1B and 8B shapes in bfloat16: the generation engine's new tokens/s
              over 64 slots against the decode's bandwidth bound, on the Pallas paged kernel (then the XLA
              gather path and GRPO-like lengths at 1B)
  gdn         scripts/bench_gdn.py at Qwen3.5-9B's linear layer: the delta-rule scan in XLA and in the Pallas
              kernel (which model.deltanet.kernel=auto should pick), the recurrent form, the flash kernel
  attention   scripts/bench_attention.py at T = 8k, D = 128, dense and packed rows, forward and forward+backward:
              both seqjax kernels (flash on Triton, mosaic on Mosaic GPU) beside cuDNN dense, cuDNN's packed
              layout and tokamax where carried (``--attn-grid``/``--attn-impls`` widen it)
  finetune    fine-tuning at Llama-3.2-1B's shape (configs/llama3_1b_finetune.yaml: random weights, its
              vocabulary and rows) on synthetic prompt/answer records packed best_fit_decreasing, loss on the
              answers, remat, scan_layers and the chunked loss as the config sets them: tokens/s, MFU and peak
              memory beside scripts/plan_memory.py's prediction (``--finetune-plain``: also without remat)
  lora8b      Llama-3-8B's shape with LoRA r = 16 (configs/llama3_8b_lora.yaml: random weights, packed 4k rows,
              remat) on the one GPU: non-padding tokens/s, MFU, peak memory beside the plan; an out-of-memory
              is recorded with the plan beside it
  dpo         scripts/bench_preference.py at the 1B shape: LoRA DPO on the same pairs packed, packed with a shared
              prompt, one pair per row, and padded as TRL pads
  throughput  scripts/bench_train.py on configs/gpt2_small.yaml with the chunked loss, per backend of
              ``--backends`` (default pallas): tokens/s, step time, MFU against the 45% goal

Opt-in stages:

  levanter    Levanter's shape: B=1, S=8192, 32/8 heads, D=128, 256-token documents, the same peers
  profile     ``python -m seqjax.train`` on gpt2_small with ``train.profile``: a trace of 5 steps
  recipe      ``python -m seqjax.train --config configs/wikitext2_gpu.yaml`` for ``--recipe-steps`` steps:
              validation perplexity as tokens, words and bits per byte
  sweep       (opt-in) the flash kernel's block sizes at T=8k, D=128
  ncu         (opt-in) Nsight Compute's view of each kernel's forward (flash, mosaic) at T=8k, D=128
  quality     (opt-in) configs/wikitext2_quality.yaml in --quality-dir, which outlives OUT: each call resumes
              the last (exact resume) until the run ends, then scores the test split (word perplexity against
              AWD-LSTM's 65.8)
  moe         (opt-in) scripts/bench_moe.py at Qwen3-30B-A3B's layer: the experts' dispatches side by side, and
              ragged_dot under XLA's cuDNN ragged-dot fusion (which model.experts.dispatch=auto picks on a GPU)
  study       (opt-in) scripts/study_strategies.py --gpu for --study-strategies x --study-seeds, in OUT/study
              (rerun to continue)

``OUT/summary.json`` holds every stage's status, time and figures, and the issue's targets checked against
them; the last lines printed are a short table.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
DEFAULT_STAGES = ("setup", "env", "tests", "engine", "gdn", "attention", "finetune", "lora8b", "dpo", "throughput")
FIRST_CALL_S, RERUN_CALL_S = 540.0, 240.0  # a lent GPU's 15 minutes: one call of 9, one rerun of 4, start-up
MIN_STAGE_S = 5.0  # a stage given less than this is skipped
OPTIONAL_STAGES = ("levanter", "profile", "recipe", "sweep", "ncu", "quality", "study", "vision", "grpo", "mosaic",
                   "context", "moe")
PEERS = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "tokenizers", "triton", "jax-triton", "kvax",
         "tokamax", "torch", "transformers")
# A toy model and corpus for --dry-run: every stage's plumbing runs on a CPU in seconds.
TINY_MODEL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64", "model.max_seq_len=64",
              "model.vocab_size=null", "model.compute_dtype=float32", "model.attention=xla", "tokenizer.vocab_size=300",
              "data.seq_len=32", "data.batch_size=8", "train.grad_accum=1", "eval.context=32", "eval.stride=16",
              "eval.batch_size=8", "train.eval_batches=2", "train.warmup_steps=1"]


@dataclass
class Stage:
    name: str
    budget_s: float  # the stage's own time limit (the suite's remaining budget may cut it shorter)
    run: Callable[["Suite"], dict]


class Suite:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = args.out.resolve()
        self.dry = args.dry_run
        self.prepared = args.prepared.resolve() if args.prepared else None
        # (a dry run on a CPU checks the plumbing, not the timing: its budgets stretch)
        self.stretch = 10.0 if args.dry_run else 1.0
        self.deadline = time.monotonic() + args.budget_s * self.stretch
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SEQJAX_")}
        self.env.update(PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), SEQJAX_DATA_DIR=str(args.data))
        # (a cache the caller names is kept: the tests' session cache, shared with their other subprocesses)
        self.env.setdefault("JAX_COMPILATION_CACHE_DIR", str(self.out / "jax_cache"))
        if self.dry:
            self.env["JAX_PLATFORMS"] = "cpu"
            self.env.setdefault("PJRT_NPROC", "4")  # the Mosaic interpreter's threads (seqjax/model/kernels/mosaic.py)
        self.summary: dict[str, Any] = {
            "suite": "gpu", "dry_run": self.dry, "command": " ".join(["python3", *sys.argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "budget_s": args.budget_s, "planned": list(args.stages), "stages": {},
        }

    def suite_left(self) -> float:
        """Seconds left of the whole call's budget."""
        return self.deadline - time.monotonic()

    def begin(self, budget_s: float) -> float:
        """Start a stage: its own deadline, ``budget_s`` from now (cut to the call's end), whatever the stage
        before it spent. Returns the seconds it has."""
        self.stage_end = min(self.deadline, time.monotonic() + budget_s)
        return self.remaining()

    def remaining(self) -> float:
        """Seconds left to the running stage's own deadline (:meth:`begin`)."""
        return getattr(self, "stage_end", self.deadline) - time.monotonic()

    def call(self, name: str, argv: list[str], timeout: float, cwd: Path = REPO,
             env: dict[str, str] | None = None) -> tuple[int | None, str]:
        """Run argv with the suite's environment (and ``env``); stdout+stderr go to OUT/<name>.log. (returncode or
        None, stdout)."""
        log = self.out / f"{name}.log"
        timeout = max(1.0, min(timeout, self.remaining()))
        with log.open("a") as f:
            f.write(f"$ {' '.join(argv)}\n")
            f.flush()
            proc = subprocess.Popen(argv, cwd=cwd, env={**self.env, **(env or {})}, stdout=subprocess.PIPE, stderr=f,
                                    text=True)
            try:
                stdout, _ = proc.communicate(timeout=timeout)
                code: int | None = proc.returncode
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, _ = proc.communicate()
                code = None
                f.write(f"\n# killed after {timeout:.0f} s (stage or suite time limit)\n")
            f.write(stdout)
        return code, stdout

    def python(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def tiny_corpus(self) -> list[str]:
        """Overrides pointing any config at a toy JSONL corpus under OUT (dry run)."""
        root = self.out / "tiny_corpus"
        if not root.exists():
            root.mkdir(parents=True)
            words = "the cat sat on a mat while dog ran far away to big small red blue green house tree".split()
            for split, docs in (("train", 300), ("valid", 30)):
                lines = [json.dumps({"text": " ".join(words[(i * 7 + j) % len(words)] for j in range(5 + i % 40))})
                         for i in range(docs)]
                (root / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
        return ["data.corpus=jsonl", f"data.train_files=[{root / 'train.jsonl'}]",
                f"data.valid_files=[{root / 'valid.jsonl'}]", f"data.cache_dir={self.out / 'cache'}", *TINY_MODEL]


# A part's figures as bench_grpo.py and bench_preference.py print them to stderr (the stage's log) when it ends.
PART = re.compile(r"^# (\S+) \([\d.]+ s in\): (\{.*\})$")


def parts_in_log(log: Path) -> dict:
    """The parts' figures a bench printed to ``log`` in its last run (after the last ``$`` line): what a stage cut
    at its budget keeps."""
    lines = log.read_text().splitlines() if log.exists() else []
    start = max((i for i, line in enumerate(lines) if line.startswith("$ ")), default=-1)
    return {m.group(1): json.loads(m.group(2)) for m in map(PART.match, lines[start + 1:]) if m}


def with_parts(s: Suite, name: str, code: int | None, stdout: str) -> dict:
    """A bench's stage result: its summary when it ended, else the parts it finished (``parts``)."""
    if code == 0:
        return {"status": status(code), "result": last_json(stdout)}
    return {"status": status(code), "result": None, "parts": parts_in_log(s.out / f"{name}.log")}


def last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return None


def json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def status(code: int | None) -> str:
    return "timeout" if code is None else ("ok" if code == 0 else f"failed (exit {code})")


# ------------------------------------------------------------------------------------------------ stages


def stage_setup(s: Suite) -> dict:
    site = s.out / "site"
    wheels = sorted(glob.glob(str(s.args.wheels / "*.whl")))
    result: dict[str, Any] = {"wheels": [Path(w).name for w in wheels], "site": str(site)}
    if s.dry:
        return {**result, "status": "ok", "note": "dry run: nothing installed; seqjax is imported from the checkout"}
    pip = s.python("-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                   "--upgrade", "--target", str(site))
    code = 0
    if wheels:
        code, _ = s.call("setup", [*pip, *wheels], 120)
    seqjax_code, _ = s.call("setup", [*pip, "--no-build-isolation", str(REPO)], 120)
    # seqjax from the installed copy when it installed (the checkout otherwise, which is the same code).
    s.env["PYTHONPATH"] = os.pathsep.join([str(site)] if seqjax_code == 0 else [str(site), str(REPO)])
    return {**result, "status": status(code), "seqjax_installed": seqjax_code == 0}


ENV_PROBE = textwrap.dedent("""
    import importlib, importlib.metadata as md, json, warnings
    import jax
    out = {"backend": jax.default_backend(), "devices": [d.device_kind for d in jax.devices()], "versions": {}}
    for name in %r:
        try:
            out["versions"][name] = md.version(name)
        except md.PackageNotFoundError:
            out["versions"][name] = None
    out["imports"] = {}
    for name, module in (("grain", "grain"), ("kvax", "kvax.ops"),
                         ("tokamax", "tokamax._src.ops.attention.pallas_mosaic_gpu")):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                importlib.import_module(module)
            out["imports"][name] = "ok"
        except Exception as err:
            out["imports"][name] = f"{type(err).__name__}: {err}"[:300]
    print(json.dumps(out))
""") % (PEERS,)


def stage_env(s: Suite) -> dict:
    code, stdout = s.call("env", s.python("-c", ENV_PROBE), 90)
    result = last_json(stdout) or {}
    if shutil.which("nvidia-smi"):
        _, smi = s.call("env", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                "--format=csv,noheader"], 30)
        result["nvidia_smi"] = smi.strip()
    if not s.dry and result.get("backend") != "gpu":
        return {**result, "status": "failed (no GPU visible to JAX)"}
    return {**result, "status": status(code)}


def stage_tests(s: Suite) -> dict:
    junit = s.out / "tests.xml"
    files = ["tests/test_gpu.py", "tests/test_attention.py", "tests/test_mosaic.py"]
    # In this one process (`addopts=` drops pyproject's `-n auto`): one GPU, and the image has no pytest-xdist.
    argv = s.python("-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-o", "addopts=",
                    f"--junitxml={junit}", "-rfEs", *files)
    # Each failure's report reaches the log as it happens (tests/conftest.py), so a cut stage keeps it.
    code, stdout = s.call("tests", argv, 240, env={"SEQJAX_FAILURES_NOW": "1"})
    result: dict[str, Any] = {"status": status(code), "files": files}
    if junit.exists():
        import xml.etree.ElementTree as ET

        suite = ET.parse(junit).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        result.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
        result["failed_tests"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                                  if c.find("failure") is not None or c.find("error") is not None]
    result["tail"] = stdout.strip().splitlines()[-1:] if stdout.strip() else []
    return result


def bench_attention(s: Suite, name: str, args: list[str], budget: float) -> dict:
    jsonl = s.out / f"{name}.jsonl"
    argv = s.python("scripts/bench_attention.py", f"--out={jsonl}", *(["--smoke"] if s.dry else []), *args)
    code, stdout = s.call(name, argv, budget)
    records = [r for r in json_lines(stdout) if "impl" in r]
    keep = ("impl", "input", "seq_len", "head_dim", "heads", "kv_heads", "rows", "documents", "fwd_ms", "fwd_bwd_ms",
            "fwd_tflops", "fwd_bwd_tflops", "prep_ms", "rel_err_vs_flash", "error", "block_sizes",
            "fwd_tiles_visited", "fwd_tiles_causal_triangle")
    return {"status": status(code), "records": [{k: r[k] for k in keep if k in r} for r in records]}


def stage_attention(s: Suite) -> dict:
    """One bench_attention run per head dim of ``--attn-grid`` ('128:1024,8192 64:1024'), records merged."""
    if s.dry:  # (the kernel's deeper rings are the opt-in mosaic stage's; the interpreter takes 10 s a case)
        return bench_attention(s, "attention", ["--impls", "flash,mosaic,xla"], 240)
    results = [bench_attention(s, "attention", ["--seq-lens", seq_lens, "--head-dims", head_dim, "--impls",
                                                s.args.attn_impls, "--inputs", "dense,packed", "--iters", "5",
                                                "--repeats", "3"], 300)
               for head_dim, seq_lens in (group.split(":") for group in s.args.attn_grid.split())]
    worst = next((r["status"] for r in results if r["status"] != "ok"), "ok")
    return {"status": worst, "records": [rec for r in results for rec in r["records"]]}


def stage_levanter(s: Suite) -> dict:
    # (kvax is left out: it does not import under jax 0.12, whose jax.experimental.shard_map has no Specs, as the
    # H200 showed on 2026-11-27; tokamax runs, its xprof-only benchmarking imports stubbed)
    return bench_attention(s, "levanter", ["--levanter", "--impls", "flash,mosaic,cudnn_mask,cudnn_packed,tokamax",
                                           "--iters", "5", "--repeats", "3"], 90)


def stage_sweep(s: Suite) -> dict:
    args = [] if s.dry else ["--seq-lens", "8192", "--head-dims", s.args.sweep_head_dims, "--inputs", "dense,packed"]
    return bench_attention(s, "sweep", [*args, "--sweep", s.args.sweep_configs], 300)


def stage_mosaic(s: Suite) -> dict:
    """The Mosaic kernel's variants side by side (its producers' rings of 2, 3 and 4 stages; two consumers in
    ping-pong, with rings of 2 and 3; the softmax overlapped with the next QK^T, alone and in ping-pong; 128-key
    forward tiles, alone and with both) beside flash, at T = 8k, D = 128, dense and packed: which the kernel
    should default to."""
    size = [] if s.dry else ["--seq-lens", "8192", "--head-dims", "128", "--inputs", "dense,packed"]
    return bench_attention(s, "mosaic", [*size, "--impls", "flash,mosaic,mosaic_s3,mosaic_s4,mosaic_pp,mosaic_pp_s3,"
                                         "mosaic_ov,mosaic_pp_ov,mosaic_k128,mosaic_pp_ov_k128",
                                         "--iters", "5", "--repeats", "3"], 240)


def stage_throughput(s: Suite) -> dict:
    backends = ["xla"] if s.dry else s.args.backends.split(",")
    # argparse takes the options first, then the key=value overrides as one group.
    options = ["--config", PREPARED_STAGES["throughput"][0], *(["--steps", "3", "--warmup", "1"] if s.dry
                                                                else ["--steps", str(s.args.train_steps)])]
    overrides = [f"run.dir={s.out / 'runs' / 'bench_train'}", *(s.tiny_corpus() if s.dry else stage_data(s,
                                                                                                         "throughput"))]
    results, codes = {}, []
    variants = [v.split() for v in s.args.train_variants.split(";")] if s.args.train_variants else [[]]
    for backend in backends:
        for variant in variants:
            code, stdout = s.call("throughput", s.python("scripts/bench_train.py", *options, *overrides, *variant,
                                                         f"model.attention={backend}"), 150)
            codes.append(code)
            key = " ".join([backend, *variant])
            results[key] = last_json(stdout) if code == 0 else {"error": status(code)}
    worst = next((c for c in codes if c != 0), 0)
    return {"status": status(worst), "backends": results}


def train_cli(s: Suite, name: str, config: str, overrides: list[str], budget: float) -> dict:
    run_dir = s.out / "runs" / name
    argv = s.python("-m", "seqjax.train", "--config", config, f"run.dir={run_dir}", *overrides)
    code, stdout = s.call(name, argv, budget)
    summary = last_json(stdout) if code == 0 else None
    return {"status": status(code), "run_dir": str(run_dir), "summary": summary}


def stage_profile(s: Suite) -> dict:
    if s.dry:
        overrides = [*s.tiny_corpus(), "train.steps=6", "train.profile=[3,2]", "train.eval_every=0"]
    else:
        overrides = ["train.steps=30", "train.warmup_steps=10", "train.profile=[21,5]", "train.eval_every=0",
                     "train.checkpoint_every=1000", "model.attention=pallas"]
    result = train_cli(s, "profile", "configs/gpt2_small.yaml", overrides, 150)
    traces = sorted(Path(result["run_dir"], "profile").rglob("*.xplane.pb"))
    result["traces"] = [{"path": str(t.relative_to(s.out)), "bytes": t.stat().st_size} for t in traces]
    if result["status"] == "ok" and not traces:
        result["status"] = "failed (no trace written)"
    return result


def stage_recipe(s: Suite) -> dict:
    if s.dry:
        overrides = [*s.tiny_corpus(), "train.steps=4", "train.eval_every=0"]
    else:
        # To its end when the time left allows, else to the step budget that fits (minus compile and evaluation).
        fits = int((s.remaining() - s.args.recipe_overhead_s) / s.args.recipe_step_s) // 100 * 100
        steps = min(s.args.recipe_steps, fits)
        if steps < 200:
            return {"status": "skipped", "reason": f"{s.remaining():.0f} s left: too little for 200 recipe steps"}
        overrides = [f"train.steps={steps}", f"train.warmup_steps={min(200, steps // 10)}",
                     f"train.eval_every={max(steps // 4, 1)}", f"train.checkpoint_every={steps}"]
    result = train_cli(s, "recipe", "configs/wikitext2_gpu.yaml", overrides, 10_000)
    result["overrides"] = overrides
    summary = result.get("summary") or {}
    result["validation"] = {k: summary.get(k) for k in ("val_perplexity", "val_word_perplexity", "val_bits_per_byte",
                                                         "tokens_per_s", "mfu", "wall_seconds", "steps")}
    return result


NCU_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from seqjax.model.kernels.{module} import {function} as attend
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (2, 8192, 16, 128), jnp.bfloat16) for x in ks)
    s = jnp.ones((2, 8192), jnp.int32)
    f = jax.jit(lambda q, k, v: attend(q, k, v, s))
    jax.block_until_ready(f(q, k, v)); jax.block_until_ready(f(q, k, v))
""")
# Each kernel's forward as Nsight names it. The Mosaic kernel's name is its body's (not yet seen on a GPU: the
# first run should confirm the pattern, and widen it if ncu reports no kernel).
NCU_KERNELS = {"flash": ("flash", "flash_attention", "regex:seqjax_flash_forward"),
               "mosaic": ("mosaic", "mosaic_attention", "regex:body|mosaic")}


def stage_ncu(s: Suite) -> dict:
    if s.dry or not shutil.which("ncu"):
        return {"status": "skipped", "reason": "dry run" if s.dry else "ncu not on PATH"}
    reports, codes = {}, []
    for name, (module, function, pattern) in NCU_KERNELS.items():
        script = s.out / f"ncu_{name}.py"
        script.write_text(NCU_SCRIPT.replace("{module}", module).replace("{function}", function))
        argv = ["ncu", "--kernel-name", pattern, "--launch-count", "2", "--section", "SpeedOfLight",
                "--section", "Occupancy", "--section", "LaunchStats", "--section", "ComputeWorkloadAnalysis",
                "--section", "MemoryWorkloadAnalysis", sys.executable, str(script)]
        code, stdout = s.call("ncu", argv, 150)
        codes.append(code)
        (s.out / f"ncu_{name}.txt").write_text(stdout)
        reports[name] = f"ncu_{name}.txt"
    return {"status": status(next((c for c in codes if c != 0), 0)), "reports": reports}


def synthetic_answers(root: Path, records: int, seed: int = 0) -> list[str]:
    """Prompt/answer records (JSONL, ``prompt``/``completion``) of varied lengths, and the overrides that train on
    them packed best_fit_decreasing with the loss on the answers alone."""
    import random

    rng = random.Random(seed)
    if (root / "valid.jsonl").is_file():  # (written before: the same records, and a prepared cache's sources)
        return _answers_overrides(root)
    words = ("the model reads a question and writes an answer about packing rows of tokens into batches while the "
             "loss counts only what the assistant says in reply to each user turn").split()
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", records), ("valid", max(records // 10, 20))):
        with (root / f"{split}.jsonl").open("w") as f:
            for _ in range(n):
                prompt = " ".join(rng.choices(words, k=rng.randint(8, 120)))
                answer = " ".join(rng.choices(words, k=rng.choice([rng.randint(4, 60), rng.randint(100, 600)])))
                f.write(json.dumps({"prompt": prompt, "completion": answer}) + "\n")
    return _answers_overrides(root)


def _answers_overrides(root: Path) -> list[str]:
    return ["data.corpus=jsonl", "data.format=prompt_completion", "data.loss_on=completion",
            f"data.train_files=[{root / 'train.jsonl'}]", f"data.valid_files=[{root / 'valid.jsonl'}]",
            "data.strategy=pack", "data.packer=best_fit_decreasing"]


# The stages whose tokenizer and stores --prepare builds on the CPU: (config, records of synthetic answers or None
# for the config's own data, the data overrides).
# (finetune and lora8b read the same records: one tokenizer, one store. 5,000 answers are 1.3M tokens, three times
# what the timed steps read.)
PREPARED_STAGES = {
    "finetune": ("configs/llama3_1b_finetune.yaml", 5000, ["tokenizer.vocab_size=8000"]),
    "lora8b": ("configs/llama3_8b_lora.yaml", 5000, ["tokenizer.vocab_size=8000"]),
    "throughput": ("configs/gpt2_small.yaml", None, []),
}
PREPARED_DATA = ("wikitext-2", )  # (gpt2_small's; the opt-in recipe and quality stages read wikitext-2-raw too)
PREPARED_LIMIT_MB = 60  # what a device call may carry is 64 MiB


def stage_data(s: Suite, name: str) -> list[str]:
    """A stage's data overrides: its synthetic answers (written once) or the config's own, and where its
    tokenizer and stores are: the prepared folder's (built on the CPU by --prepare, reused by content), or the
    call's own cache."""
    _, records, extra = PREPARED_STAGES[name]
    if s.dry:
        records = records and 300
    data: list[str] = []
    if records:
        root = (s.prepared / "data" if s.prepared else s.out) / f"answers_{records}"
        data = synthetic_answers(root, records)
    cache = ([f"data.cache_dir={s.prepared / 'cache'}", "data.cache_identity=content"] if s.prepared
             else [f"data.cache_dir={s.out / 'cache'}"])
    return [*data, *cache, *([] if s.dry else extra)]


def stage_finetune(s: Suite) -> dict:
    """Llama-3.2-1B's shape fine-tuning on packed answers: the config's settings, then the plain loss, no remat."""
    config = PREPARED_STAGES["finetune"][0]
    data = stage_data(s, "finetune")
    if s.dry:  # toy model, toy rows; the same stages of the pipeline
        shape = [*TINY_MODEL, "model.n_kv_heads=2", "model.head_dim=16"]
        steps = ["--steps", "3", "--warmup", "1"]
    else:  # the config's own shape and rows; a tokenizer trained on the records, the 1B's vocabulary for the model
        shape = ["model.vocab_size=128256", "model.attention=" + s.args.finetune_attention]
        steps = ["--steps", str(s.args.finetune_steps)]
    variants = {"as configured": []}
    if s.args.finetune_plain:
        variants["plain loss, no remat"] = ["model.loss_chunk_tokens=0", "model.remat=none"]
    results, codes = {}, []
    for name, variant in variants.items():
        overrides = [f"run.dir={s.out / 'runs' / 'finetune'}", *data, *shape, *variant]
        code, stdout = s.call("finetune", s.python("scripts/bench_train.py", "--config", config, "--loops", "async",
                                                   *steps, *overrides), 120)
        codes.append(code)
        results[name] = last_json(stdout) if code == 0 else {"error": status(code)}
        plan_code, plan = s.call("finetune", s.python("scripts/plan_memory.py", "--config", config, *overrides), 60)
        predicted = last_json(plan) if plan_code == 0 else None
        if predicted and isinstance(results[name], dict):
            results[name]["planned_bytes_per_device"] = predicted.get("total_bytes_per_device")
    return {"status": status(next((c for c in codes if c != 0), 0)), "variants": results}


def stage_lora8b(s: Suite) -> dict:
    """Llama-3-8B's shape with LoRA r=16 on one GPU (random weights): tokens/s and peak memory beside the plan."""
    config = PREPARED_STAGES["lora8b"][0]
    data = stage_data(s, "lora8b")
    if s.dry:
        shape = [*TINY_MODEL, "model.n_kv_heads=2", "model.head_dim=16"]
        steps = ["--steps", "2", "--warmup", "1"]
    else:
        shape = ["model.attention=" + s.args.finetune_attention]
        steps = ["--steps", str(s.args.lora_steps), "--warmup", "2"]
    overrides = [f"run.dir={s.out / 'runs' / 'lora8b'}", "train.init_from=null", *data, *shape]
    plan_code, plan = s.call("lora8b", s.python("scripts/plan_memory.py", "--config", config, *overrides), 60)
    code, stdout = s.call("lora8b", s.python("scripts/bench_train.py", "--config", config, "--loops", "async", *steps,
                                             *overrides), 150)
    result = last_json(stdout) if code == 0 else None
    log = (s.out / "lora8b.log").read_text(errors="replace")
    out_of_memory = code != 0 and ("RESOURCE_EXHAUSTED" in log or "Out of memory" in log)
    return {"status": "out of memory (recorded)" if out_of_memory else status(code), "result": result,
            "planned_bytes_per_device": (last_json(plan) or {}).get("total_bytes_per_device") if plan_code == 0
            else None}


def stage_dpo(s: Suite) -> dict:
    """LoRA DPO at the 1B shape: packed, shared prompt, one pair per row and TRL's padding, on the same pairs."""
    toy = ["--shape", "toy", "--pairs", "12", "--seq-len", "128", "--prompt-median", "24", "--completion-median", "8",
           "--steps", "1"]
    size = toy if s.dry else ["--shape", "1b", "--pairs", "256", "--seq-len", "4096", "--steps", "5", "--batch", "2",
                              "--pairs-per-step", "8", "--dtype", "bfloat16"]
    code, stdout = s.call("dpo", s.python("scripts/bench_preference.py", *size), 120)
    return with_parts(s, "dpo", code, stdout)


def stage_grpo(s: Suite) -> dict:
    """GRPO's two programs at the 1B shape: a DAPO step on the same groups in each layout and TRL's padding, and
    sampling the groups (seqjax's sampler and generate; transformers' generate in the image's torch, and TRL's
    GRPOTrainer where TRL is installed)."""
    toy = ["--shape", "toy", "--prompts", "4", "--batch", "2", "--steps", "1", "--prompt-median", "16",
           "--completion-median", "8", "--max-completion", "16", "--seq-len", "256"]
    size = toy if s.dry else ["--shape", "1b", "--prompts", "16", "--batch", "4", "--steps", "4", "--dtype",
                              "bfloat16", "--max-completion", "256", "--seq-len", "2560"]
    code, stdout = s.call("grpo", s.python("scripts/bench_grpo.py", *size, "--trl-python", sys.executable), 150)
    return with_parts(s, "grpo", code, stdout)


def stage_engine(s: Suite) -> dict:
    """The generation engine (scripts/bench_engine.py) at the 1B and 8B shapes in bfloat16: 64 slots decoding 16
    prompts x 4 completions of 256 new tokens; new tokens/s against the decode's bandwidth bound (each step
    reading the weights and every slot's keys and values once), the issue's goal half of it, on the Pallas
    paged kernel (auto's pick); then at 1B the XLA gather path beside it and GRPO-like lengths (stop ids). The
    layers are stacked (--scan-layers, as the 1B and 8B recipes train them), so the decode step is one scan
    over them. A run that did not reach the GPU is recorded as failed, not as a figure."""
    if s.dry:
        sizes = {"small": ["--shape", "small", "--prompts", "2", "--generations", "2", "--prompt-median", "8",
                           "--max-new", "8", "--slots", "4", "--vocab", "256", "--hbm-gb-s", "100", "--scan-layers"]}
    else:
        common = ["--dtype", "bfloat16", "--prompts", "16", "--generations", "4", "--slots", "64",
                  "--max-new", "256", "--vocab", "128256", "--hbm-gb-s", "auto", "--scan-layers"]
        # In the order of value: every slot decoding (fixed) on the Pallas paged kernel (auto's pick on a GPU) at
        # both shapes, the goal; then the 1B shape on the XLA gather path beside it, and its GRPO-like
        # lengths (the shrinking rows: a loop body more to compile for each width).
        fixed = ["--workloads", "fixed"]
        sizes = {"1b": ["--shape", "1b", *common, *fixed], "8b": ["--shape", "8b", *common, *fixed],
                 "1b_xla": ["--shape", "1b", *common, *fixed, "--attention", "xla"],
                 "1b_grpo": ["--shape", "1b", *common, "--workloads", "grpo"]}
    result: dict[str, Any] = {}
    for name, size in sizes.items():
        code, stdout = s.call("engine", s.python("scripts/bench_engine.py", *size, "--samplers", "engine"), 110)
        result[name] = (last_json(stdout) or {"status": "failed (no summary line)"} if code == 0
                        else {"status": status(code)})
        backend = next((w["engine"].get("backend") for w in result[name].values()
                        if isinstance(w, dict) and "engine" in w), None)
        if code == 0 and not s.dry and backend != "gpu":  # (a figure from another device is no GPU figure)
            result[name] = {"status": f"failed (the engine ran on {backend}, not the GPU)"}
    result["status"] = "ok" if all("status" not in r for r in result.values()) else "failed"
    return result


def stage_gdn(s: Suite) -> dict:
    """Qwen3.5's Gated DeltaNet (scripts/bench_gdn.py) at Qwen3.5-9B's linear-layer shape in bfloat16: the
    chunked form (its scan over chunks in XLA and in the Pallas kernel: which model.deltanet.kernel=auto should
    pick) against the recurrent one and against the flash kernel's attention over the same packed rows, at
    4,096 and 16,384 tokens."""
    flags = (["--seq-lens", "64", "--heads", "4", "--key-heads", "2", "--attn-kv-heads", "2", "--attn-head-dim",
              "64", "--doc-len", "20", "--iters", "1", "--repeats", "1", "--pallas"] if s.dry else
             ["--seq-lens", "4096,16384", "--dtype", "bfloat16", "--attention", "pallas", "--doc-len", "3000",
              "--pallas"])
    jsonl = s.out / "gdn.jsonl"
    code, stdout = s.call("gdn", s.python("scripts/bench_gdn.py", *flags, f"--out={jsonl}"), 200)
    return {"status": status(code), "records": [r for r in json_lines(stdout) if "impl" in r]}


# XLA's GPU flag for cuDNN's ragged-dot fusion in place of its default rewrite of ragged_dot to a padded dense dot
# (openxla/xla#40189); an XLA that lacks the flag refuses to start, which the stage records as that run's failure.
RAGGED_DOT_CUDNN = "--xla_gpu_experimental_use_ragged_dot_fusion=true"


def stage_moe(s: Suite) -> dict:
    """One mixture-of-experts layer at Qwen3-30B-A3B's shape (8,192 tokens, 128 experts of 768, top 8, bf16):
    the dispatches side by side (scripts/bench_moe.py: ragged_dot, blocked, dense, one-hot, jax's Mosaic GPU
    ragged dot), then ragged_dot again under XLA's cuDNN ragged-dot fusion: which model.experts.dispatch=auto
    should pick on a GPU."""
    size = (["--shape", "cpu", "--tokens", "256", "--repeats", "1", "--impls", "ragged_dot,blocked,dense,onehot"]
            if s.dry else ["--shape", "qwen3_30b", "--impls", "ragged_dot,blocked,onehot,ragged_dot_mgpu"])
    code, stdout = s.call("moe", s.python("scripts/bench_moe.py", *size), 150)
    result: dict[str, Any] = {"status": status(code), "default": last_json(stdout) if code == 0 else None}
    if not s.dry:
        env = dict(s.env)
        s.env = {**env, "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} {RAGGED_DOT_CUDNN}".strip()}
        try:
            code, stdout = s.call("moe", s.python("scripts/bench_moe.py", *size[:2], "--impls", "ragged_dot"), 90)
        finally:
            s.env = env
        result["cudnn_ragged_dot"] = last_json(stdout) if code == 0 else {"status": status(code)}
    return result


def stage_quality(s: Suite) -> dict:
    """The quality run, resumed from --quality-dir on every call until it ends; then the test split's perplexity."""
    run_dir = s.args.quality_dir
    if s.dry:
        run_dir = s.out / "runs" / "quality"
        overrides = [*s.tiny_corpus(), "train.steps=4", "train.checkpoint_every=2", "train.eval_every=0"]
    else:
        overrides = []
    argv = s.python("-m", "seqjax.train", "--config", "configs/wikitext2_quality.yaml", f"run.dir={run_dir}",
                    *overrides)
    code, stdout = s.call("quality", argv, max(s.remaining() - 90, 30))
    result: dict[str, Any] = {"status": status(code), "run_dir": str(run_dir), "summary": last_json(stdout)}
    if code != 0:  # out of time: the next call resumes from the last checkpoint
        result["status"] = "continues" if code is None else result["status"]
        return result
    eval_argv = s.python("-m", "seqjax.eval", "--run", str(run_dir), f"eval.split={'valid' if s.dry else 'test'}")
    eval_code, eval_out = s.call("quality", eval_argv, max(s.remaining() - 5, 30))
    result["test"] = last_json(eval_out)
    result["status"] = status(eval_code)
    result["awd_lstm_word_perplexity"] = 65.8
    return result


def stage_study(s: Suite) -> dict:
    out = s.out / "study"
    scale = ["--quick"] if s.dry else ["--gpu", "--strategies", s.args.study_strategies, "--seeds",
                                       str(s.args.study_seeds)]
    code, stdout = s.call("study", s.python("scripts/study_strategies.py", *scale, "--out", str(out)),
                          max(s.remaining() - 5, 30))
    return {"status": status(code), "out": str(out), "result": last_json(stdout)}


def stage_vision(s: Suite) -> dict:
    """The vision tower's forward at Qwen2.5-VL-7B's shape on 8192 packed patches: the dense non-causal mask
    against the flash kernel's non-causal form (scripts/bench_vision_tower.py)."""
    size = (["--shape", "toy", "--patches", "1024", "--dtype", "float32", "--iters", "1"] if s.dry
            else ["--shape", "qwen2_5_vl_7b", "--patches", "8192", "--iters", "5"])
    code, stdout = s.call("vision", s.python("scripts/bench_vision_tower.py", *size), 120)
    return {"status": status(code), "result": last_json(stdout) if code == 0 else None}


def stage_context(s: Suite) -> dict:
    """Context parallelism on the machine's GPUs (a multi-GPU machine): the split row's attention and the real
    train step at mesh.context 1, 2, 4, 8 up to the GPU count, both ways K/V travel (scripts/bench_context.py)."""
    size = (["--seq-len", "512", "--contexts", "1,2", "--iters", "1", "--train-steps", "1", "--loss-vocab", "512",
             "--train-model", "64,2"]
            if s.dry
            else ["--seq-len", "32768", "--contexts", "1,2,4,8", "--iters", "3", "--train-steps", "3"])
    code, stdout = s.call("context", s.python("scripts/bench_context.py", *size), 240)
    return {"status": status(code), "records": json_lines(stdout)}


# Each stage's budget in seconds, from what the stages took on the H200 on 2026-11-27 (BENCHMARKS.md, "GPU"):
# setup 5.3 and env 9.3; the GPU tests 146 s with no limit; attention ran out at 70 s after the dense rows of five
# kernels; finetune finished in 54.4; lora8b, dpo and throughput ran out at 80, 50 and 50 s before measuring.
# On the H200s of 2026-11-28 and -29 attention took 66.5 and 59.1 s of its 150 while the tests were cut at 165
# s, before the compiled Mosaic, shared-prompt and delta-scan tests: 60 s moved from attention to the tests.
# From 2026-11-30 the order of value puts first what no GPU has measured (three H200s agreed within 3% on
# attention and fine-tuning): the tests no GPU has run (tests/test_gpu.py now runs them first; 180 s), the
# generation engine against the bandwidth bound and the delta-rule scan's kernel against XLA's (the figures
# the engine and Qwen3.5 issues wait for). The first call's stages, in the order of value, fit FIRST_CALL_S;
# what is left, failed or cut goes to the second call (--rerun), RERUN_CALL_S.
STAGES = {stage.name: stage for stage in (
    Stage("setup", 15, stage_setup), Stage("env", 15, stage_env), Stage("tests", 180, stage_tests),
    Stage("attention", 90, stage_attention), Stage("finetune", 70, stage_finetune),
    Stage("lora8b", 120, stage_lora8b), Stage("dpo", 90, stage_dpo), Stage("throughput", 90, stage_throughput),
    Stage("levanter", 90, stage_levanter), Stage("sweep", 150, stage_sweep), Stage("ncu", 150, stage_ncu),
    Stage("profile", 150, stage_profile), Stage("recipe", 10_000, stage_recipe),
    Stage("quality", 10_000, stage_quality), Stage("study", 10_000, stage_study), Stage("vision", 90, stage_vision),
    Stage("grpo", 150, stage_grpo), Stage("mosaic", 240, stage_mosaic), Stage("context", 240, stage_context),
    Stage("moe", 240, stage_moe), Stage("engine", 230, stage_engine), Stage("gdn", 100, stage_gdn),
)}


# ------------------------------------------------------------------------------------------------ targets


def _pick(records, **match) -> dict | None:
    return next((r for r in records if all(r.get(k) == v for k, v in match.items()) and "error" not in r), None)


def targets(summary: dict) -> list[dict]:
    """The issue's H100 targets, each with the measured figure (None when its stage did not produce it)."""
    stages = summary["stages"]
    grid = (stages.get("attention") or {}).get("records", [])
    rows: list[dict] = []

    def add(name, value, goal, ok):
        rows.append({"target": name, "measured": value, "goal": goal, "met": None if value is None else bool(ok)})

    dense = _pick(grid, impl="flash", input="dense", seq_len=8192, head_dim=128)
    add("dense causal D=128 T=8k forward TFLOP/s", dense and round(dense["fwd_tflops"], 1), ">= 450",
        dense and dense["fwd_tflops"] >= 450)
    add("dense causal D=128 T=8k fwd+bwd TFLOP/s", dense and round(dense["fwd_bwd_tflops"], 1), ">= 350",
        dense and dense["fwd_bwd_tflops"] >= 350)
    for head_dim in (128, 64):
        packed = _pick(grid, impl="flash", input="packed", seq_len=8192, head_dim=head_dim)
        if packed is None:
            continue
        for peer, goal, better in (("varlen", "<= 1.25x ideal varlen", lambda r: r <= 1.25),
                                   ("bundled", ">= 4x faster than bundled mha", lambda r: r <= 0.25),
                                   ("cudnn_mask", "faster than cuDNN + dense segment mask", lambda r: r < 1.0),
                                   ("tokamax", "no slower than tokamax", lambda r: r <= 1.0)):
            other = (_pick(grid, impl="flash", input="varlen", seq_len=8192, head_dim=head_dim) if peer == "varlen"
                     else _pick(grid, impl=peer, input="packed", seq_len=8192, head_dim=head_dim))
            for key in ("fwd_bwd_ms", "fwd_ms"):
                ratio = None if other is None else packed[key] / other[key]
                add(f"packed T=8k D={head_dim} {key}: flash / {peer}", ratio and round(ratio, 3), goal,
                    ratio is not None and better(ratio))
    for impl, goal in (("mosaic", 550.0), ("flash", 550.0)):
        run = _pick(grid, impl=impl, input="dense", seq_len=8192, head_dim=128)
        add(f"{impl} dense T=8k D=128 forward TFLOP/s vs cuDNN dense's 550", run and round(run["fwd_tflops"], 1),
            f">= {goal:.0f}", run and run["fwd_tflops"] >= goal)
        add(f"{impl} dense T=8k D=128 fwd+bwd TFLOP/s vs cuDNN dense's 509", run and round(run["fwd_bwd_tflops"], 1),
            ">= 509", run and run["fwd_bwd_tflops"] >= 509)
        packed = _pick(grid, impl=impl, input="packed", seq_len=8192, head_dim=128)
        add(f"{impl} packed T=8k D=128 fwd+bwd ms (Triton was 1.245)", packed and round(packed["fwd_bwd_ms"], 3),
            "<= 0.6", packed and packed["fwd_bwd_ms"] <= 0.6)
    backends = (stages.get("throughput") or {}).get("backends") or {}
    pallas = next((r for name, r in backends.items() if name.split()[0] == "pallas"), {})
    mfu = ((pallas.get("loops") or {}).get("async") or {}).get("mfu")
    add("gpt2_small MFU, bf16, pallas", mfu and round(mfu, 3), ">= 0.45", mfu is not None and mfu >= 0.45)
    tuned = ((stages.get("finetune") or {}).get("variants") or {}).get("as configured") or {}
    mfu = ((tuned.get("loops") or {}).get("async") or {}).get("mfu")
    add("Llama-3.2-1B fine-tuning MFU", mfu and round(mfu, 3), ">= 0.45", mfu is not None and mfu >= 0.45)
    lora = (stages.get("lora8b") or {}).get("result") or {}
    rate = ((lora.get("loops") or {}).get("async") or {}).get("tokens_per_s")
    add("Llama-3-8B LoRA r=16 tokens/s on one GPU", rate and round(rate), ">= 10000", rate is not None and rate >= 1e4)
    engine = stages.get("engine") or {}
    for shape in ("1b", "8b"):
        share = (((engine.get(shape) or {}).get("fixed") or {}).get("engine") or {}).get("share_of_bound")
        add(f"engine at {shape}, 64 slots: share of the decode's bandwidth bound", share, ">= 0.5",
            share is not None and share >= 0.5)
    scans = {r["impl"]: r for r in (stages.get("gdn") or {}).get("records", []) if r.get("seq_len") == 16384}
    ratio = (scans["gdn_pallas"]["fwd_bwd_ms"] / scans["gdn_chunked"]["fwd_bwd_ms"]
             if {"gdn_pallas", "gdn_chunked"} <= set(scans) else None)
    add("delta-rule scan fwd+bwd at 16k: Pallas / XLA", ratio and round(ratio, 3), "< 1 (auto: pallas; else xla)",
        ratio is not None and ratio < 1)
    return rows


def print_table(summary: dict) -> None:
    print("\nstage        status                 seconds")
    for name, result in summary["stages"].items():
        print(f"{name:<12} {str(result.get('status')):<22} {result.get('seconds', 0):7.1f}")
    for row in summary.get("targets", []):
        mark = {True: "met", False: "MISSED", None: "n/a"}[row["met"]]
        print(f"{mark:>6}  {row['target']}: {row['measured']} (goal {row['goal']})")


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_suite", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="folder for summary.json and the logs (created)")
    p.add_argument("--dry-run", action="store_true", help="CPU, toy sizes: checks every stage's plumbing (CI)")
    p.add_argument("--wheels", type=Path, default=REPO / ".whl", help="wheels to install with --no-deps")
    p.add_argument("--data", type=Path, default=Path(os.environ.get("SEQJAX_DATA_DIR", REPO.parent / "shared/data")),
                   help="the folder holding wikitext-2/ (default: $SEQJAX_DATA_DIR, else ../shared/data)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"the call's time limit in seconds (default {FIRST_CALL_S:.0f}; "
                        f"with --rerun {RERUN_CALL_S:.0f})")
    p.add_argument("--budgets", default="", help="name=seconds,... : stages' own budgets instead of the table's")
    p.add_argument("--rerun", type=Path, default=None, metavar="PREVIOUS_OUT",
                   help="the second call: the stages of PREVIOUS_OUT/summary.json that did not end ok (failed, cut "
                        "at their budget, skipped, or not reached), in the same order")
    p.add_argument("--prepared", type=Path, default=None, metavar="DIR",
                   help="a folder --prepare wrote (carried to the GPU machine): its wheels, data and the stages' "
                        "tokenizers and stores, reused as they are")
    p.add_argument("--prepare", type=Path, default=None, metavar="DIR",
                   help="on the CPU: write DIR for --prepared (wheels, data, the stages' tokenizers and stores, the "
                        "project at HEAD), checked below PREPARED_LIMIT_MB, and exit")
    p.add_argument("--only", default=None, help="comma-separated stages to run (default: " + ",".join(DEFAULT_STAGES)
                   + "; opt-in: " + ",".join(OPTIONAL_STAGES) + ")")
    p.add_argument("--skip", default="", help="comma-separated stages to leave out")
    p.add_argument("--attn-grid", default="128:8192",
                   help="attention stage: space-separated head_dim:T,T,... groups")
    p.add_argument("--attn-impls", default="flash,mosaic,cudnn,cudnn_packed,tokamax",
                   help="attention stage's implementations (bench_attention.py --impls; mgpu_fa3 is opt-in)")
    p.add_argument("--backends", default="pallas", help="throughput stage's attention backends")
    p.add_argument("--train-steps", type=int, default=30, help="timed steps per loop mode in the throughput stage")
    p.add_argument("--train-variants", default="model.loss_chunk_tokens=8192",
                   help="';'-separated sets of space-separated overrides; each backend runs once per set (default: "
                        "as configured, then the chunked loss)")
    p.add_argument("--finetune-steps", type=int, default=20, help="timed steps per finetune variant")
    p.add_argument("--finetune-attention", default="pallas", help="finetune and lora8b stages' model.attention")
    p.add_argument("--finetune-plain", action="store_true", help="finetune stage: also the plain loss without remat")
    p.add_argument("--lora-steps", type=int, default=5, help="timed steps of the lora8b stage")
    p.add_argument("--quality-dir", type=Path, default=Path("/tmp/seqjax_quality"),
                   help="quality stage's run.dir: outside OUT so the next call resumes it")
    p.add_argument("--study-strategies", default="concat_chunk,pack-best_fit,random_offset",
                   help="study stage's strategies (scripts/study_strategies.py's names)")
    p.add_argument("--study-seeds", type=int, default=1, help="study stage's seeds per strategy")
    p.add_argument("--sweep-configs", default="default num_stages=4 block_k=128,num_stages=2",
                   help="sweep stage: space-separated BlockSizes changes (see bench_attention.py --sweep)")
    p.add_argument("--sweep-head-dims", default="128")
    p.add_argument("--recipe-steps", type=int, default=3000, help="steps of configs/wikitext2_gpu.yaml (its end)")
    p.add_argument("--recipe-step-s", type=float, default=0.03,
                   help="seconds per recipe step, to fit the step budget to the time left (0.025 on an H100)")
    p.add_argument("--recipe-overhead-s", type=float, default=45.0,
                   help="recipe seconds besides its steps: start, compilation, validations")
    args = p.parse_args(argv)
    if args.out is None and args.prepare is None:
        p.error("--out: expected the folder for summary.json and the logs")
    if args.prepared is not None:  # its wheels and data, unless named otherwise
        args.wheels = args.wheels if args.wheels != REPO / ".whl" else args.prepared / "wheels"
        args.data = args.data if "--data" in (argv or sys.argv) else args.prepared / "data"
    if args.budget_s is None:
        args.budget_s = RERUN_CALL_S if args.rerun else FIRST_CALL_S
    try:
        args.budgets = {k: float(v) for k, v in (item.split("=") for item in args.budgets.split(",") if item)}
    except ValueError:
        p.error(f"--budgets: got {args.budgets!r}, expected name=seconds,...")
    if args.rerun is not None:  # the stages the first call planned that did not end ok, setup first again
        previous = json.loads((args.rerun / "summary.json").read_text())
        planned, ended = previous.get("planned", list(DEFAULT_STAGES)), previous["stages"]
        args.only = ",".join(["setup", *(n for n in planned
                                         if n != "setup" and (ended.get(n) or {}).get("status") != "ok")])
    names = args.only.split(",") if args.only else list(DEFAULT_STAGES)
    unknown = [n for n in names + [n for n in args.skip.split(",") if n] + list(args.budgets) if n not in STAGES]
    if unknown:
        p.error(f"unknown stage(s) {', '.join(unknown)}; expected among {', '.join(STAGES)}")
    args.stages = [n for n in names if n not in args.skip.split(",")]
    return args


# The wheels the GPU image lacks (its jax, jaxlib and CUDA plugin are 0.11.2; jax 0.12.0.1's pure-Python wheel
# runs over that jaxlib): the list that worked on the H200 on 2026-11-27 (../shared/gpu/h200-2026-11-27/README.md),
# less kvax, which does not import under jax 0.12.
WHEELS = ("jax==0.12.0.1", "flax==0.12.12", "optax==0.2.8", "orbax-checkpoint==0.12.8", "chex==0.1.92", "qwix==0.1.8",
          "grain==0.2.18", "array_record==0.8.6", "portpicker==1.6.0", "jax-triton==0.4.1",
          "tokamax==0.0.17", "einshape", "immutabledict", "pydantic==2.14.4", "pydantic-core", "annotated-types",
          "typing-inspection")


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def prepare_folder(args: argparse.Namespace) -> dict:
    """--prepare DIR, on the CPU: the wheels (pip download --no-deps), WikiText-2, each prepared stage's synthetic
    answers and its tokenizer and stores (python -m seqjax.prepare under data.cache_identity=content, so the GPU
    machine reuses them wherever the folder lands), and the project at HEAD (git archive); refused above
    PREPARED_LIMIT_MB. Nothing on the GPU then trains a tokenizer or builds a store."""
    out = args.prepare.resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.out = args.out or out / "prepare_logs"
    args.out.mkdir(parents=True, exist_ok=True)
    wheels = out / "wheels"
    if not any(wheels.glob("*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), *WHEELS],
                       check=True)
    data = out / "data"
    for name in PREPARED_DATA:
        if not (data / name).is_dir():
            shutil.copytree(args.data / name, data / name)
    args.prepared, args.dry_run = out, False
    suite = Suite(args)
    suite.env["SEQJAX_DATA_DIR"] = str(data)
    for name, (config, _, _) in PREPARED_STAGES.items():
        code, _ = suite.call(f"prepare_{name}", suite.python("-m", "seqjax.prepare", "--config", config,
                                                             *stage_data(suite, name)), 1800)
        if code != 0:
            log = suite.out / f"prepare_{name}.log"
            raise SystemExit(f"--prepare: {name}'s tokenizer and stores failed: see {log}")
    archive = out / "project.tar.gz"
    subprocess.run(["git", "archive", "--format=tar.gz", "-o", str(archive), "HEAD"], cwd=REPO, check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    parts = {p.name: folder_bytes(p) if p.is_dir() else p.stat().st_size for p in out.iterdir()
             if p.name != "prepared.json"}
    manifest = {"commit": commit, "wheels": sorted(p.name for p in wheels.glob("*.whl")), "bytes": parts,
                "total_mb": round(sum(parts.values()) / 2**20, 1), "limit_mb": PREPARED_LIMIT_MB,
                "stages": {name: stage_data(suite, name) for name in PREPARED_STAGES}}
    (out / "prepared.json").write_text(json.dumps(manifest, indent=1))
    if manifest["total_mb"] > PREPARED_LIMIT_MB:
        biggest = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
        raise SystemExit(f"--prepare: {out} holds {manifest['total_mb']} MiB, more than {PREPARED_LIMIT_MB} MiB a "
                         f"device call may carry; the largest: {biggest}")
    return manifest


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.prepare is not None:  # (on the CPU: the folder a GPU call carries, then exit)
        print(json.dumps(prepare_folder(args)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    suite = Suite(args)
    for name in args.stages:
        if suite.suite_left() < MIN_STAGE_S:
            suite.summary["stages"][name] = {"status": "skipped", "reason": "the call's time budget is spent"}
            continue
        start = time.monotonic()
        # Its own deadline, set before anything of it runs: a stage before that overran costs only itself.
        budget = args.budgets.get(name, STAGES[name].budget_s * suite.stretch)
        given = suite.begin(budget)
        print(f"[gpu_suite] {name}: {given:.0f} s ({suite.suite_left():.0f} s left in the call)", file=sys.stderr,
              flush=True)
        try:
            result = STAGES[name].run(suite)
        except Exception as err:  # noqa: BLE001  (one broken stage must not lose the others' results)
            result = {"status": f"failed ({type(err).__name__}: {err})"}
        result["seconds"], result["budget_s"] = round(time.monotonic() - start, 1), round(given, 1)
        suite.summary["stages"][name] = result
        (suite.out / "summary.json").write_text(json.dumps(suite.summary, indent=1))
    suite.stage_end = suite.deadline
    suite.summary["targets"] = targets(suite.summary)
    for row in suite.summary["targets"] if suite.dry else ():  # toy shapes on another device: no verdict
        row["met"] = None
    suite.summary["seconds"] = round(args.budget_s * suite.stretch - suite.suite_left(), 1)
    (suite.out / "summary.json").write_text(json.dumps(suite.summary, indent=1))
    print_table(suite.summary)
    failed = [n for n, r in suite.summary["stages"].items() if r.get("status") not in ("ok", "skipped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
