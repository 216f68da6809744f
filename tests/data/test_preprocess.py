from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_pipeline.data.checks import SeenHashes
from verl_pipeline.data.generator import generate_problems
from verl_pipeline.data.preprocess import DATA_SOURCE, ROW_SCHEMA, extract_ground_truth, preprocess
from verl_pipeline.data.recipes import last_boxed
from verl_pipeline.exceptions import ConfigError, DataError
from verl_pipeline.spec import DataSource


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


@pytest.mark.parametrize(
    ("solution", "truth"),
    [(r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"), (r"\boxed{1} then \boxed{ {a}+{b} }", "{a}+{b}"),
     (r"\fbox{7}", "7"), (r"$\boxed 5$", "5"), (r"\boxed{unclosed", None), ("none", None), (r"\boxed{}", None)],
)
def test_last_boxed_handles_nested_braces(solution: str, truth: str | None) -> None:
    assert last_boxed(solution) == truth


def test_seen_hashes_matches_a_set() -> None:
    rng = np.random.default_rng(0)
    seen, ref = SeenHashes(), set()
    for _ in range(40):
        h = rng.integers(0, 5000, size=300).astype(np.uint64)
        expect = np.array([int(x) in ref for x in h])
        assert (seen.contains(h) == expect).all()
        seen.add(np.unique(h))
        ref.update(int(x) for x in h)
    assert len(seen) >= len(ref) and len(seen.runs) <= 8


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
    assert r.counts["length_filter"].startswith("off")


def test_rerun_is_cached_and_writes_nothing(tmp_path: Path) -> None:
    src, opts = DataSource("builtin", "arithmetic"), {"train_size": 20, "val_size": 4}
    first = preprocess(src, opts, tmp_path)
    mtime = Path(first.train_path).stat().st_mtime_ns
    second = preprocess(src, opts, tmp_path)
    assert (first.cached, second.cached) == (False, True)
    assert second.train_path == first.train_path
    assert Path(first.train_path).stat().st_mtime_ns == mtime
    assert second.seconds < 10  # a cache hit; the mtime above is the real check
    # Different options → a different output directory, the first one untouched.
    third = preprocess(src, {**opts, "seed": 1}, tmp_path)
    assert third.output_dir != first.output_dir and Path(first.train_path).exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial outputs left


# -- real GSM8K ------------------------------------------------------------------------------------

def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


def test_real_gsm8k_every_row_checked(gsm8k_dir: Path, tmp_path: Path, tiny_model_path: Path) -> None:
    n_train, n_test = len(_lines(gsm8k_dir / "train.jsonl")), len(_lines(gsm8k_dir / "test.jsonl"))
    # A limit every GSM8K prompt fits: nothing filtered, every row written, ground truths as GSM8K states them.
    r = preprocess(DataSource.parse(str(gsm8k_dir)), {}, tmp_path, tokenizer=str(tiny_model_path),
                   max_prompt_length=4096)
    c = r.counts
    assert (c["records_in"], c["train_rows"], c["val_rows"]) == (n_train + n_test, n_train, n_test)
    assert c["rejected"] == {} and c["deduplicated"] == 0 and c["too_long"] == 0
    assert c["scorer"].endswith("default_compute_score") and c["scorer_samples"] >= 2
    longest = c["length_filter"]["longest_prompt"]
    first = pq.read_table(r.train_path).slice(0, 1).to_pylist()[0]
    src = json.loads(_lines(gsm8k_dir / "train.jsonl")[0])
    assert first["reward_model"]["ground_truth"] == src["answer"].split("####")[-1].strip().replace(",", "")
    truths = pq.read_table(r.train_path, columns=["reward_model"]).column("reward_model").to_pylist()
    assert all("," not in t["ground_truth"] and t["ground_truth"] for t in truths)

    # The longest prompt, counted the way verl's RLHFDataset counts (chat template, tokenize=True).
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    line = json.loads(_lines(Path(longest["source"]))[longest["line"] - 1])
    content = f"{line['question'].strip()} {c['length_filter'] and 'Let'}"
    content = line["question"].strip() + ' Let\'s think step by step and output the final answer after "####".'
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert len(ids) == longest["tokens"]

    # Below the longest prompt: those rows are filtered (counted, listed), the rest kept and within the limit.
    limit = longest["tokens"] // 3
    r2 = preprocess(DataSource.parse(str(gsm8k_dir)), {}, tmp_path, tokenizer=str(tiny_model_path),
                    max_prompt_length=limit)
    c2 = r2.counts
    assert r2.output_dir != r.output_dir
    assert c2["too_long"] > 0 and c2["written"] + c2["too_long"] == n_train + n_test
    assert c2["length_filter"]["longest_kept_tokens"] <= limit
    filtered = [json.loads(x) for x in (Path(r2.output_dir) / "filtered.jsonl").read_text().splitlines()]
    assert len(filtered) == c2["too_long"] and {f["reason"] for f in filtered} == {"prompt_too_long"}
    assert {"source": longest["source"], "split": "train", "line": longest["line"],
            "reason": "prompt_too_long"} in filtered
    again = preprocess(DataSource.parse(str(gsm8k_dir)), {}, tmp_path, tokenizer=str(tiny_model_path),
                       max_prompt_length=limit)
    assert again.cached and again.seconds < 10 and again.counts == c2


def test_duplicates_removed_and_single_file_split_is_deterministic(gsm8k_dir: Path, tmp_path: Path) -> None:
    lines = _lines(gsm8k_dir / "test.jsonl")[:400]
    data = tmp_path / "one.jsonl"
    data.write_text("\n".join(lines + lines[:50] + [lines[7]]) + "\n")  # 51 exact duplicates
    a = preprocess(DataSource.parse(str(data)), {}, tmp_path / "a")
    b = preprocess(DataSource.parse(str(data)), {}, tmp_path / "b")
    assert a.counts["deduplicated"] == 51 and a.counts["written"] == 400
    assert a.counts["val_rows"] == 40  # every 10th source line (val_fraction 0.1)
    for split in ("train_path", "val_path"):
        assert pq.read_table(getattr(a, split)).equals(pq.read_table(getattr(b, split)))
    dups = [json.loads(x) for x in (Path(a.output_dir) / "filtered.jsonl").read_text().splitlines()]
    assert [d["line"] for d in dups] == list(range(401, 452))
    # A val prompt that is also in train is removed from val.
    d = tmp_path / "dir"
    d.mkdir()
    (d / "train.jsonl").write_text("\n".join(lines[:300]) + "\n")
    (d / "test.jsonl").write_text("\n".join(lines[290:400]) + "\n")
    r = preprocess(DataSource.parse(str(d)), {}, tmp_path / "c")
    assert (r.counts["train_rows"], r.counts["val_rows"], r.counts["deduplicated"]) == (300, 100, 10)


def test_changed_input_is_redone_touched_input_is_not(gsm8k_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "in.jsonl"
    lines = _lines(gsm8k_dir / "test.jsonl")[:100]
    data.write_text("\n".join(lines) + "\n")
    first = preprocess(DataSource.parse(str(data)), {}, tmp_path / "out")
    os.utime(data, ns=(1, 1))  # same content, new mtime: re-hashed once, same key
    assert preprocess(DataSource.parse(str(data)), {}, tmp_path / "out").cached
    data.write_text("\n".join(lines[:99]) + "\n")
    changed = preprocess(DataSource.parse(str(data)), {}, tmp_path / "out")
    assert not changed.cached and changed.key != first.key and changed.counts["records_in"] == 99


def test_every_file_format_and_url_gives_the_same_rows(gsm8k_dir: Path, tmp_path: Path) -> None:
    import fsspec

    records = [json.loads(x) for x in _lines(gsm8k_dir / "test.jsonl")[:200]]
    d = tmp_path / "in"
    d.mkdir()
    pa.Table.from_pylist(records).to_pandas().to_csv(d / "data.csv", index=False)
    pq.write_table(pa.Table.from_pylist(records), d / "data.parquet")
    (d / "array.json").write_text(json.dumps(records))
    with gzip.open(d / "data.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in records) + "\n")
    (d / "part1.jsonl").write_text("\n".join(json.dumps(r) for r in records[:120]) + "\n")
    (d / "part2.jsonl").write_text("\n".join(json.dumps(r) for r in records[120:]) + "\n")
    with fsspec.open("memory://bucket/data.jsonl", "w") as f:
        f.write("\n".join(json.dumps(r) for r in records) + "\n")
    expect = sorted(extract_ground_truth(r["answer"]) or "" for r in records)
    sources = [str(d / "data.csv"), str(d / "data.parquet"), str(d / "array.json"), str(d / "data.jsonl.gz"),
               str(d / "part*.jsonl"), "memory://bucket/data.jsonl", f"file://{d / 'data.parquet'}"]
    for i, text in enumerate(sources):
        src = DataSource.parse(text)
        r = preprocess(src, {}, tmp_path / f"out{i}")
        assert r.counts["rejected"] == {} and r.counts["written"] == 200, text
        got = [row["ground_truth"] for p in (r.train_path, r.val_path)
               for row in pq.read_table(p).column("reward_model").to_pylist()]
        assert sorted(got) == expect, text


def test_missing_fsspec_backend_names_the_package() -> None:
    import importlib.util

    if importlib.util.find_spec("s3fs") is not None:
        pytest.skip("s3fs is installed here")
    with pytest.raises(ConfigError, match=r"pip install s3fs"):
        DataSource.parse("s3://bucket/gsm8k/train.jsonl")


def test_huggingface_dataset_offline_and_saved(gsm8k_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    src = DataSource.parse("hf://openai/gsm8k?config=main&revision=main")
    assert src.kind == "hf"
    with pytest.raises(DataError, match=r"not in the local HuggingFace cache.*offline"):
        preprocess(src, {}, tmp_path / "out")

    train = [json.loads(x) for x in _lines(gsm8k_dir / "train.jsonl")[:150]]
    test = [json.loads(x) for x in _lines(gsm8k_dir / "test.jsonl")[:50]]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(train), "test": datasets.Dataset.from_list(test)})
    dd.save_to_disk(str(tmp_path / "saved"))
    saved = DataSource.parse(str(tmp_path / "saved"))
    assert saved.kind == "hf_disk"
    r = preprocess(saved, {}, tmp_path / "out")
    assert (r.counts["train_rows"], r.counts["val_rows"]) == (150, 50)
    assert preprocess(saved, {}, tmp_path / "out").cached


# -- malformed input -------------------------------------------------------------------------------

def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bad_records_are_rejected_with_line_and_reason(tmp_path: Path) -> None:
    good = [json.dumps({"question": f"What is {i}+1?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"}) for i in range(20)]
    bad = ["{broken json", json.dumps({"question": "q", "answer": "no marker"}),
           json.dumps({"question": " ", "answer": "#### 1"}),
           json.dumps({"question": 5, "answer": "#### 1"}), json.dumps(["not", "object"]),
           json.dumps({"answer": "#### 2"}), json.dumps({"question": "q?", "answer": {"x": 1}})]
    src = _write(tmp_path / "data.jsonl", good + bad)
    with pytest.raises(DataError) as err:
        preprocess(DataSource.parse(str(src)), {}, tmp_path / "out")
    msg = str(err.value)
    assert "7 of 27 records rejected" in msg
    rejects_file = Path(msg.rsplit("see ", 1)[1])
    rejects = [json.loads(line) for line in rejects_file.read_text().splitlines()]
    assert [r["reason"] for r in rejects] == ["invalid_json", "no_ground_truth", "empty_prompt",
                                               "wrong_type:question", "not_an_object", "missing_question",
                                               "wrong_type:answer"]
    assert [r["line"] for r in rejects] == list(range(21, 28))
    assert {r["source"] for r in rejects} == {str(src)}
    # With a tolerance the same input passes, and the counts say what was dropped.
    r = preprocess(DataSource.parse(str(src)), {"max_reject_fraction": 0.3}, tmp_path / "out")
    assert sum(r.counts["rejected"].values()) == 7 and r.counts["rejected"]["invalid_json"] == 1
    assert r.counts["train_rows"] + r.counts["val_rows"] == 20
    assert len((Path(r.output_dir) / "rejects.jsonl").read_text().splitlines()) == 7


def test_a_bad_line_deep_in_a_large_file_keeps_its_line_number(gsm8k_dir: Path, tmp_path: Path) -> None:
    lines = _lines(gsm8k_dir / "train.jsonl")[:3000]
    lines[2500] = lines[2500][:-5]  # truncated JSON
    src = _write(tmp_path / "d.jsonl", lines)
    r = preprocess(DataSource.parse(str(src)), {"max_reject_fraction": 0.01, "batch_rows": 700}, tmp_path / "o")
    assert r.counts["rejected"] == {"invalid_json": 1} and r.counts["written"] == 2999
    assert json.loads((Path(r.output_dir) / "rejects.jsonl").read_text())["line"] == 2501


def test_missing_and_wrongly_typed_columns_in_typed_files(tmp_path: Path) -> None:
    pq.write_table(pa.table({"prompt": ["a?"], "answer": ["#### 1"]}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"column\(s\) \['question'\] not found.*prompt_column"):
        preprocess(DataSource.parse(str(tmp_path / "p.parquet")), {}, tmp_path / "o")
    pq.write_table(pa.table({"question": [1, 2], "answer": ["#### 1", "#### 2"]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"column 'question' has type int64"):
        preprocess(DataSource.parse(str(tmp_path / "t.parquet")), {}, tmp_path / "o")
    (tmp_path / "c.csv").write_text("q,answer\nx,#### 1\n")
    with pytest.raises(DataError, match=r"\['question'\] not found"):
        preprocess(DataSource.parse(str(tmp_path / "c.csv")), {}, tmp_path / "o")


def test_unknown_data_source_and_bad_options_fail_before_reading(tmp_path: Path) -> None:
    src = DataSource("builtin", "arithmetic")
    with pytest.raises(ConfigError, match=r"data.data_source='my/own'.*no reward function"):
        preprocess(src, {"data_source": "my/own"}, tmp_path)
    with pytest.raises(ConfigError, match=r"data.recipe='nope'"):
        preprocess(src, {"recipe": "nope"}, tmp_path)
    with pytest.raises(ConfigError, match=r"data.bogus"):
        preprocess(src, {"bogus": 1}, tmp_path)
    with pytest.raises(ConfigError, match=r"answer_regex.*named group"):
        preprocess(src, {"recipe": "generic", "answer_extraction": "regex", "answer_regex": "#### (.*)"}, tmp_path)
    # Ground truths verl's scorer cannot reward: the gsm8k scorer with text answers.
    data = _write(tmp_path / "words.jsonl", [json.dumps({"prompt": f"Capital {i}?", "answer": "Paris"})
                                            for i in range(20)])
    with pytest.raises(DataError, match=r"line 1: .*scores the extracted ground truth 'Paris' 0"):
        preprocess(DataSource.parse(str(data)), {"recipe": "generic"}, tmp_path / "o")
    assert not [p for p in tmp_path.rglob("*.partial")]


# -- other recipes ---------------------------------------------------------------------------------

def test_math_recipe_boxed_ground_truth_scored_by_verl_math(tmp_path: Path) -> None:
    rows = [{"problem": f"What is $\\frac{{1}}{{{i + 2}}}$ doubled?",
             "solution": f"Double it: $\\boxed{{\\frac{{2}}{{{i + 2}}}}}$", "level": f"Level {i % 5}"}
            for i in range(30)]
    rows.append({"problem": "No box here", "solution": "The answer is 3."})
    data = _write(tmp_path / "math.jsonl", [json.dumps(r) for r in rows])
    r = preprocess(DataSource.parse(str(data)), {"recipe": "math", "max_reject_fraction": 0.05,
                                                 "system_prompt": "You are a careful mathematician."},
                   tmp_path / "o")
    assert r.counts["rejected"] == {"no_ground_truth": 1} and r.counts["data_source"] == "lighteval/MATH"
    row = pq.read_table(r.train_path).slice(0, 1).to_pylist()[0]
    assert row["reward_model"]["ground_truth"] == "\\frac{2}{2}"
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["prompt"][1]["content"].endswith("within \\boxed{}.")
    from verl.utils.reward_score import default_compute_score

    assert default_compute_score(row["data_source"], "so \\boxed{\\frac{2}{2}}", row["reward_model"]["ground_truth"]) \
        == 1.0


def test_generic_recipe_template_regex_extras_and_custom_reward(tmp_path: Path) -> None:
    rows = [{"title": f"T{i}", "body": f"What is {i} squared?", "label": f"Answer: {i * i}", "id": i,
             "meta": {"k": i}} for i in range(40)]
    data = _write(tmp_path / "own.jsonl", [json.dumps(r) for r in rows])
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1.0 if solution_str.strip().endswith(ground_truth) else 0.0\n")
    opts = {"recipe": "generic", "prompt_template": "{title}\n\n{body}", "answer_column": "label",
            "answer_extraction": "regex", "answer_regex": r"Answer:\s*(?P<answer>\d+)", "data_source": "my/squares",
            "ability": "arithmetic", "extra_columns": ["id", "meta"], "custom_reward_path": str(reward),
            "check_solution": "so it is {ground_truth}"}
    r = preprocess(DataSource.parse(str(data)), opts, tmp_path / "o")
    assert r.counts["written"] == 40 and r.counts["scorer"].endswith("reward.py:compute_score")
    table = pq.read_table(r.train_path)
    row = table.slice(1, 1).to_pylist()[0]
    assert row["prompt"] == [{"role": "user", "content": "T1\n\nWhat is 1 squared?"}]
    assert row["reward_model"]["ground_truth"] == "1" and row["data_source"] == "my/squares"
    assert row["extra_info"]["id"] == "1" and json.loads(row["extra_info"]["meta"]) == {"k": 1}
    assert row["ability"] == "arithmetic"


def test_verl_rlhf_dataset_reads_the_parquet(gsm8k_dir: Path, tmp_path: Path, tiny_model_path: Path) -> None:
    from omegaconf import OmegaConf
    from verl.utils import hf_tokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    data = _write(tmp_path / "g.jsonl", _lines(gsm8k_dir / "test.jsonl")[:300])
    r = preprocess(DataSource.parse(str(data)), {"system_prompt": "Answer briefly."}, tmp_path / "o",
                   tokenizer=str(tiny_model_path), max_prompt_length=256)
    tok = hf_tokenizer(str(tiny_model_path))
    cfg = OmegaConf.create({"max_prompt_length": 256, "filter_overlong_prompts": True,
                            "cache_dir": str(tmp_path / "cache")})
    ds = RLHFDataset(data_files=[r.train_path], tokenizer=tok, config=cfg)
    # verl's own length filter finds nothing left to drop: ours counted exactly as verl does.
    assert len(ds) == r.counts["train_rows"] > 0
    item = ds[0]
    assert [m["role"] for m in item["raw_prompt"]] == ["system", "user"]
    assert item["data_source"] == DATA_SOURCE
    assert item["reward_model"]["ground_truth"]


def test_cli_preprocess_by_hand(gsm8k_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from verl_pipeline.cli import main

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    lines = _lines(gsm8k_dir / "test.jsonl")
    _write(a, lines[:100])
    _write(b, [*lines[100:150], "{broken"])
    args = ["preprocess", "--recipe", "gsm8k", "--input", str(a), "--input", str(b), "--output", str(tmp_path / "o")]
    assert main([*args, "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (earlier lines: the built-in model being built)
    assert err.startswith("verl-pipeline: error: ") and "1 of 151 records rejected" in err
    assert main([*args, "--max-reject-fraction", "0.01", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    c = out["counts"]
    assert c["written"] + c["too_long"] == 150 and c["rejected"] == {"invalid_json": 1}
    assert isinstance(out["counts"]["length_filter"], dict)  # the run's (built-in) model's tokenizer
    assert Path(out["train_path"]).is_file()
    assert main([*args, "--max-reject-fraction", "0.01"]) == 0
    text = capsys.readouterr().out
    assert f"rows in 151, written {c['written']}" in text and "cached" in text
    assert main(["preprocess", "--input", "relative.jsonl"]) == 2
    assert "--input='relative.jsonl'" in capsys.readouterr().err


def test_operator_outlet_asset_and_recipe_param(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from collections import defaultdict

    from tests.airflow.context import provisioned, task_context
    from verl_pipeline.airflow.assets import PREPROCESSED_DATA_ALIAS, preprocessed_data_uri
    from verl_pipeline.airflow.operators import PreprocessDataOperator
    from verl_pipeline.airflow.params import build_params
    from verl_pipeline.profiles import build_run_spec

    assert build_params()["recipe"].schema["enum"] == [None, "generic", "gsm8k", "math", "verl"]
    with pytest.raises(ConfigError, match="recipe='nope'"):
        build_run_spec({"recipe": "nope"}, run_name="r")
    assert build_run_spec({"recipe": "math"}, run_name="r").data_options["recipe"] == "math"

    monkeypatch.setenv("VERL_PIPELINE_HOME", str(tmp_path / "home"))
    op = PreprocessDataOperator(task_id="preprocess_data")
    assert [a.name for a in op.outlets] == [PREPROCESSED_DATA_ALIAS]
    assert PreprocessDataOperator(task_id="p", emit_asset=False).outlets == []

    class AliasEvents:
        """What Airflow's outlet-event accessor records for an AssetAlias outlet."""

        def __init__(self) -> None:
            self.added: list[tuple[object, dict]] = []

        def add(self, asset: object, extra: dict) -> None:
            self.added.append((asset, extra))

    events: defaultdict[object, AliasEvents] = defaultdict(AliasEvents)
    ctx = task_context({}, run_id="manual__t", outlet_events=events)
    provisioned(ctx)
    out = op.execute(ctx)
    assert out["counts"]["train_rows"] == 256 and out["counts"]["length_filter"]["max_prompt_length"] == 256
    ((asset, extra),) = events[op.outlets[0]].added
    assert asset.uri == preprocessed_data_uri("smoke")  # type: ignore[attr-defined]
    assert extra["train_path"] == out["train_path"]
    assert op.execute(ctx)["cached"] is True
    shutil.rmtree(tmp_path / "home", ignore_errors=True)
