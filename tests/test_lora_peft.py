"""seqjax reads peft's LoRA adapters and computes what peft computes, on every family seqjax loads, and on
peft's variants: rsLoRA, DoRA, modules_to_save (tied and untied), target_modules as regex, all-linear and names.

The references (tests/data/lora/) were made by peft itself (scripts/make_lora_reference.py): each family's
reference base with adapters on q, k, v, o, gate, up and down, r = 4, lora_alpha = 8, every adapter tensor drawn
from its name (so B is not 0), and one base per variant. Here the base and the adapters are rebuilt from the
names, read by seqjax as an HF folder and a PEFT folder (train.init_adapter's and --adapter's reader), and
seqjax's logits are compared with peft's. Where torch and peft import, seqjax's exported adapter is also loaded
by peft live.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from hf_support import script_module
from seqjax.core.errors import CheckpointError, ConfigError
from seqjax.hf import folders as hf
from seqjax.hf import peft
from seqjax.model import build_model, split_params
from seqjax.model.stacking import blocks_layout
from seqjax.weights.adapters import read_adapter
from seqjax.weights.inference import with_adapter
from seqjax.weights.init_from import read_source
from test_families import FAMILIES, SCRIPT, assert_close, hf_folder, logits

REFERENCES = Path(__file__).parent / "data" / "lora"
LORA_SCRIPT = script_module("make_lora_reference")
VARIANTS = list(LORA_SCRIPT.VARIANTS)


def peft_folder(name: str, folder: Path) -> Path:
    """Reference ``name``'s adapter as a PEFT folder: peft's adapter_config.json, the tensors drawn from
    their names."""
    record = json.loads((REFERENCES / f"{name}.json").read_text())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / peft.ADAPTER_CONFIG).write_text(json.dumps(record["adapter_config"]))
    tied = SCRIPT.FAMILIES[record["family"]][1].get("tie_word_embeddings", False)
    save_file(LORA_SCRIPT.adapter_tensors(record["tensors"], tied), str(folder / peft.ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    return folder


def with_peft_adapter(name: str, tmp_path: Path, *overrides: str):
    """The reference base of ``name`` as an HF folder with its adapter put on by --adapter's reader."""
    family = json.loads((REFERENCES / f"{name}.json").read_text())["family"]
    config, model = hf.load(hf_folder(family, tmp_path / family), ["model.attention=xla", *overrides])
    return with_adapter(config, model, str(peft_folder(name, tmp_path / f"{name}_adapter")))


def lora_model(family: str, tmp_path: Path, *overrides: str):
    """The family's reference base with peft's adapters, as seqjax builds it from the two folders."""
    folder = hf.read_folder(hf_folder(family, tmp_path / family))
    adapter = peft_folder(family, tmp_path / f"{family}_adapter")
    config = hf.run_config(folder, ["model.attention=xla", "model.lora.rank=4", "model.lora.alpha=8", *overrides])
    graphdef, _, _, rest = split_params(build_model(config, rngs=nnx.Rngs(0)))
    base = blocks_layout(hf.read_params(folder), stacked=config.model.scan_layers)
    return nnx.merge(graphdef, read_adapter(str(adapter), config), base, rest), folder, adapter


@pytest.mark.parametrize("family", [f if f == "llama" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])  # the fast loop: Llama; the full suite: every family
def test_seqjax_with_pefts_adapter_computes_pefts_logits(family, tmp_path):
    model, _, _ = lora_model(family, tmp_path)
    ref = load_file(str(REFERENCES / f"{family}.safetensors"))
    assert_close(logits(model, ref["seq0.ids"]), ref["seq0.logits"])
    jax.clear_caches()


@pytest.mark.slow
def test_scanned_layers_read_the_same_adapter(tmp_path):
    model, _, _ = lora_model("gemma3", tmp_path, "model.scan_layers=true")
    ref = load_file(str(REFERENCES / "gemma3.safetensors"))
    assert_close(logits(model, ref["seq0.ids"]), ref["seq0.logits"])
    jax.clear_caches()


@pytest.mark.parametrize("name", [v if v in ("qwen2-dora", "gemma3-save") else pytest.param(v, marks=pytest.mark.slow)
                                  for v in VARIANTS])
def test_pefts_variants_compute_pefts_logits(name, tmp_path):
    """rsLoRA, DoRA (with Qwen2's biases, unscaled), modules_to_save on tied and untied embeddings, and
    target_modules as peft saved them (a regex, all-linear's choice, names)."""
    config, model = with_peft_adapter(name, tmp_path)
    settings = json.loads((REFERENCES / f"{name}.json").read_text())["adapter_config"]
    lora = config.model.lora
    assert (lora.rslora, lora.dora) == (settings["use_rslora"], settings["use_dora"])
    assert bool(lora.modules_to_save) == bool(settings["modules_to_save"])
    ref = load_file(str(REFERENCES / f"{name}.safetensors"))
    assert_close(logits(model, ref["seq0.ids"]), ref["seq0.logits"])
    jax.clear_caches()


