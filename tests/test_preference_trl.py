"""Preference training against TRL 1.16's own numbers: the same tiny Qwen3 with LoRA, the same pairs.

The references (tests/data/preference/) were made by TRL itself, from the committed script
scripts/make_preference_reference.py: a Qwen3 built by transformers (weights drawn from their names), peft's
LoRA adapters on it (drawn too, so the policy is not the reference from the start), the base alone as TRL's
``ref_model``, and pairs conversational (the official Qwen3 template, tools, multi-turn and implicit prompts) and
standard. Here seqjax reads the same model (``train.init_from``, ``train.init_adapter``; the reference is the base
with the adapters off, ``train.reference=auto``) and the same pairs (``data.format=preference``), and:

- its token store holds each pair as TRL tokenizes it;
- its per-pair log-probabilities, policy and reference, from packed rows, are TRL's;
- each objective's first-step loss and TRL's rewards/* and logps/* metrics are TRL's;
- 8 steps of LoRA DPO follow TRL's loss curve when both see the same four pairs each step.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from hf_support import script_module
from model_support import compiled_logprobs
from seqjax.config.load import load_config
from seqjax.data.pipeline import build_pipeline
from seqjax.hf import folders as hf
from seqjax.hf import peft
from seqjax.model import build_model, split_params
from seqjax.model.lora import adapters_off
from seqjax.objectives import resolve
from seqjax.objectives.base import Inputs, target_logprobs
from seqjax.objectives.preference import pair_sums
from seqjax.store.build import prepare
from seqjax.weights.adapters import read_adapter
from test_chat_ids import trl_template

DATA = Path(__file__).parent / "data"
FAMILY = script_module("make_family_references")


def reference(kind: str) -> dict:
    return json.loads((DATA / "preference" / f"{kind}.json").read_text())


def folders(ref: dict, tmp_path: Path) -> tuple[Path, Path]:
    """The reference's Qwen3 as an HF folder and its adapter as a PEFT folder."""
    base, adapter = tmp_path / "qwen3", tmp_path / "adapter"
    base.mkdir(exist_ok=True)
    adapter.mkdir(exist_ok=True)
    (base / "config.json").write_text(json.dumps(ref["config"]))
    save_file(FAMILY.reference_weights(ref["tensors"]), str(base / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DATA / "chat" / "qwen3" / name, base / name)
    s = ref["settings"]
    tensors = {k: v * s["adapter_scale"] for k, v in FAMILY.reference_weights(ref["adapter_tensors"]).items()}
    save_file(tensors, str(adapter / peft.ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (adapter / peft.ADAPTER_CONFIG).write_text(json.dumps(
        {"peft_type": "LORA", "r": s["rank"], "lora_alpha": s["alpha"], "target_modules": s["targets"]}))
    return base, adapter


def run_config(kind: str, tmp_path: Path, *extra: str, drop: tuple[str, ...] = ()):
    """The reference's model and pairs as a seqjax run (``drop``: record fields left out)."""
    ref = reference(kind)
    base, adapter = folders(ref, tmp_path)
    data = tmp_path / f"{kind}.jsonl"
    data.write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None and k not in drop}) + "\n"
                            for r in ref["records"]))
    s = ref["settings"]
    specials = [t["content"] for t in json.loads((base / "tokenizer.json").read_text())["added_tokens"]]
    config = hf.run_config(hf.read_folder(base), [
        "data.corpus=jsonl", "data.format=preference", f"data.train_files=[{data}]", f"data.cache_dir={tmp_path / 'c'}",
        f"data.chat_template={trl_template('qwen3')}", f"data.seq_len={2 * s['max_length']}", "data.shuffle=false",
        "data.strategy=pack", "data.packer=greedy", "data.max_segments_per_row=2", f"data.batch_size={s['batch']}",
        f"tokenizer.special_tokens={json.dumps(['<|im_end|>', *[t for t in specials if t != '<|im_end|>']])}",
        f"train.init_from={base}", f"train.init_adapter={adapter}", f"model.lora.rank={s['rank']}",
        f"model.lora.alpha={s['alpha']}", "model.attention=xla", f"model.max_seq_len={2 * s['max_length']}",
        f"train.beta={s['beta']}", *extra])
    return config, ref


