"""The preflight Ray job: everything a verl run checks before it needs GPUs, on any cluster.

Run as ``python -m verl_pipeline.trainer.preflight [--summary-path P] -- <verl overrides…>``.
It composes verl's config from the installed ``ppo_trainer.yaml`` with the same overrides a
training job gets and runs verl's validation for the target shape; loads the parquet with verl's
``RLHFDataset`` and the model's tokenizer and reports prompt lengths; generates a few tokens with
the model on CPU; and scores every ground truth with verl's ``default_compute_score`` in Ray tasks
on the cluster (each must score 1.0). It prints a JSON summary after a marker line and exits
non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from verl_pipeline.constants import PREFLIGHT_SUMMARY_MARKER
from verl_pipeline.paths import write_json_atomic
from verl_pipeline.trainer.render import split_entrypoint_overrides
from verl_pipeline.trainer.validate import VerlConfigError, validate

log = logging.getLogger("verl_pipeline.preflight")


def _score_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Score each row's ground truth, written as a model would answer, with verl's reward function."""
    from verl.utils.reward_score import default_compute_score

    failures: list[dict[str, Any]] = []
    scored = 0
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        answer = f"The answer is computed step by step.\n#### {truth}"
        score = default_compute_score(row["data_source"], answer, truth, row.get("extra_info"))
        value = float(score["score"] if isinstance(score, dict) else score)
        scored += 1
        if value != 1.0 and len(failures) < 5:
            failures.append({"index": row["extra_info"]["index"], "ground_truth": truth, "score": value})
        elif value != 1.0:
            failures.append({})
    return {"scored": scored, "not_one": len(failures), "examples": [f for f in failures if f][:5]}


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


def run(overrides: list[str], *, generate_prompts: int = 2, max_new_tokens: int = 8) -> dict[str, Any]:
    summary: dict[str, Any] = {"ok": False, "checks": {}}
    t0 = time.monotonic()
    try:
        v = validate(overrides)
    except VerlConfigError as e:
        summary["checks"]["verl_config"] = {"ok": False, "error": str(e)}
        return summary
    cfg = v.config
    summary["checks"]["verl_config"] = {
        "ok": True, "seconds": v.seconds, "n_gpus": v.n_gpus, "use_critic": v.use_critic,
        "use_reference_policy": v.use_reference_policy, "train_batch_size": int(cfg.data.train_batch_size),
        "rollout_n": int(cfg.actor_rollout_ref.rollout.n),
    }
    log.info("verl accepted the configuration for %d GPU(s) in %.1fs", v.n_gpus, v.seconds)

    import pyarrow.parquet as pq
    import ray
    from verl.utils import hf_tokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    ray.init(log_to_driver=True)
    resources = ray.cluster_resources()
    summary["cluster"] = {"nodes": len([n for n in ray.nodes() if n["Alive"]]),
                          "CPU": resources.get("CPU", 0), "GPU": resources.get("GPU", 0)}

    model_path = str(cfg.actor_rollout_ref.model.path)
    tokenizer = hf_tokenizer(model_path)
    data_checks: dict[str, Any] = {}
    score_refs = {}
    score_task = ray.remote(num_cpus=1)(_score_rows)
    all_rows: dict[str, list[dict[str, Any]]] = {}
    for split, files in (("train", cfg.data.train_files), ("val", cfg.data.val_files)):
        paths = [str(f) for f in (files if not isinstance(files, str) else [files])]
        dataset = RLHFDataset(data_files=paths, tokenizer=tokenizer, config=cfg.data)
        rows = [r for p in paths for r in pq.read_table(p).to_pylist()]
        all_rows[split] = rows
        lengths = _prompt_lengths(rows, tokenizer, int(cfg.data.max_prompt_length))
        first = dataset[0]
        data_checks[split] = {"files": paths, "rows": len(rows), "rlhf_dataset_len": len(dataset),
                              "first_raw_prompt_messages": len(first["raw_prompt"]), "prompt_tokens": lengths}
        score_refs[split] = score_task.remote(rows)
    train_len = data_checks["train"]["rlhf_dataset_len"]
    data_ok = train_len >= int(cfg.data.train_batch_size) and data_checks["val"]["rlhf_dataset_len"] > 0
    summary["checks"]["data"] = {"ok": data_ok, **data_checks}
    if not data_ok:
        summary["checks"]["data"]["error"] = (
            f"{train_len} train prompts fit max_prompt_length; at least data.train_batch_size "
            f"({int(cfg.data.train_batch_size)}) are needed"
        )

    scores = {split: ray.get(ref) for split, ref in score_refs.items()}
    all_one = all(s["not_one"] == 0 for s in scores.values())
    summary["checks"]["reward"] = {"ok": all_one, "all_ground_truths_score_1": all_one, **scores}

    sample = all_rows["val"][:generate_prompts]
    summary["checks"]["generation"] = {"ok": True, "samples": _generate(model_path, tokenizer, sample, max_new_tokens)}
    summary["ok"] = all(c.get("ok") for c in summary["checks"].values())
    summary["seconds"] = round(time.monotonic() - t0, 2)
    return summary


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts, overrides = split_entrypoint_overrides(list(sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(prog="verl_pipeline.trainer.preflight")
    parser.add_argument("--summary-path", type=Path, default=None)
    parser.add_argument("--generate-prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args(opts)
    summary = run(overrides, generate_prompts=args.generate_prompts, max_new_tokens=args.max_new_tokens)
    if args.summary_path:
        write_json_atomic(args.summary_path, summary)
    print(PREFLIGHT_SUMMARY_MARKER + json.dumps(summary, sort_keys=True, default=str), flush=True)
    for name, check in summary["checks"].items():
        if not check.get("ok"):
            print(f"PREFLIGHT FAILED: {name}: {check.get('error', check)}", file=sys.stderr, flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
