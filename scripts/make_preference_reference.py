"""Reference numbers of TRL 1.16's own preference training, on a tiny Qwen3 with LoRA, made by TRL itself.

    python scripts/make_preference_reference.py --out tests/data/preference   # needs torch, transformers 5, peft, TRL

The model is a Qwen3 built by transformers from a small config (weights drawn from their names, as
scripts/make_family_references.py draws them) with the tokenizer and official template of
tests/data/chat/qwen3, and peft's LoRA on all seven projections, its tensors drawn from their names too (so the
adapters matter from the first step). TRL's DPOTrainer gets that PeftModel and, as ``ref_model``, the base model
alone: what seqjax's ``model.lora`` with ``train.reference=auto`` compares with (the base, adapters off).

Two datasets of preference pairs (``pairs()``): conversational ones through the Qwen3 template (tools on some,
implicit prompts on some, multi-turn prompts) and standard text ones. For each it writes ``<name>.json``:

- ``records``: the pairs as TRL read them, and ``tokenized``: TRL's prompt_ids, chosen_ids and rejected_ids;
- ``per_pair``: each pair alone through ``DPOTrainer.compute_loss``: the policy's and the reference's summed
  log-probabilities of the completions (TRL's logps/chosen and logps/chosen - rewards/chosen / beta);
- ``step1``: for every loss type TRL's DPOTrainer has (sigmoid, ipo, hinge, robust with label_smoothing 0.1,
  sft, and ``["sigmoid", "sft"]`` weighted ``[1, 0.5]``), the loss and TRL's rewards/* and logps/* on the first
  batch of four pairs; SimPO and ORPO (their trainers' own ``cpo_loss`` and ``odds_ratio_loss``, TRL's
  experimental CPO and ORPO, on the same log-probabilities);
- ``curve``: TRL's loss and metrics over ``STEPS`` sigmoid steps of LoRA training, four pairs a step in order
  (AdamW, constant learning rate, no weight decay, gradient clipping at 1).

tests/test_preference_trl.py rebuilds the model and reads the same pairs with seqjax, and compares.

    python scripts/make_preference_reference.py --trainers --datasets chat text

writes ``trainers_<kind>.json`` (:func:`trainers`): TRL's own CPO and ORPO trainers, and DPO against a reference
model that is not the policy's base.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CHAT = REPO / "tests" / "data" / "chat" / "qwen3"
RANK, ALPHA, BETA, LR, STEPS, BATCH, MAX_LENGTH = 4, 8, 0.1, 1e-3, 8, 4, 96
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WORDS = "the cat sat on a mat while dog ran far away to big small red blue green house tree river stone".split()
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather in a town",
                                           "parameters": {"type": "object", "properties": {"town": {"type": "string"}},
                                                          "required": ["town"]}}}]
LOSSES = {"sigmoid": (["sigmoid"], None, 0.0), "ipo": (["ipo"], None, 0.0), "hinge": (["hinge"], None, 0.0),
          "robust": (["robust"], None, 0.1), "sft": (["sft"], None, 0.0),
          "sigmoid+sft": (["sigmoid", "sft"], [1.0, 0.5], 0.0)}


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_config() -> dict:
    """The Qwen3 config: the families script's Qwen3 settings, sized to the chat tokenizer."""
    refs = _script("make_family_references")
    vocab = json.loads((CHAT / "tokenizer.json").read_text())
    size = max([*vocab["model"]["vocab"].values(), *(t["id"] for t in vocab["added_tokens"])]) + 1
    settings = {**refs.FAMILIES["qwen3"][1], "use_sliding_window": False, "tie_word_embeddings": False}
    return {**refs.COMMON, **settings, "vocab_size": size, "bos_token_id": None, "eos_token_id": 2, "pad_token_id": 0}


def sentence(rng, n) -> str:
    return " ".join(rng.choice(WORDS, n))