def models(config):
    """(policy: the base with the adapter, reference: the same state with the adapters off)."""
    graphdef, _, _, rest = split_params(build_model(config, rngs=nnx.Rngs(0)))
    from seqjax.model.stacking import blocks_layout

    base = blocks_layout(hf.read_params(hf.read_folder(config.train.init_from)), stacked=config.model.scan_layers)
    adapters = read_adapter(config.train.init_adapter, config)
    policy = nnx.merge(graphdef, adapters, base, rest)
    return policy, nnx.merge(adapters_off(graphdef, adapters, base, rest), adapters, base, rest)


def first_batch(config):
    store = prepare(config, splits=("train",)).stores["train"]
    return store, {k: np.asarray(v) for k, v in next(iter(build_pipeline(config, store))).items()}


@pytest.mark.parametrize("kind", ["chat", "text", "chat_implicit", "text_implicit"])
def test_the_store_holds_each_pair_as_trl_tokenizes_it(kind, tmp_path):
    config, ref = run_config(kind, tmp_path)
    store = prepare(config, splits=("train",)).stores["train"]
    ours = [(store.doc_sequence(2 * k).tolist(), store.doc_sequence(2 * k + 1).tolist())
            for k in range(store.num_docs // 2)]
    theirs = [(t["prompt_ids"] + t["chosen_ids"], t["prompt_ids"] + t["rejected_ids"]) for t in ref["tokenized"]]
    assert len(ours) == len(ref["records"])  # every pair (TRL drops a prompt too long for max_length later)
    assert [pair for pair in ours if pair in theirs] == theirs  # TRL's, in order


@pytest.mark.parametrize("kind", [pytest.param("chat", marks=pytest.mark.slow), "text",
                                  pytest.param("chat_implicit", marks=pytest.mark.slow)])
def test_per_pair_log_probabilities_from_packed_rows_are_trls(kind, tmp_path):
    """Policy and reference (the base, adapters off), summed over each completion, as TRL computes them alone."""
    config, ref = run_config(kind, tmp_path, f"data.batch_size={len(ref_pairs(kind))}")
    policy, reference_model = models(config)
    _, batch = first_batch(config)
    scored = batch["weights"] > 0
    ours = [pair_sums(compiled_logprobs(m, batch, scored), batch) for m in (policy, reference_model)]
    (c, r), (c0, r0) = [(np.asarray(a)[:, 0], np.asarray(b)[:, 0]) for a, b in ours]
    theirs = ref["per_pair"]
    np.testing.assert_allclose(c, [p["chosen"] for p in theirs], rtol=2e-6, atol=2e-5)
    np.testing.assert_allclose(r, [p["rejected"] for p in theirs], rtol=2e-6, atol=2e-5)
    np.testing.assert_allclose(c0, [p["ref_chosen"] for p in theirs], rtol=2e-6, atol=2e-4)
    np.testing.assert_allclose(r0, [p["ref_rejected"] for p in theirs], rtol=2e-6, atol=2e-4)
    jax.clear_caches()


def ref_pairs(kind: str) -> list:
    return reference(kind)["tokenized"]


OBJECTIVES = {"sigmoid": (["dpo"], [], {}), "ipo": (["ipo"], [], {}), "hinge": (["hinge"], [], {}),
              "robust": (["robust"], [], {"label_smoothing": 0.1}), "sft": (["sft"], [], {}),
              "sigmoid+sft": (["dpo", "sft"], [1.0, 0.5], {}),
              "simpo": (["simpo"], [], {"beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0}),
              "orpo": (["sft", "odds_ratio"], [], {"beta": 0.1})}  # (the papers' forms: TRL's own trainers below)


@pytest.mark.slow  # (the fast loop keeps its cheaper twins: suite time, BENCHMARKS.md)
@pytest.mark.parametrize("kind", ["chat", "text"])
def test_every_objectives_first_step_and_metrics_are_trls(kind, tmp_path):
    """On TRL's first batch of four pairs: each objective's loss (SimPO and ORPO through TRL's CPO and ORPO loss
    functions) and TRL's rewards/* and logps/*."""
    config, ref = run_config(kind, tmp_path)
    policy, reference_model = models(config)
    _, batch = first_batch(config)
    scored = batch["weights"] > 0
    for name, (names, weights, settings) in OBJECTIVES.items():
        objective = resolve(names, weights)
        values = {"beta": config.train.beta, "label_smoothing": 0.0, "simpo_gamma": 0.5, **settings}
        inputs = Inputs(policy, None, values, objective.totals(batch),
                        lambda micro: target_logprobs(reference_model, micro, None, scored))
        terms = objective.loss(inputs, batch)
        expected = ref["step1"][name]
        loss = float(terms.loss / terms.denominator)
        assert abs(loss - expected["loss"]) < 2e-6 * max(1, abs(expected["loss"])), (name, loss, expected["loss"])
        for metric, value in expected.items():
            if metric.startswith(("rewards/", "logps/")) and metric in terms.reported:
                total, count = terms.reported[metric]
                np.testing.assert_allclose(float(total / count), value, rtol=1e-5, atol=2e-6,
                                           err_msg=f"{name} {metric}")
    jax.clear_caches()


def trainers(kind: str) -> dict:
    return json.loads((DATA / "preference" / f"trainers_{kind}.json").read_text())


TRAINERS = {"cpo": ("simpo", ["simpo_gamma", "cpo_alpha"]), "cpo_alpha0": ("simpo", ["simpo_gamma", "cpo_alpha"]),
            "orpo": ("orpo", [])}


@pytest.mark.slow  # (the fast loop keeps the per-pair log-probabilities against TRL's)
@pytest.mark.parametrize("kind", ["chat", "text"])
def test_simpo_and_orpo_are_trls_own_cpo_and_orpo_trainers(kind, tmp_path):
    """TRL 1.16's CPOTrainer (loss_type=simpo, at its default cpo_alpha 1 and the SimPO paper's 0) and ORPOTrainer,
    run on the same model and pairs: the ids they train on (an EOS after every completion, after a template's
    closing <|im_end|> too), and on their first batch the loss and every metric they log (but logits/*, which
    they average over padded positions)."""
    ref = trainers(kind)
    for name, (objective, keys) in TRAINERS.items():
        trl = ref[name]
        settings = {"beta": trl["settings"]["beta"], **{k: trl["settings"][k] for k in keys}}
        (tmp_path / name).mkdir()
        # (TRL's experimental CPO and ORPO trainers render a chat without its record's tools, where its DPOTrainer
        # and seqjax pass them: the pairs go in as they read them, tools left out)
        config, _ = run_config(kind, tmp_path / name, f"train.objective={objective}",
                               *(f"train.{k}={v}" for k, v in settings.items()), drop=("tools",))
        store, batch = first_batch(config)
        ours = [(store.doc_sequence(2 * k).tolist(), store.doc_sequence(2 * k + 1).tolist(),
                 np.asarray(store.mask[store.doc_spans()[0][2 * k]:][:len(store.doc_sequence(2 * k))]).tolist())
                for k in range(store.num_docs // 2)]
        theirs = [(t["chosen_input_ids"], t["rejected_input_ids"], [int(label != -100) for label in t["chosen_labels"]])
                  for t in trl["tokenized"]]
        assert [o[:2] for o in ours] == [t[:2] for t in theirs], name
        assert [o[2] for o in ours] == [t[2] for t in theirs], name
        policy, _ = models(config)
        objective_row = resolve([objective])
        inputs = Inputs(policy, None, {"label_smoothing": 0.0, **settings}, objective_row.totals(batch))
        terms = objective_row.loss(inputs, batch)
        assert float(terms.loss / terms.denominator) == pytest.approx(trl["loss"], rel=2e-6, abs=2e-6), name
        for metric, value in trl["metrics"].items():
            if metric.startswith("logits/") or (metric == "nll_loss" and settings.get("cpo_alpha") == 0):
                continue  # (at cpo_alpha 0 TRL skips the NLL and logs 0; seqjax logs the chosen NLL still)
            total, count = terms.reported[metric]
            np.testing.assert_allclose(float(total / count), value, rtol=1e-5, atol=2e-6, err_msg=f"{name} {metric}")
    jax.clear_caches()


@pytest.mark.slow
@pytest.mark.parametrize("reference_kind", ["auto", "precompute", "other model", "other model, precomputed"])
def test_lora_dpo_follows_trls_curve_on_the_same_pairs(reference_kind, tmp_path):
    """8 steps, four pairs a step in order, AdamW at a constant rate, clipping at 1: the per-step loss and
    rewards/margins track TRL's, with the reference run in the step (the base, adapters off) or its
    log-probabilities precomputed once (train.precompute_reference); and against a reference model that is not the
    policy's base (TRL's ref_model: the base with every weight scaled), where TRL's entropy, logits/* and
    mean_token_accuracy are checked too."""
    from seqjax.train.loop import train
    from seqjax.train.metrics import read_metrics

    ref = reference("text")  # (16 pairs: four whole batches an epoch, as TRL's dataloader serves them)
    s = ref["settings"]
    other = tmp_path / "other"
    extra = {"auto": [], "precompute": ["train.precompute_reference=true"],
             "other model": [f"train.reference={other}"],
             "other model, precomputed": [f"train.reference={other}", "train.precompute_reference=true"]}
    config, _ = run_config("text", tmp_path, "train.objective=dpo", f"train.steps={s['steps']}",
                           f"train.lr={s['lr']}", "train.warmup_steps=0", "train.min_lr_ratio=1.0",
                           "train.weight_decay=0.0", "train.b2=0.999", "train.grad_clip=1.0",
                           f"run.dir={tmp_path / 'run'}", "train.eval_every=0", "train.log_every=1",
                           "train.checkpoint_every=100", *extra[reference_kind])
    expected = ref["curve"]
    if reference_kind.startswith("other"):
        theirs = trainers("text")["dpo_other_reference"]
        base = Path(config.train.init_from)
        other.mkdir()
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(base / name, other / name)
        save_file({k: v * theirs["scale"] for k, v in FAMILY.reference_weights(ref["tensors"]).items()},
                  str(other / "model.safetensors"), metadata={"format": "pt"})
        expected = theirs["curve"]
    train(dataclasses.replace(config))
    assert (tmp_path / "run" / "reference" / "train.npz").exists() == ("precompute" in reference_kind)
    rows = [row for row in read_metrics(tmp_path / "run") if "loss" in row]
    np.testing.assert_allclose([row["loss"] for row in rows], [row["loss"] for row in expected], atol=3e-5)
    np.testing.assert_allclose([row["rewards/margins"] for row in rows],
                               [row["rewards/margins"] for row in expected], atol=3e-5)
    if reference_kind.startswith("other"):
        for name, tolerance in (("entropy", 1e-5), ("logits/chosen", 1e-6), ("logits/rejected", 1e-6),
                                ("mean_token_accuracy", 0.0)):
            np.testing.assert_allclose([row[name] for row in rows], [row[name] for row in expected],
                                       atol=tolerance, rtol=1e-5, err_msg=name)


@pytest.mark.slow
def test_the_dpo_lora_config_trains_packed_chat_pairs_evaluates_and_exports_at_a_reduced_size(tmp_path, capsys):
    """configs/qwen3_dpo_lora.yaml with the model reduced to the reference Qwen3 (shared prompt, scan, remat, chunked
    loss, LoRA with dropout): it trains on the conversational pairs, its validation and the eval command report
    TRL's metrics, and its exported adapter reads back onto the base (peft loads such folders: test_lora_peft.py)."""
    from seqjax.main import eval as eval_cli
    from seqjax.main import export
    from seqjax.weights.inference import with_adapter
    from test_train_support import REPO, assert_ok, run_cli

    ref = reference("chat")
    base, _ = folders(ref, tmp_path)
    c = ref["config"]
    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n"
                                  for r in ref["records"]))
    run = tmp_path / "run"
    # (the folder's path alone: its config.json is the model, whatever the config's 8B shape says)
    overrides = [f"run.dir={run}", f"train.init_from={base}", f"data.train_files=[{pairs_file}]",
                 f"data.valid_files=[{pairs_file}]", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=256",
                 "data.batch_size=4", f"data.chat_template={trl_template('qwen3')}", "model.max_seq_len=256",
                 "model.loss_chunk_tokens=64", "model.param_dtype=float32", "model.compute_dtype=float32",
                 "model.lora.rank=4", "model.lora.alpha=8", "train.steps=3", "train.warmup_steps=0",
                 "train.grad_accum=2", "train.eval_every=3", "train.checkpoint_every=3"]
    assert_ok(run_cli(["--config", str(REPO / "configs" / "qwen3_dpo_lora.yaml"), *overrides]))
    assert load_config(run / "config.yaml").model.d_model == c["hidden_size"]
    valid = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    assert valid and {"val_rewards/accuracies", "val_rewards/margins", "val_logps/chosen"} <= set(valid[-1])
    result = eval_cli.score(eval_cli_args(run))
    assert result["loss"] == pytest.approx(valid[-1]["val_loss"], rel=1e-5)
    assert result["pairs"] == valid[-1]["val_pairs"]
    export.main(["--run", str(run), "--out", str(tmp_path / "exported")])
    # the tokenizer and the chat template the run trained with, beside the adapter, as TRL saves them
    saved = json.loads((tmp_path / "exported" / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == trl_template("qwen3").read_text() and saved["eos_token"] == "<|im_end|>"
    assert (tmp_path / "exported" / "tokenizer.json").is_file()
    config, model = hf.load(base, ["model.attention=xla"])
    config, _ = with_adapter(config, model, str(tmp_path / "exported"))
    assert config.model.lora.rank == 4
    capsys.readouterr()


def eval_cli_args(run: Path):
    import argparse

    return argparse.Namespace(config=None, overrides=[], run=str(run), checkpoint=None, hf=None, adapter=None,
                              split=None, per_example=None)


@pytest.mark.slow
def test_a_full_dpo_run_resumes_exactly_against_its_frozen_copy(tmp_path):
    """Without LoRA the reference is a frozen copy of the starting weights (not of the resumed ones): a run cut
    at step 2 and resumed takes the uninterrupted run's steps, bit for bit. (A precomputed reference is read back
    on resume: test_precomputed_reference_log_probabilities_resume_after_a_stop_and_belong_to_one_model.)"""
    from test_train_support import assert_ok, run_cli, train_losses

    config, _ = run_config("text", tmp_path, "train.init_adapter=null", "model.lora.rank=0",
                           "train.objective=[dpo,sft]", "train.objective_weights=[1,0.5]", "train.warmup_steps=0",
                           "train.min_lr_ratio=1.0", "train.lr=1e-3", "train.checkpoint_every=2", "train.eval_every=0")
    config.save(tmp_path / "dpo.yaml")
    common = ["--config", str(tmp_path / "dpo.yaml")]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert_ok(run_cli([f"run.dir={whole}", "train.steps=4", *common]))
    assert_ok(run_cli([f"run.dir={cut}", "train.steps=2", *common]))
    assert_ok(run_cli([f"run.dir={cut}", "train.steps=4", *common]))
    assert train_losses(cut) == train_losses(whole) and len(train_losses(whole)) == 4


@pytest.mark.slow
def test_qlora_dpo_with_a_shared_prompt_takes_the_one_device_steps_on_a_mesh(tmp_path):
    """QLoRA (nf4) DPO on packed pairs with the prompt once, scanned and rematerialized: two host devices as an
    fsdp mesh, and as a context axis splitting every row (pairs summed across its shards, the shared prompt's
    mask over them), give the one-device run's losses."""
    from test_train_support import assert_ok, run_cli, train_losses

    config, _ = run_config("chat", tmp_path, "model.lora.quantize=nf4", "model.lora.quant_block=16",
                           "data.shared_prompt=true", "data.max_segments_per_row=null", "model.scan_layers=true",
                           "model.remat=full", "train.objective=dpo", "train.steps=3", "train.warmup_steps=0",
                           "train.eval_every=0", "train.checkpoint_every=100")
    config.save(tmp_path / "qlora_dpo.yaml")
    one, two = tmp_path / "one", tmp_path / "two"
    assert_ok(run_cli(["--config", str(tmp_path / "qlora_dpo.yaml"), f"run.dir={one}"]))
    assert_ok(run_cli(["--config", str(tmp_path / "qlora_dpo.yaml"), f"run.dir={two}", "mesh.data=1", "mesh.fsdp=2"],
                      devices=2))
    split = tmp_path / "context"
    assert_ok(run_cli(["--config", str(tmp_path / "qlora_dpo.yaml"), f"run.dir={split}", "mesh.data=1",
                       "mesh.context=2"], devices=2))
    a, b, c = train_losses(one), train_losses(two), train_losses(split)
    assert sorted(a) == [1, 2, 3] and all(abs(a[k] - b[k]) < 2e-5 for k in a), (a, b)
    assert sorted(c) == [1, 2, 3] and all(abs(a[k] - c[k]) < 2e-5 for k in a), (a, c)


def test_precomputed_reference_log_probabilities_resume_after_a_stop_and_belong_to_one_model(tmp_path):
    """train.reference=precompute's table: stopped after one batch (its work saved), then finished, it equals the
    table computed in one go and each pair's reference sums; read back without computing; of another model, one
    line."""
    from seqjax.core.errors import CheckpointMismatchError
    from seqjax.train.precompute import precompute, table_path

    config, ref = run_config("text", tmp_path, "data.batch_size=2", f"run.dir={tmp_path / 'run'}")
    store = prepare(config, splits=("train",)).stores["train"]
    _, reference_model = models(config)
    logprobs = jax.jit(lambda batch: target_logprobs(reference_model, batch, None, batch["weights"] > 0))
    identity = {"init_from": "qwen3", "xxh3": "1"}
    partial = precompute(config, store, "train", logprobs, identity, max_batches=1)
    assert (partial[:, 0] != 0).sum() == 2 and table_path(tmp_path / "run", "train.partial").exists()
    whole = precompute(config, store, "train", logprobs, identity)
    assert not table_path(tmp_path / "run", "train.partial").exists()
    theirs = ref["per_pair"]
    np.testing.assert_allclose(whole[:len(theirs), 0], [p["ref_chosen"] for p in theirs], rtol=2e-6, atol=2e-4)
    np.testing.assert_allclose(whole[:len(theirs), 1], [p["ref_rejected"] for p in theirs], rtol=2e-6, atol=2e-4)
    config2 = dataclasses.replace(config, run=dataclasses.replace(config.run, dir=str(tmp_path / "again")))
    np.testing.assert_array_equal(precompute(config2, store, "train", logprobs, identity), whole)

    def never(batch):
        raise AssertionError("the table is read back, not computed")

    np.testing.assert_array_equal(precompute(config, store, "train", never, identity), whole)
    with pytest.raises(CheckpointMismatchError, match="reference log-probabilities of another model than"):
        precompute(config, store, "train", never, {"init_from": "qwen3", "xxh3": "2"})
    jax.clear_caches()
