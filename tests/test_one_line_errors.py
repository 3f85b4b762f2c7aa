"""Bad input that once ended in a traceback is one line naming the file, key or flag, and what was expected."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from seqjax.config.load import load_config
from seqjax.config.tree import ConfigError
from test_train_support import REPO, cli_env


def one_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    assert proc.returncode == code, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = [line for line in proc.stderr.splitlines() if "error" in line or "interrupted" in line]
    return line


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("content", [
    "# caf\xe9 au lait\ndata:\n  seq_len: 64\n".encode("latin-1"),  # latin-1 bytes in a comment
    "data:\n  seq_len: 64\n".encode("utf-16"),  # UTF-16 with its byte-order mark
])
def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path, content):
    (tmp_path / "c.yaml").write_bytes(content)
    with pytest.raises(ConfigError, match=r"c.yaml': byte \d+ \(0x[0-9a-f]{2}\) is not UTF-8; expected a UTF-8 YAML"):
        load_config(tmp_path / "c.yaml")


def test_a_utf8_config_with_a_byte_order_mark_loads(tmp_path):
    (tmp_path / "c.yaml").write_bytes("data:\n  seq_len: 64\n".encode("utf-8-sig"))
    assert load_config(tmp_path / "c.yaml").data.seq_len == 64


@pytest.mark.slow  # fast loop: covered there by the cheaper tests beside it
def test_plan_memory_takes_the_tokenizers_vocabulary_when_the_model_leaves_it_null():
    proc = run("scripts/plan_memory.py", "--config", "configs/wikitext2_cpu.yaml", "model.n_layers=1",
               timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    vocab = load_config(REPO / "configs/wikitext2_cpu.yaml").tokenizer.vocab_size
    assert '"parameters": ' in proc.stdout and vocab > 0
    bad = run("scripts/plan_memory.py", "--config", "configs/wikitext2_cpu.yaml", "tokenizer.path=nope.json")
    assert "tokenizer.path: 'nope.json' is not a readable tokenizer.json" in one_line(bad)


@pytest.mark.parametrize("flags, message", [
    (["--batches", "-1"], "--batches: got -1, expected at least 1"),
    (["--steps", "0"], "--steps: got 0, expected at least 1"),
    (["--dump", "batches_folder"], "--dump batches_folder: expected a file name ending in .npz"),
])
def test_the_data_report_refuses_bad_flags_in_one_line(tmp_path, flags, message):
    proc = run("-m", "seqjax.data", "--config", "configs/wikitext2_cpu.yaml", *flags)
    assert message in one_line(proc)
    assert not (REPO / "batches_folder.npz").exists()


def test_cudnn_on_a_machine_without_a_gpu_is_one_line_before_any_work(tmp_path):
    proc = run("-m", "seqjax.train", "--config", "configs/wikitext2_cpu.yaml", "model.attention=cudnn",
               f"run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}")
    assert "model.attention: got 'cudnn', which needs an NVIDIA GPU" in one_line(proc)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


def test_ctrl_c_is_one_line_and_exit_code_130(monkeypatch, capsys):
    from seqjax.main import prepare

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare, "prepare", interrupted)
    import signal

    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as exit_:
            prepare.main(["--config", "configs/wikitext2_cpu.yaml"])
        # a second Ctrl-C while the interpreter shuts down (atexit callbacks) is ignored, not a printed traceback
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
    assert exit_.value.code == 130
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C): stopped" in err and "Traceback" not in err


@pytest.mark.slow  # a trained tiny run, copied and damaged
def test_init_from_a_run_whose_checkpoint_data_is_truncated_is_one_line(reference, tiny_root, tmp_path):
    """The fault campaign saw 'RuntimeError: Event loop is closed' and its traceback after the one line: orbax's
    orphaned reads of the damaged files. Every step's array data cut short: each is reported unreadable, then
    one error line, exit 2, and no traceback at all."""
    import shutil

    from test_train_support import tiny_overrides

    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_root / "reference", damaged)
    cut = [f for f in (damaged / "checkpoints").rglob("*") if f.is_file() and "/params/" in str(f)
           and f.parent.name == "d"]
    assert cut
    for f in cut:
        f.write_bytes(f.read_bytes()[:50])
    proc = run("-m", "seqjax.train", *tiny_overrides(tiny_root, tmp_path / "run", **{
        "train.init_from": damaged, "train.steps": 2}), timeout=240)
    line = one_line(proc)
    assert f"no readable checkpoint in {damaged / 'checkpoints'}" in line
    assert "Event loop is closed" not in proc.stderr


def test_a_read_callback_after_orbax_closed_its_loop_prints_nothing_but_other_errors_still_print():
    """The hook is in place before a checkpoint read (the CI run caught a callback firing mid-read, before the
    failure was handled): a closed loop's RuntimeError from asyncio is dropped, anything else still prints."""
    script = """
import asyncio, sys
from seqjax.weights.orbax_quiet import quiet_orphaned_reads
quiet_orphaned_reads()
loop = asyncio.new_event_loop(); loop.close()
try:
    loop.call_soon_threadsafe(print)  # what TensorStore's done-callback does once orbax closed its loop
except RuntimeError:
    sys.excepthook(*sys.exc_info())  # how a callback fired from C++ is reported (PyErr_Print)
try:
    raise RuntimeError("a real failure")
except RuntimeError:
    sys.excepthook(*sys.exc_info())
"""
    proc = run("-c", script)
    assert "Event loop is closed" not in proc.stderr, proc.stderr
    assert proc.stderr.count("Traceback") == 1 and "a real failure" in proc.stderr, proc.stderr


@pytest.mark.parametrize("name, content", [
    ("template.jinja", "{# caf\xe9 #}{{ messages[0].content }}".encode("latin-1")),
    ("tokenizer_config.json", '{"chat_template": "caf\xe9"}'.encode("latin-1")),
])
def test_every_file_seqjax_reads_that_is_not_utf8_is_one_line_naming_it(tmp_path, name, content):
    """Issue: a latin-1 data.chat_template file ended in a UnicodeDecodeError traceback."""
    from seqjax.core.errors import CorpusError
    from seqjax.store.chat import chat_template

    (tmp_path / name).write_bytes(content)
    with pytest.raises(CorpusError, match=rf"{name}: byte \d+ \(0x[0-9a-f]{{2}}\) is not UTF-8; expected a UTF-8"):
        if name.endswith(".jinja"):
            chat_template(str(tmp_path / name), None)
        else:
            chat_template(None, tmp_path / "tokenizer.json")


@pytest.mark.parametrize("field, value, message", [
    ("rope_scaling", "linear", "rope_scaling: got 'linear', expected a mapping with rope_type (or type) and factor"),
    ("max_position_embeddings", None, "max_position_embeddings: got None, expected a positive integer"),
    ("num_hidden_layers", "2", "num_hidden_layers: got '2', expected a positive integer"),
])
def test_a_config_json_with_a_field_of_the_wrong_kind_is_one_line_at_import(field, value, message):
    """Issue: rope_scaling as a string and max_position_embeddings: null ended in tracebacks at import."""
    from seqjax.core.errors import CheckpointError
    from seqjax.hf.families import model_config_from_hf

    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 64}
    with pytest.raises(CheckpointError, match=re.escape(f"config.json: {message}")):
        model_config_from_hf({**config, field: value}, "config.json")
