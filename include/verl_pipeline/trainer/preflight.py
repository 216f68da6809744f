"""The preflight Ray job: everything a verl run checks before it needs GPUs, on any cluster.

Run as ``python -m verl_pipeline.trainer.preflight [--summary-path P] [--validation-record R] -- <verl
overrides…>``. It takes verl's config as the provision task composed and validated it (the record ``R``,
trusted when it was made for these overrides and this verl installation: see
:func:`verl_pipeline.trainer.validate.trusted`), else composes it from the installed
``ppo_trainer.yaml`` with the same overrides a training job gets and runs verl's validation for the
target shape; loads the parquet with verl's ``RLHFDataset`` and the model's tokenizer and reports
prompt lengths; generates a few tokens with the model on CPU; and scores every ground truth with
the run's reward manager and function in a Ray task on the cluster, each written in the recipe's
answer form (each must score 1.0). It prints a JSON
summary after a marker line (each check with its seconds) and exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from verl_pipeline.constants import PREFLIGHT_SUMMARY_MARKER
from verl_pipeline.paths import write_json_atomic
from verl_pipeline.trainer.render import split_entrypoint_overrides
from verl_pipeline.trainer.reward import ANSWER_FORM, ANY_DATA_SOURCE
from verl_pipeline.trainer.validate import Validated, VerlConfigError, trusted, validate

log = logging.getLogger("verl_pipeline.preflight")


def answer_for(forms: str | dict[str, str], data_source: str) -> str:
    """The answer form of a row of ``data_source``: the one form, or its data_source's (``"*"``: the others)."""
    if isinstance(forms, str):
        return forms
    return forms.get(data_source, forms.get(ANY_DATA_SOURCE, ANSWER_FORM))


def parse_answer_forms(text: str) -> str | dict[str, str]:
    """``--answer-form``: JSON of a form (a string) or of a mapping of data_source to form; always JSON, since
    a form may itself start with ``{`` (``{ground_truth}``)."""
    value = json.loads(text)
    return value if isinstance(value, str) else {str(k): str(v) for k, v in dict(value).items()}


def _score_splits(cfg: Any, splits: dict[str, list[dict[str, Any]]],
                  answer_form: str | dict[str, str]) -> dict[str, dict[str, Any]]:
    """Score each split's ground truths, written in the recipe's answer form, as the training job will:
    verl's reward manager of the run's config (``reward.reward_manager``) with the run's reward function
    (``reward.custom_reward_function``, else verl's ``default_compute_score``), each answer tokenized and
    decoded by the model's tokenizer as a response is.

    One Ray task for every split: each worker that runs it imports verl (and torch) first, which costs
    far more than scoring a few thousand answers."""
    import asyncio

    import numpy as np
    import torch
    from verl import DataProto
    from verl.trainer.ppo.reward import load_reward_manager
    from verl.utils import hf_tokenizer

    tokenizer = hf_tokenizer(str(cfg.actor_rollout_ref.model.path))
    manager = load_reward_manager(cfg, tokenizer)
    prompt = torch.tensor([[tokenizer.eos_token_id or 0]])

    def item(row: dict[str, Any]) -> Any:
        form = answer_for(answer_form, str(row.get("data_source")))
        answer = form.format(ground_truth=row["reward_model"]["ground_truth"])
        ids = tokenizer(answer, add_special_tokens=False, return_tensors="pt")["input_ids"]
        mask = torch.ones(1, prompt.shape[1] + ids.shape[1], dtype=torch.long)
        non_tensors = {k: np.array([row.get(k) if k != "extra_info" else dict(row.get(k) or {})], dtype=object)
                       for k in ("data_source", "reward_model", "extra_info")}
        return DataProto.from_dict(tensors={"prompts": prompt, "responses": ids, "attention_mask": mask},
                                   non_tensors=non_tensors)

    async def score(rows: list[dict[str, Any]]) -> list[Any]:
        return list(await asyncio.gather(*(manager.run_single(item(r)) for r in rows), return_exceptions=True))

    out = {}
    for split, rows in splits.items():
        not_one = 0
        examples: list[dict[str, Any]] = []
        errors: list[str] = []
        for row, result in zip(rows, manager.loop.run_until_complete(score(rows)), strict=True):
            truth = row["reward_model"]["ground_truth"]
            value = _reward_value(result)
            if isinstance(value, str):
                errors.append(f"row {(row.get('extra_info') or {}).get('index')}: {value}")
                value = float("nan")
            if value != 1.0:
                not_one += 1
                if len(examples) < 5:
                    examples.append({"index": (row.get("extra_info") or {}).get("index"), "ground_truth": truth,
                                     "score": value})
        out[split] = {"scored": len(rows), "not_one": not_one, "examples": examples, "errors": errors[:5],
                      "answer_form": answer_form, "manager": type(manager).__name__}
    return out