@pytest.mark.slow
def test_a_scanned_dora_model_reads_the_same_adapter(tmp_path):
    _, model = with_peft_adapter("qwen2-dora", tmp_path, "model.scan_layers=true")
    ref = load_file(str(REFERENCES / "qwen2-dora.safetensors"))
    assert_close(logits(model, ref["seq0.ids"]), ref["seq0.logits"])
    jax.clear_caches()


@pytest.mark.parametrize("name", ["qwen2-dora", pytest.param("llama-save", marks=pytest.mark.slow)])
def test_an_exported_variant_reads_back_to_the_same_tensors_and_config(name, tmp_path):
    """seqjax's export of a DoRA / modules_to_save adapter holds peft's tensors, and says what peft said."""
    config, model = with_peft_adapter(name, tmp_path)
    theirs = load_file(str(tmp_path / f"{name}_adapter" / peft.ADAPTER_WEIGHTS))
    from seqjax.model.lora import trained_filter

    ours = peft.to_peft(nnx.to_pure_dict(nnx.state(model, trained_filter(config.model.lora))), config.model)
    assert sorted(ours) == sorted(theirs)
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key])
    written = peft.adapter_config(config.model, "base")
    back = peft.lora_from_adapter_config(written, "adapter_config.json", config.model)
    assert back == config.model.lora


PEFT_INITS = json.loads((REFERENCES / "init.json").read_text())["init_lora_weights"]


@pytest.mark.parametrize("init, peft_name", [("peft", "true"), ("gaussian", "gaussian")])
def test_a_new_adapters_a_is_drawn_as_peft_draws_it(init, peft_name):
    """model.lora.init=peft bounds A by 1/sqrt(inputs) with peft's spread; gaussian has std 1/r: both match the
    statistics of the A matrices peft drew on the same shapes; flax's he_uniform is sqrt(6) times wider."""
    from seqjax.config.load import load_config
    from seqjax.model import build_model

    ref = SCRIPT.FAMILIES["llama"][1]
    shape = [f"model.d_model={SCRIPT.COMMON['hidden_size']}", f"model.d_ff={SCRIPT.COMMON['intermediate_size']}",
             "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2", f"model.head_dim={ref['head_dim']}",
             "model.vocab_size=64", "model.lora.rank=8", "model.lora.alpha=16"]

    def spread(kind):
        model = build_model(load_config(None, [*shape, f"model.lora.init={kind}"]), rngs=nnx.Rngs(0))
        by_width = {}
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
            if path[-1] == "lora_a":
                by_width.setdefault(str(v.shape[0]), []).append(np.asarray(v[...]).ravel())
        return {w: np.concatenate(a) for w, a in by_width.items()}

    ours, flax_a = spread(init), spread("flax")
    for width, theirs in PEFT_INITS[peft_name].items():
        a = ours[width]
        assert a.size == theirs["n"]
        assert abs(a.std() / theirs["std"] - 1) < 0.08, (width, a.std(), theirs["std"])
        if init == "peft":
            assert np.abs(a).max() <= 1 / np.sqrt(int(width)) and np.abs(a).max() > 0.95 * theirs["max_abs"]
            assert flax_a[width].std() / theirs["std"] > 2.2  # the setting matters


def adapter_error(config, tmp_path, *, tensors=None, raw=None):
    """The one-line error reading a llama adapter folder whose config (or whole file) is replaced."""
    folder = peft_folder("llama", tmp_path / "bad")
    if raw is not None:
        (folder / peft.ADAPTER_CONFIG).write_text(raw)
    elif config is not None:
        (folder / peft.ADAPTER_CONFIG).write_text(json.dumps(config))
    if tensors is not None:
        tensors(folder / peft.ADAPTER_WEIGHTS)
    base_config, base = hf.load(hf_folder("llama", tmp_path / "llama"), ["model.attention=xla"])
    with pytest.raises((CheckpointError, ConfigError)) as err:
        with_adapter(base_config, base, str(folder))
    return str(err.value)