def pairs(kind: str, n: int = 16, seed: int = 0) -> list[dict]:
    """``n`` pairs of uneven lengths: conversational (``chat``: tools on some, multi-turn prompts on some) or
    standard (``text``); ``*_implicit``: the same with the prompt left inside chosen and rejected."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if kind.startswith("text"):
            prompt = "Q: " + sentence(rng, int(rng.integers(2, 14))) + " A:"
            chosen = " " + sentence(rng, int(rng.integers(1, 9)))
            rejected = " " + sentence(rng, int(rng.integers(1, 9)))
        else:
            prompt = [{"role": "user", "content": sentence(rng, int(rng.integers(2, 10)))}]
            if i % 3 == 1:  # a multi-turn prompt
                prompt = [{"role": "system", "content": sentence(rng, 4)}, *prompt,
                          {"role": "assistant", "content": sentence(rng, 3)},
                          {"role": "user", "content": sentence(rng, int(rng.integers(2, 6)))}]
            chosen = [{"role": "assistant", "content": sentence(rng, int(rng.integers(1, 10)))}]
            rejected = [{"role": "assistant", "content": sentence(rng, int(rng.integers(1, 10)))}]
        record = ({"chosen": prompt + chosen, "rejected": prompt + rejected} if kind.endswith("implicit") else
                  {"prompt": prompt, "chosen": chosen, "rejected": rejected})
        if kind.startswith("chat"):
            record["tools"] = TOOLS if i % 5 == 2 else None
        out.append(record)
    return out


def tensor_shapes() -> dict[str, list[int]]:
    """The base's tensors and shapes, as transformers names them (its weights are drawn from these)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**model_config()))
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def adapter_shapes() -> dict[str, list[int]]:
    """The adapter's tensors as peft saves them (drawn from these names, times adapter_scale)."""
    policy, _, _ = build(CHAT)
    return {k.replace(".default.", "."): list(v.shape) for k, v in policy.state_dict().items() if "lora_" in k}


def build(tokenizer_dir: Path):
    """(the PeftModel with its drawn adapters, the base alone, the tokenizer)."""
    import peft
    import torch
    import transformers

    refs = _script("make_family_references")
    config = transformers.Qwen3Config(**model_config())

    def base():
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
        model.load_state_dict({k: torch.from_numpy(v) for k, v in refs.reference_weights(shapes).items()})
        return model

    policy = peft.get_peft_model(base(), peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS,
                                                          lora_dropout=0.0, task_type="CAUSAL_LM"))
    adapters = {k: list(v.shape) for k, v in policy.state_dict().items() if "lora_" in k}
    drawn = refs.reference_weights({k.replace(".default.", "."): s for k, s in adapters.items()})
    policy.load_state_dict({k: torch.from_numpy(drawn[k.replace(".default.", ".")] * 0.3) for k in adapters},
                           strict=False)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_dir / "tokenizer.json"), eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = (Path(importlib.util.find_spec("trl").submodule_search_locations[0])
                               / "chat_templates" / "qwen3.jinja").read_text()
    return policy, base(), tokenizer


def trainer(records, loss_type, weights, smoothing, out: str, steps: int = 1):
    import datasets
    import torch
    import trl

    policy, ref, tokenizer = build(CHAT)

    class InOrder(trl.DPOTrainer):  # the pairs in order, four a step, as seqjax's unshuffled rows give them
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    args = trl.DPOConfig(output_dir=out, per_device_train_batch_size=BATCH, max_length=MAX_LENGTH, learning_rate=LR,
                         lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                         adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_steps=steps, logging_steps=1,
                         bf16=False, gradient_checkpointing=False, report_to=[], seed=0, beta=BETA,
                         loss_type=loss_type, loss_weights=weights, label_smoothing=smoothing, use_cpu=True,
                         dataloader_drop_last=True, save_strategy="no", optim="adamw_torch")
    return InOrder(model=policy, ref_model=ref, args=args, train_dataset=datasets.Dataset.from_list(records),
                   processing_class=tokenizer)


def _metrics(t) -> dict:
    return {k: float(v[-1]) for k, v in t._metrics["train"].items() if k.startswith(("rewards/", "logps/"))}