def _reward_value(result: Any) -> float | str:
    """The score in what the reward manager returned, or why there is none (its error, in words)."""
    if isinstance(result, BaseException):
        return f"the reward function raised {type(result).__name__}: {result}"
    value = result.get("reward_score") if isinstance(result, dict) else result
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"the reward is {value!r}, not a number"
    return float(value)


def _prompt_lengths(rows: list[dict[str, Any]], tokenizer: Any, max_len: int) -> dict[str, Any]:
    texts = [tokenizer.apply_chat_template(list(r["prompt"]), add_generation_prompt=True, tokenize=False)
             for r in rows]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    return {
        "rows": len(lengths),
        "min": min(lengths),
        "mean": round(statistics.fmean(lengths), 1),
        "max": lengths[longest],
        "longest_index": longest,
        "over_max_prompt_length": sum(1 for n in lengths if n > max_len),
        "max_prompt_length": max_len,
    }


def _generate(model_path: str, tokenizer: Any, rows: list[dict[str, Any]], max_new_tokens: int) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    out = []
    for r in rows:
        ids = tokenizer.apply_chat_template(list(r["prompt"]), add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        new = gen[0, ids["input_ids"].shape[1]:]
        out.append({"prompt_tokens": int(ids["input_ids"].shape[1]), "new_tokens": int(new.shape[0]),
                    "text": tokenizer.decode(new, skip_special_tokens=True)[:200]})
    return out


def _read_record(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _verl_config(overrides: list[str], record_path: Path | None) -> tuple[Validated, dict[str, Any]]:
    """verl's config for ``overrides``: the provision task's validation when it holds for them, else
    composed and validated here (VerlConfigError when verl rejects it)."""
    v, why = trusted(_read_record(record_path), overrides)
    if v is not None:
        log.info("verl's configuration: %s (%s): composed and validated once for this run, not again here",
                 why, record_path)
        return v, {"validated_by": "provision", "record": str(record_path)}
    log.info("verl's configuration: composing and validating it here: %s", why)
    v = validate(overrides)
    log.info("verl accepted the configuration for %d GPU(s) in %.1fs", v.n_gpus, v.seconds)
    return v, {"validated_by": "preflight job", "why": why}


def run(overrides: list[str], *, generate_prompts: int = 2, max_new_tokens: int = 8,
        validation_record: Path | None = None, answer_form: str | dict[str, str] = ANSWER_FORM) -> dict[str, Any]:
    summary: dict[str, Any] = {"ok": False, "checks": {}}
    checks = summary["checks"]
    t0 = time.monotonic()
    try:
        v, origin = _verl_config(overrides, validation_record)
    except VerlConfigError as e:
        checks["verl_config"] = {"ok": False, "error": str(e), "seconds": _since(t0)}
        return summary
    cfg = v.config
    checks["verl_config"] = {
        "ok": True, **origin, "seconds": _since(t0), "n_gpus": v.n_gpus, "use_critic": v.use_critic,
        "use_reference_policy": v.use_reference_policy, "train_batch_size": int(cfg.data.train_batch_size),
        "rollout_n": int(cfg.actor_rollout_ref.rollout.n),
        # verl's checks that need what this node lacks (vLLM): the training job's own validate_config runs them.
        "unchecked": list(v.unchecked),
    }

    import pyarrow.parquet as pq
    import ray

    t = time.monotonic()
    ray.init(log_to_driver=True)
    resources = ray.cluster_resources()
    summary["cluster"] = {"nodes": len([n for n in ray.nodes() if n["Alive"]]),
                          "CPU": resources.get("CPU", 0), "GPU": resources.get("GPU", 0), "seconds": _since(t)}

    # The scoring task first: its worker starts (and imports verl) while this driver checks the data.
    t_reward = time.monotonic()
    files = {split: [str(f) for f in (paths if not isinstance(paths, str) else [paths])]
             for split, paths in (("train", cfg.data.train_files), ("val", cfg.data.val_files))}
    rows = {split: [r for p in paths for r in pq.read_table(p).to_pylist()] for split, paths in files.items()}
    scores_ref = ray.remote(num_cpus=1)(_score_splits).remote(cfg, rows, answer_form)

    t = time.monotonic()
    from verl.utils import hf_tokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    model_path = str(cfg.actor_rollout_ref.model.path)
    tokenizer = hf_tokenizer(model_path)
    data_checks: dict[str, Any] = {}
    for split, paths in files.items():
        dataset = RLHFDataset(data_files=paths, tokenizer=tokenizer, config=cfg.data)
        lengths = _prompt_lengths(rows[split], tokenizer, int(cfg.data.max_prompt_length))
        first = dataset[0]
        data_checks[split] = {"files": paths, "rows": len(rows[split]), "rlhf_dataset_len": len(dataset),
                              "first_raw_prompt_messages": len(first["raw_prompt"]), "prompt_tokens": lengths}
    train_len = data_checks["train"]["rlhf_dataset_len"]
    data_ok = train_len >= int(cfg.data.train_batch_size) and data_checks["val"]["rlhf_dataset_len"] > 0
    checks["data"] = {"ok": data_ok, **data_checks, "seconds": _since(t)}
    if not data_ok:
        checks["data"]["error"] = (
            f"{train_len} train prompts fit max_prompt_length; at least data.train_batch_size "
            f"({int(cfg.data.train_batch_size)}) are needed"
        )

    t = time.monotonic()
    samples = _generate(model_path, tokenizer, rows["val"][:generate_prompts], max_new_tokens)
    checks["generation"] = {"ok": True, "samples": samples, "seconds": _since(t)}

    scores = ray.get(scores_ref)
    all_one = all(s["not_one"] == 0 for s in scores.values())
    # From the task's submission: most of it is the worker starting, in parallel with the checks above.
    checks["reward"] = {"ok": all_one, "all_ground_truths_score_1": all_one, **scores, "seconds": _since(t_reward)}
    if not all_one:
        split, failed = next((k, v) for k, v in scores.items() if v["not_one"])
        checks["reward"]["error"] = (
            f"{failed['not_one']} of {failed['scored']} {split} ground truths, answered as {answer_form!r}, do not "
            f"score 1.0 with {failed['manager']} and the run's reward function: "
            + (failed["errors"][0] if failed["errors"] else f"first {failed['examples'][:1]}")
            + ". Fix: the recipe's check_solution in the form the reward function rewards, or the reward function")
    summary["ok"] = all(c.get("ok") for c in checks.values())
    summary["seconds"] = _since(t0)
    return summary


def _since(t: float) -> float:
    return round(time.monotonic() - t, 2)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts, overrides = split_entrypoint_overrides(list(sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(prog="verl_pipeline.trainer.preflight")
    parser.add_argument("--summary-path", type=Path, default=None)
    parser.add_argument("--validation-record", type=Path, default=None,
                        help="the provision task's verl validation; trusted when made for these overrides")
    parser.add_argument("--generate-prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--answer-form", default=json.dumps(ANSWER_FORM),
                        help="JSON: a correct answer, with {ground_truth} (the recipe's check_solution), or a "
                        "mapping of data_source to such a form (rows in verl's schema)")
    args = parser.parse_args(opts)
    summary = run(overrides, generate_prompts=args.generate_prompts, max_new_tokens=args.max_new_tokens,
                  validation_record=args.validation_record, answer_form=parse_answer_forms(args.answer_form))
    if args.summary_path:
        write_json_atomic(args.summary_path, summary)
    print(PREFLIGHT_SUMMARY_MARKER + json.dumps(summary, sort_keys=True, default=str), flush=True)
    for name, check in summary["checks"].items():
        if not check.get("ok"):
            print(f"PREFLIGHT FAILED: {name}: {check.get('error', check)}", file=sys.stderr, flush=True)
    passed = sum(1 for c in summary["checks"].values() if c.get("ok"))
    log.info("Preflight done: %d of %d checks passed", passed, len(summary["checks"]))
    return 0 if summary["ok"] else 1


def _exit(code: int) -> NoReturn:
    """End the job as soon as its summary is out: the interpreter's own teardown (Ray's disconnect,
    torch's and transformers' exit handlers, collecting the model) took seconds and leaves nothing the
    job needs; Ray cleans up after a driver that exits without ``ray.shutdown()`` as after any other."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