def test_every_peft_setting_seqjax_cannot_compute_is_refused_naming_it(tmp_path):
    """aLoRA, rank_pattern, lora_bias, a layer subset, LoRA on the head, a base-rewriting init: each refused
    naming its field, never read as plain LoRA; and so is every malformed config, in one line."""
    good = json.loads((REFERENCES / "llama.json").read_text())["adapter_config"]
    cases = {
        "alora_invocation_tokens: got [5, 6]": {"alora_invocation_tokens": [5, 6]},
        "rank_pattern: got {'q_proj': 8}": {"rank_pattern": {"q_proj": 8}},
        "lora_bias: got True": {"lora_bias": True},
        "use_qalora: got True": {"use_qalora": True},
        "trainable_token_indices": {"trainable_token_indices": [3]},
        "layers_to_transform: got [0]": {"layers_to_transform": [0]},
        "selects self_attn.q_proj in layers [0] of 3": {"target_modules": ["model.layers.0.self_attn.q_proj"]},
        "target_modules: selects lm_head": {"target_modules": ["q_proj", "lm_head"]},
        "init_lora_weights: got 'pissa'": {"init_lora_weights": "pissa"},
        "r: got 'eight', expected a positive integer": {"r": "eight"},
        "r: got None": {"r": None},
        "target_modules: got 7": {"target_modules": 7},
        "peft_type: got 'LOHA'": {"peft_type": "LOHA"},
        "modules_to_save: got 'score'": {"modules_to_save": ["score"]},
    }
    for expected, change in cases.items():
        message = adapter_error({**good, **change}, tmp_path)
        assert expected in message and "not valid JSON" not in message and "\n" not in message, (expected, message)
    assert "got a JSON list, expected an object" in adapter_error(None, tmp_path, raw="[1, 2]")
    assert "not valid JSON" in adapter_error(None, tmp_path, raw="{r: 4")

    def truncate(path):
        path.write_bytes(path.read_bytes()[:100])

    assert "unreadable as safetensors" in adapter_error(None, tmp_path, tensors=truncate)

    def other_width(path):  # an adapter of a wider base
        tensors = load_file(str(path))
        save_file({k: np.zeros((v.shape[0], 2 * v.shape[1]), v.dtype) if "lora_A" in k else v
                   for k, v in tensors.items()}, str(path))

    message = adapter_error(None, tmp_path, tensors=other_width)
    assert "has shape [4, 64], expected [4, 32]" in message and "another base or rank" in message