def make(kind: str, out: Path) -> None:
    """``<kind>.json``: the tokenization and per-pair log-probabilities; for the explicit-prompt datasets also
    every loss's first step and a training curve."""
    import torch
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    records = pairs(kind)
    with tempfile.TemporaryDirectory() as tmp:
        t = trainer(records, ["sigmoid"], None, 0.0, tmp)
        data = t.train_dataset
        tokenized = [{k: list(map(int, row[k])) for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for row in data]
        per_pair = []
        t.model.train()
        for i in range(len(data)):  # each pair alone: its log-probabilities, policy and reference
            with torch.no_grad():
                t.compute_loss(t.model, t.data_collator([data[i]]))
            m = _metrics(t)
            per_pair.append({"chosen": m["logps/chosen"], "rejected": m["logps/rejected"],
                             "ref_chosen": m["logps/chosen"] - m["rewards/chosen"] / BETA,
                             "ref_rejected": m["logps/rejected"] - m["rewards/rejected"] / BETA})
        step1, curve = {}, []
        if kind.endswith("implicit"):
            _write(out, kind, records, tokenized, per_pair, step1, curve)
            return
        first = t.data_collator([data[i] for i in range(BATCH)])
        for name, (loss_type, weights, smoothing) in LOSSES.items():
            lt = trainer(records, loss_type, weights, smoothing, tmp)
            with torch.no_grad():
                loss = lt.compute_loss(lt.model, first)
            step1[name] = {"loss": float(loss), "loss_type": loss_type, "loss_weights": weights,
                           "label_smoothing": smoothing, **_metrics(lt)}
        # SimPO and ORPO: their trainers' own loss functions on these length-normalized log-probabilities
        lengths = [(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in tokenized[:BATCH]]
        chosen = torch.tensor([p["chosen"] / n for p, (n, _) in zip(per_pair, lengths)], dtype=torch.float64)
        rejected = torch.tensor([p["rejected"] / n for p, (_, n) in zip(per_pair, lengths)], dtype=torch.float64)
        cpu = SimpleNamespace(device="cpu")
        simpo = SimpleNamespace(beta=2.0, simpo_gamma=0.5, label_smoothing=0.0, alpha=0.0, loss_type="simpo",
                                accelerator=cpu)
        losses, c_rewards, r_rewards = CPOTrainer.cpo_loss(simpo, chosen, rejected)
        step1["simpo"] = {"loss": float(losses.mean()), "beta": 2.0, "simpo_gamma": 0.5,
                          "rewards/chosen": float(c_rewards.mean()), "rewards/rejected": float(r_rewards.mean())}
        orpo = SimpleNamespace(beta=0.1, accelerator=cpu)
        odds = ORPOTrainer.odds_ratio_loss(orpo, chosen, rejected)
        nll = -sum(p["chosen"] for p in per_pair[:BATCH]) / sum(n for n, _ in lengths)
        step1["orpo"] = {"loss": float(nll - odds[0].mean()), "beta": 0.1, "nll": float(nll),
                         "rewards/chosen": float(odds[1].mean()), "rewards/rejected": float(odds[2].mean())}
        lt = trainer(records, ["sigmoid"], None, 0.0, tmp, steps=STEPS)
        lt.train()
        curve = [{k: float(v) for k, v in row.items() if k == "loss" or k.startswith(("rewards/", "logps/"))}
                 for row in lt.state.log_history if "loss" in row]
    _write(out, kind, records, tokenized, per_pair, step1, curve)


def _write(out: Path, kind: str, records, tokenized, per_pair, step1, curve) -> None:
    import peft
    import torch
    import transformers
    import trl

    (out / f"{kind}.json").write_text(json.dumps({
        "records": records, "tokenized": tokenized, "per_pair": per_pair, "step1": step1, "curve": curve,
        "settings": {"rank": RANK, "alpha": ALPHA, "beta": BETA, "lr": LR, "steps": STEPS, "batch": BATCH,
                     "max_length": MAX_LENGTH, "targets": TARGETS, "adapter_scale": 0.3},
        "config": json.loads(transformers.Qwen3Config(**model_config()).to_json_string()),
        "tensors": tensor_shapes(), "adapter_tensors": adapter_shapes(),
        "made_by": {"trl": trl.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                    "torch": torch.__version__, "script": "scripts/make_preference_reference.py"}}, indent=1) + "\n")
    print(json.dumps({"dataset": kind, "pairs": len(tokenized), "curve": [round(r["loss"], 4) for r in curve]}))


OTHER_SCALE = 1.05  # the distinct reference model: the base with every weight scaled by this


def trainers(kind: str, out: Path) -> None:
    """``trainers_<kind>.json``: TRL's own CPO and ORPO trainers, and DPO against a reference that is not the
    policy's base, on the first batch of the same pairs and model.

    - ``cpo`` (``loss_type="simpo"``, TRL's default ``cpo_alpha=1``) and ``cpo_alpha0`` (the SimPO paper's loss),
      ``orpo``: the trainers' own tokenization (``tokenize_row``: ids and labels, the EOS they append) and
      ``get_batch_loss_metrics`` on the first four pairs (loss and every metric they log);
    - ``dpo_other_reference``: DPOTrainer with ``ref_model`` the base with every weight times ``OTHER_SCALE``:
      the first step's loss and metrics, and a ``STEPS``-step curve.
    """
    import datasets
    import torch
    import trl
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    records = pairs(kind)
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        common = dict(output_dir=tmp, per_device_train_batch_size=BATCH, max_length=MAX_LENGTH, bf16=False,
                      report_to=[], seed=0, use_cpu=True, save_strategy="no")
        made = {
            "cpo": (CPOTrainer, CPOConfig(**common, beta=2.0, simpo_gamma=0.5, loss_type="simpo")),
            "cpo_alpha0": (CPOTrainer, CPOConfig(**common, beta=2.0, simpo_gamma=0.5, loss_type="simpo",
                                                 cpo_alpha=0.0)),
            "orpo": (ORPOTrainer, ORPOConfig(**common, beta=0.1)),
        }
        for name, (cls, args) in made.items():
            policy, _, tokenizer = build(CHAT)
            t = cls(model=policy, args=args, train_dataset=datasets.Dataset.from_list(records),
                    processing_class=tokenizer)
            data = t.train_dataset
            tokenized = [{k: list(map(int, row[k])) for k in ("prompt_input_ids", "chosen_input_ids",
                                                               "rejected_input_ids", "chosen_labels")}
                         for row in data]
            t.model.train()
            with torch.no_grad():
                loss, metrics = t.get_batch_loss_metrics(t.model, t.data_collator([data[i] for i in range(BATCH)]))
            result[name] = {"tokenized": tokenized, "loss": float(loss),
                            "settings": {"beta": args.beta, **({"simpo_gamma": args.simpo_gamma,
                                                                "cpo_alpha": args.cpo_alpha}
                                                               if cls is CPOTrainer else {})},
                            "metrics": {k: float(v) for k, v in metrics.items()}}
        policy, base, tokenizer = build(CHAT)
        with torch.no_grad():
            for param in base.parameters():
                param.mul_(OTHER_SCALE)

        class InOrder(trl.DPOTrainer):
            def _get_train_sampler(self, *args, **kwargs):
                return torch.utils.data.SequentialSampler(self.train_dataset)

        args = trl.DPOConfig(output_dir=tmp, per_device_train_batch_size=BATCH, max_length=MAX_LENGTH,
                             learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                             max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                             max_steps=STEPS, logging_steps=1, bf16=False, report_to=[], seed=0, beta=BETA,
                             use_cpu=True, dataloader_drop_last=True, save_strategy="no", optim="adamw_torch")
        t = InOrder(model=policy, ref_model=base, args=args, train_dataset=datasets.Dataset.from_list(records),
                    processing_class=tokenizer)
        t.train()
        names = ("loss", "rewards/", "logps/", "logits/", "entropy", "mean_token_accuracy")
        result["dpo_other_reference"] = {
            "scale": OTHER_SCALE,
            "curve": [{k: float(v) for k, v in row.items() if k.startswith(names)}
                      for row in t.state.log_history if "loss" in row]}
    (out / f"trainers_{kind}.json").write_text(json.dumps({"records": records, **result, "made_by": {
        "trl": trl.__version__, "torch": torch.__version__, "script": "scripts/make_preference_reference.py"}},
        indent=1) + "\n")
    print(json.dumps({"dataset": kind, **{k: v["loss"] for k, v in result.items() if "loss" in v}}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("tests/data/preference"))
    p.add_argument("--datasets", nargs="*", default=["chat", "text", "chat_implicit", "text_implicit"])
    p.add_argument("--trainers", action="store_true",
                   help="only trainers_<kind>.json: TRL's CPO and ORPO trainers, and DPO against another model")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for kind in args.datasets:
        trainers(kind, args.out) if args.trainers else make(kind, args.out)


if __name__ == "__main__":
    main()
