from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from verl_pipeline.config import DataSource
from verl_pipeline.data.generator import generate_problems
from verl_pipeline.data.preprocess import DATA_SOURCE, ROW_SCHEMA, extract_ground_truth, preprocess
from verl_pipeline.exceptions import DataError


def test_generator_is_deterministic_and_gsm8k_shaped() -> None:
    a = list(generate_problems(50, seed=3))
    assert a == list(generate_problems(50, seed=3))
    assert a != list(generate_problems(50, seed=4))
    for p in a:
        assert p.answer.splitlines()[-1].startswith("#### ")
        truth = extract_ground_truth(p.answer)
        assert truth is not None and int(truth) >= 0


@pytest.mark.parametrize(
    ("answer", "truth"),
    [("x\n#### 72", "72"), ("#### 1,234", "1234"), ("#### -5", "-5"), ("#### 3.5", "3.5"), ("no marker", None),
     ("#### ", None)],
)
def test_extract_ground_truth(answer: str, truth: str | None) -> None:
    assert extract_ground_truth(answer) == truth


def test_builtin_rows_match_verl_schema(tmp_path: Path) -> None:
    r = preprocess(DataSource("builtin", "arithmetic"), {"train_size": 40, "val_size": 8}, tmp_path)
    train = pq.read_table(r.train_path)
    assert train.schema.equals(ROW_SCHEMA)
    assert train.num_rows == 40 and pq.read_table(r.val_path).num_rows == 8
    row = train.slice(0, 1).to_pylist()[0]
    assert row["data_source"] == DATA_SOURCE
    assert row["prompt"][0]["role"] == "user" and "####" in row["prompt"][0]["content"]
    assert row["reward_model"]["style"] == "rule"
    assert row["reward_model"]["ground_truth"] == extract_ground_truth(row["extra_info"]["answer"])
    assert row["extra_info"]["split"] == "train" and row["extra_info"]["index"] == 0


def test_rerun_is_cached_and_writes_nothing(tmp_path: Path) -> None:
    src, opts = DataSource("builtin", "arithmetic"), {"train_size": 20, "val_size": 4}
    first = preprocess(src, opts, tmp_path)
    mtime = Path(first.train_path).stat().st_mtime_ns
    second = preprocess(src, opts, tmp_path)
    assert (first.cached, second.cached) == (False, True)
    assert second.train_path == first.train_path
    assert Path(first.train_path).stat().st_mtime_ns == mtime
    assert second.seconds < 1.0
    # Different options → a different output directory, the first one untouched.
    third = preprocess(src, {**opts, "seed": 1}, tmp_path)
    assert third.output_dir != first.output_dir and Path(first.train_path).exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial outputs left


def test_real_gsm8k(gsm8k_dir: Path, tmp_path: Path) -> None:
    r = preprocess(DataSource("jsonl", str(gsm8k_dir)), {}, tmp_path)
    n_train = sum(1 for line in open(gsm8k_dir / "train.jsonl") if line.strip())
    n_test = sum(1 for line in open(gsm8k_dir / "test.jsonl") if line.strip())
    assert r.counts["train_rows"] == n_train and r.counts["val_rows"] == n_test
    assert r.counts["rejected"] == {}
    first = pq.read_table(r.train_path).slice(0, 1).to_pylist()[0]
    src = json.loads(open(gsm8k_dir / "train.jsonl").readline())
    assert first["reward_model"]["ground_truth"] == src["answer"].split("####")[-1].strip().replace(",", "")


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bad_records_are_rejected_with_line_and_reason(tmp_path: Path) -> None:
    good = [json.dumps({"question": f"What is {i}+1?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"}) for i in range(20)]
    bad = ["{broken json", json.dumps({"question": "q", "answer": "no marker"}),
           json.dumps({"question": " ", "answer": "#### 1"}),
           json.dumps({"question": 5, "answer": "#### 1"}), json.dumps(["not", "object"])]
    src = _write(tmp_path / "data.jsonl", good + bad)
    with pytest.raises(DataError) as err:
        preprocess(DataSource("jsonl", str(src)), {}, tmp_path / "out")
    msg = str(err.value)
    assert "5 of 25 records rejected" in msg
    rejects_file = Path(msg.rsplit("see ", 1)[1])
    rejects = [json.loads(line) for line in rejects_file.read_text().splitlines()]
    assert [r["reason"] for r in rejects] == ["invalid_json", "no_ground_truth", "empty_prompt",
                                               "missing_question_or_answer", "not_an_object"]
    assert rejects[0]["line"] == 21
    # With a tolerance the same input passes, and the counts say what was dropped.
    r = preprocess(DataSource("jsonl", str(src)), {"max_reject_fraction": 0.25}, tmp_path / "out")
    assert sum(r.counts["rejected"].values()) == 5
    assert r.counts["train_rows"] + r.counts["val_rows"] == 20


def test_verl_rlhf_dataset_reads_the_parquet(tmp_path: Path, tiny_model_path: Path) -> None:
    from omegaconf import OmegaConf
    from verl.utils import hf_tokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    r = preprocess(DataSource("builtin", "arithmetic"), {"train_size": 16, "val_size": 4}, tmp_path)
    tok = hf_tokenizer(str(tiny_model_path))
    cfg = OmegaConf.create({"max_prompt_length": 256, "filter_overlong_prompts": True,
                            "cache_dir": str(tmp_path / "cache")})
    ds = RLHFDataset(data_files=[r.train_path], tokenizer=tok, config=cfg)
    assert len(ds) == 16
    item = ds[0]
    assert item["raw_prompt"][0]["role"] == "user"
    assert item["data_source"] == DATA_SOURCE
    assert item["reward_model"]["ground_truth"]