def test_target_modules_as_peft_stores_them_select_the_same_projections():
    """Names, full module paths of every layer, all-linear and regular expressions, less exclude_modules."""
    from seqjax.config.load import load_config
    from seqjax.hf.folders import read_folder  # noqa: F401  (the base's shape only)

    cfg = load_config(None, ["model.n_layers=2"]).model
    base = {"peft_type": "LORA", "r": 4, "lora_alpha": 8}
    cases = [
        (["q_proj", "v_proj"], None, ["q", "v"]),
        ([f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.k_proj", "mlp.up_proj")], None, ["k", "up"]),
        ("all-linear", None, ["q", "k", "v", "o", "gate", "up", "down"]),
        ("all-linear", ["down_proj"], ["q", "k", "v", "o", "gate", "up"]),
        (r".*\.(q_proj|o_proj)", None, ["q", "o"]),
        (r".*self_attn.*", None, ["q", "k", "v", "o"]),
        (r"model\.layers\.\d+\.mlp\.(gate|up)_proj", r".*up_proj", ["gate"]),
    ]
    for targets, excluded, expected in cases:
        lora = peft.lora_from_adapter_config({**base, "target_modules": targets, "exclude_modules": excluded},
                                             "adapter_config.json", cfg)
        assert lora.targets == expected, (targets, excluded)


def test_model_lora_accepts_pefts_names():
    from seqjax.config.load import load_config

    lora = load_config(None, ["model.lora.rank=4", "model.lora.targets=[q_proj,v,down_proj]",
                              "model.lora.modules_to_save=[embed_tokens]"]).model.lora
    assert lora.targets == ["q", "v", "down"] and lora.modules_to_save == ["embed"]
    with pytest.raises(ConfigError, match=r"model.lora.targets: got 'qproj', expected names from"):
        load_config(None, ["model.lora.rank=4", "model.lora.targets=[qproj]"])
    with pytest.raises(ConfigError, match="model.lora.modules_to_save: got 'head' with model.tie_embeddings true"):
        load_config(None, ["model.lora.rank=4", "model.lora.modules_to_save=[lm_head]"])


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen2-dora", "gemma3-save", "llama-rslora"])
def test_peft_loads_seqjaxs_exported_adapter_onto_the_hf_base_with_equal_logits(name, tmp_path):
    """Live, where torch and peft import."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft_lib = pytest.importorskip("peft")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers >= 5 has these families in PyTorch")
    from seqjax.model.lora import trained_filter

    config, model = with_peft_adapter(name, tmp_path)
    family = json.loads((REFERENCES / f"{name}.json").read_text())["family"]
    out = tmp_path / "exported"
    out.mkdir()
    tensors = peft.to_peft(nnx.to_pure_dict(nnx.state(model, trained_filter(model.cfg.lora))), model.cfg)
    save_file(tensors, str(out / peft.ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / peft.ADAPTER_CONFIG).write_text(json.dumps(peft.adapter_config(model.cfg, None)))
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / family, attn_implementation="eager")
    theirs = peft_lib.PeftModel.from_pretrained(base, out).eval()
    ids = load_file(str(REFERENCES / f"{name}.safetensors"))["seq0.ids"]
    with torch.no_grad():
        expected = theirs(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    assert_close(logits(model, ids), expected)


def test_an_adapter_holding_a_nan_is_one_line_naming_the_file_and_the_tensor(tmp_path):
    """eval --adapter scored a NaN adapter as a null loss, and training blamed the learning rate: the adapter's
    file and tensor are named when it is read, for every reader (--adapter, train.init_adapter)."""
    from safetensors.numpy import load_file

    from seqjax.core.errors import CheckpointError
    from seqjax.weights.adapters import peft_folder as read_peft

    folder = peft_folder("llama", tmp_path / "adapter")
    tensors = load_file(str(folder / peft.ADAPTER_WEIGHTS))
    name = sorted(tensors)[3]
    tensors[name] = tensors[name].copy()
    tensors[name].reshape(-1)[5] = np.nan
    save_file(tensors, str(folder / peft.ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config, _ = hf.load(hf_folder("llama", tmp_path / "llama"), ["model.attention=xla"])
    with pytest.raises(CheckpointError, match=rf"adapter/adapter_model.safetensors: tensor {re.escape(name)} holds 1 "
                                              r"non-finite value"):
        read_peft(str(folder), "--adapter", config.model)


def test_a_peft_folder_given_as_init_from_points_at_init_adapter(tmp_path):
    """A PEFT adapter folder holds no model: train.init_from refuses it in one line naming the key that reads it."""
    peft_folder("llama", tmp_path / "adapter")
    with pytest.raises(ConfigError, match=r"train.init_from: .*adapter is a PEFT adapter folder \(adapter_config.json"
                                          r"\), not a model; set train.init_adapter=.*adapter for its adapters"):
        read_source(str(tmp_path / "adapter"))


@pytest.mark.slow  # (the fast loop keeps its cheaper twins: suite time, BENCHMARKS.md)
def test_generate_runs_on_a_base_plus_a_peft_adapter_folder_with_no_training_step(tmp_path, capsys):
    """generate --hf BASE --adapter PEFT_DIR: the adapter's own settings (here DoRA on all-linear) on the base,
    read as --adapter's reader reads it; without --adapter the base alone answers otherwise."""
    from seqjax.engine import generate
    from seqjax.main.generate import main

    folder = hf_folder("qwen2", tmp_path / "qwen2")
    adapter = peft_folder("qwen2-dora", tmp_path / "adapter")
    common = ["--hf", str(folder), "--prompt", "the cat", "--temperature", "0", "--max-new-tokens", "6",
              "model.attention=xla"]
    main([*common, "--adapter", str(adapter)])
    with_it = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["samples"][0]["token_ids"]
    main(common)
    without = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["samples"][0]["token_ids"]
    config, model = with_peft_adapter("qwen2-dora", tmp_path / "direct")
    assert config.model.lora.dora
    from seqjax.store.build import prepare

    tokenizer = prepare(config, splits=()).tokenizer
    (expected,) = generate(model, [tokenizer.opened(tokenizer.encode("the cat"))], eot_id=[tokenizer.eot_id],
                           max_new_tokens=6)
    assert with_it == expected.tokens[:len(with_it)] and with_it != without
    jax.clear_caches()


def test_an_exported_adapter_names_the_hf_folder_its_base_was_imported_from(tmp_path, monkeypatch):
    """train.init_from=<an imported run>: adapter_config.json names the HF folder the import read (peft loads it),
    or, once that folder is gone, the hub id its config.json recorded; a base from no HF model gets null and a
    line saying so."""
    from types import SimpleNamespace

    from seqjax.config.load import load_config
    from seqjax.main import export
    from seqjax.main.import_hf import main as import_main

    folder = hf_folder("llama", tmp_path / "llama")
    config_json = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config_json, "_name_or_path": "someone/tiny-llama"}))
    import_main([str(folder), "--out", str(tmp_path / "imported")])
    args = SimpleNamespace(hf=None)

    def base_of(init_from):
        return export._peft_base(args, load_config(None, [f"train.init_from={init_from}"]))

    assert base_of(tmp_path / "imported") == str(folder.resolve())
    assert base_of(folder) == str(folder.resolve())
    folder.rename(tmp_path / "gone")
    assert base_of(tmp_path / "imported") == "someone/tiny-llama"
    (tmp_path / "plain" / "checkpoints").mkdir(parents=True)  # a run with no record of an HF folder
    said = []
    monkeypatch.setattr(export.log, "warning", lambda message, *args: said.append(message % args))
    assert base_of(tmp_path / "plain") is None
    assert len(said) == 1 and "base_model_name_or_path is null" in said[0]
