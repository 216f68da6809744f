"""Recipe verl: a parquet already in verl's row schema (multi-turn, tool calling, several data_sources)
accepted as it is, checked row by row and read back by verl's own RLHFDataset."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_pipeline.data.preprocess import preprocess
from verl_pipeline.exceptions import ConfigError, DataError
from verl_pipeline.spec import DataSource

SYSTEM = {"role": "system", "content": "You are a careful solver. Put the final answer after ####."}
TOOL = "calc_gsm8k_reward"


def _row(i: int, split: str, kind: str) -> dict[str, Any]:
    """One row as verl's example preprocessors write them (gsm8k_multiturn_w_tool, the agent-loop ones)."""
    info: dict[str, Any] = {"split": split, "index": i, "need_tools_kwargs": kind == "tool",
                            "tools_kwargs": {TOOL: {"create_kwargs": {"ground_truth": str(i)}}},
                            "interaction_kwargs": {"query": f"q{i}", "ground_truth": str(i)}}
    if kind == "multi_turn":
        prompt = [SYSTEM, {"role": "user", "content": f"Tom has {i} apples."},
                  {"role": "assistant", "content": "Noted. What is the question?"},
                  {"role": "user", "content": "How many apples does Tom have?"}]
        return {"data_source": "openai/gsm8k", "prompt": prompt, "ability": "math", "agent_name": "single_turn_agent",
                "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": info}
    if kind == "tool":
        prompt = [SYSTEM, {"role": "user", "content": f"What is {i} times one? Check it with {TOOL}."}]
        return {"data_source": "openai/gsm8k", "prompt": prompt, "ability": "math", "agent_name": "tool_agent",
                "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": info}
    prompt = [{"role": "user", "content": f"Write one over {i + 2} as a fraction."}]
    return {"data_source": "lighteval/MATH", "prompt": prompt, "ability": "math", "agent_name": "single_turn_agent",
            "reward_model": {"style": "rule", "ground_truth": f"\\frac{{1}}{{{i + 2}}}"}, "extra_info": info}


def _rows(n: int, split: str, start: int = 0, kinds: tuple[str, ...] = ("multi_turn", "tool", "math")) \
        -> list[dict[str, Any]]:
    return [_row(i, split, kinds[i % len(kinds)]) for i in range(start, start + n)]


def _parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _verl_dir(root: Path, n_train: int = 60, n_test: int = 12, **kw: Any) -> Path:
    _parquet(root / "train.parquet", _rows(n_train, "train", **kw))
    _parquet(root / "test.parquet", _rows(n_test, "test", start=1000, **kw))
    return root


def _rlhf_dataset(files: list[str], tokenizer: Any, tmp: Path, max_len: int) -> Any:
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    cfg = OmegaConf.create({"max_prompt_length": max_len, "filter_overlong_prompts": True,
                            "filter_overlong_prompts_workers": 1, "cache_dir": str(tmp / "verl-cache")})
    return RLHFDataset(data_files=files, tokenizer=tokenizer, config=cfg)


def test_a_verl_parquet_is_kept_whole_and_read_by_verl(tmp_path: Path, tiny_model_path: Path) -> None:
    src = _verl_dir(tmp_path / "in")
    r = preprocess(DataSource.parse(str(src)), {"recipe": "verl"}, tmp_path / "out", tokenizer=str(tiny_model_path),
                   max_prompt_length=256)
    c = r.counts
    assert (c["records_in"], c["train_rows"], c["val_rows"], c["rejected"]) == (72, 60, 12, {})
    assert c["data_sources"] == {"openai/gsm8k": 48, "lighteval/MATH": 24} and c["data_source"] == "(per row)"
    assert c["agent_names"] == {"single_turn_agent": 48, "tool_agent": 24}
    assert c["answer_forms"]["openai/gsm8k"] == "#### {ground_truth}"
    # Both data_sources' reward functions checked, and verl's reader kept every sampled row.
    assert c["scorer_samples"] >= 4 and c["scorer_not_checked"] == {}
    assert c["rlhf_dataset"]["length_filter"] is True
    assert c["rlhf_dataset"]["train"]["sampled"] == c["rlhf_dataset"]["train"]["kept"] >= 6
    # Every column and value as written: nothing rewritten, nothing lost.
    for out, given in ((r.train_path, src / "train.parquet"), (r.val_path, src / "test.parquet")):
        assert pq.read_table(out).equals(pq.read_table(given))
    assert json.loads((Path(r.output_dir) / "stats.json").read_text()) == c
    assert preprocess(DataSource.parse(str(src)), {"recipe": "verl"}, tmp_path / "out",
                      tokenizer=str(tiny_model_path), max_prompt_length=256).cached

    # verl reads the whole output as its trainer will: its own length filter drops nothing, a tool row
    # carries its tools_kwargs and agent loop, a multi-turn row its four messages.
    from verl.utils import hf_tokenizer

    ds = _rlhf_dataset([r.train_path], hf_tokenizer(str(tiny_model_path)), tmp_path, 256)
    assert len(ds) == 60
    multi, tool, math = ds[0], ds[1], ds[2]
    assert [m["role"] for m in multi["raw_prompt"]] == ["system", "user", "assistant", "user"]
    assert tool["agent_name"] == "tool_agent" and tool["index"] == 1
    assert tool["tools_kwargs"] == {TOOL: {"create_kwargs": {"ground_truth": "1"}}}
    assert tool["interaction_kwargs"] == {"query": "q1", "ground_truth": "1"}
    assert math["data_source"] == "lighteval/MATH" and math["reward_model"]["ground_truth"] == "\\frac{1}{4}"


def test_duplicates_and_overlong_prompts_are_filtered_as_verl_counts(tmp_path: Path, tiny_model_path: Path) -> None:
    rows = _rows(40, "train")
    rows.append(dict(rows[4]))  # the same messages again
    long = _row(500, "train", "multi_turn")
    long["prompt"] = [SYSTEM, {"role": "user", "content": "How many apples? " * 80}]
    rows.append(long)
    src = _parquet(tmp_path / "one.parquet", rows)
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(str(tiny_model_path))
    # Counted as verl's filter counts (RLHFDataset.maybe_filter_out_long_prompts).
    tokens = len(tok.apply_chat_template(long["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"])
    limit = tokens - 1
    r = preprocess(DataSource.parse(str(src)), {"recipe": "verl"}, tmp_path / "out", tokenizer=str(tiny_model_path),
                   max_prompt_length=limit)
    c = r.counts
    assert (c["deduplicated"], c["too_long"], c["written"]) == (1, 1, 40)
    assert c["length_filter"]["longest_prompt"] == {"tokens": tokens, "source": str(src), "line": 42}
    filtered = [json.loads(x) for x in (Path(r.output_dir) / "filtered.jsonl").read_text().splitlines()]
    assert [(f["line"], f["reason"]) for f in filtered] == [(41, "duplicate_prompt"), (42, "prompt_too_long")]
    assert c["val_rows"] == 4  # one file divided: every 10th source row to val
    # verl's own filter, at the limit preprocessing used, finds nothing more to drop.
    assert len(_rlhf_dataset([r.train_path, r.val_path], tok, tmp_path, limit)) == 40
    assert len(_rlhf_dataset([str(src)], tok, tmp_path, limit)) == 41  # the raw file: verl drops the long one


BAD_ROWS = [
    ("message_without_role", lambda r: r["prompt"].__setitem__(1, {"content": "no role here"}),
     "column prompt: message 2 has no role"),
    ("no_ground_truth", lambda r: r["reward_model"].pop("ground_truth"), "column reward_model: has no ground_truth"),
    ("missing_data_source", lambda r: r.__setitem__("data_source", None), "column data_source: is empty"),
    ("missing_agent_name", lambda r: r.__setitem__("agent_name", None), "column agent_name: is empty"),
    ("empty_prompt", lambda r: r.__setitem__("prompt", []), "column prompt: has no messages"),
    ("tools_kwargs_null", lambda r: r["extra_info"]["tools_kwargs"].pop(TOOL),
     f"column extra_info: tools_kwargs.{TOOL} is null"),
    # An assistant turn with tool calls and no content: the model's template cannot join it (verl's
    # filter would drop such a row without a word).
    ("chat_template_failed", lambda r: r["prompt"].append(
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": TOOL}}]}),
     "column prompt: the model's chat template cannot render it"),
]


@pytest.mark.parametrize(("reason", "spoil", "message"), BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
def test_a_bad_row_is_refused_in_one_line(tmp_path: Path, tiny_model_path: Path, reason: str, spoil: Any,
                                          message: str) -> None:
    rows = _rows(30, "train", kinds=("tool",))
    spoil(rows[20])
    src = _parquet(tmp_path / "rows.parquet", rows)
    with pytest.raises(DataError) as err:
        preprocess(DataSource.parse(str(src)), {"recipe": "verl"}, tmp_path / "out", tokenizer=str(tiny_model_path),
                   max_prompt_length=256)
    text = str(err.value)
    assert "\n" not in text and "1 of 30 records rejected" in text
    assert f"first: {src} row 21: {message}" in text and "(fix: " in text
    (reject,) = [json.loads(x) for x in Path(text.rsplit("see ", 1)[1]).read_text().splitlines()]
    assert (reject["reason"], reject["line"], reject["source"]) == (reason, 21, str(src))
    # Within max_reject_fraction the other rows go through, the bad one listed with its error.
    r = preprocess(DataSource.parse(str(src)), {"recipe": "verl", "max_reject_fraction": 0.05}, tmp_path / "out",
                   tokenizer=str(tiny_model_path), max_prompt_length=256)
    assert r.counts["rejected"] == {reason: 1} and r.counts["written"] == 29


def test_rows_that_need_tools_kwargs_and_have_none_are_refused(tmp_path: Path) -> None:
    rows = [{**r, "extra_info": {k: v for k, v in r["extra_info"].items() if k != "tools_kwargs"}}
            for r in _rows(10, "train", kinds=("tool",))]
    src = _parquet(tmp_path / "rows.parquet", rows)
    with pytest.raises(DataError, match=rf"10 of 10 records rejected .*first: {src} row 1: column extra_info: "
                                        r"need_tools_kwargs is true but the row has no tools_kwargs \(fix: "):
        preprocess(DataSource.parse(str(src)), {"recipe": "verl"}, tmp_path / "out")


def _with(rows: list[dict[str, Any]], **columns: Any) -> list[dict[str, Any]]:
    return [{**r, **{k: (v(r) if callable(v) else v) for k, v in columns.items()}} for r in rows]


BAD_FILES = [
    ("extra_info_string", lambda rows: _with(rows, extra_info=lambda r: json.dumps(r["extra_info"])),
     "column 'extra_info' has type string; verl reads a dict per row"),
    ("tools_kwargs_top_level", lambda rows: _with(rows, tools_kwargs=lambda r: r["extra_info"]["tools_kwargs"]),
     "column 'tools_kwargs': verl's RLHFDataset sets tools_kwargs on every row itself"),
    ("prompt_text", lambda rows: _with(rows, prompt=lambda r: r["prompt"][-1]["content"]),
     "column 'prompt' has type string; recipe verl reads a list of chat messages"),
    ("no_reward_model", lambda rows: [{k: v for k, v in r.items() if k != "reward_model"} for r in rows],
     "column(s) ['reward_model'] not found"),
    ("tools_kwargs_json", lambda rows: _with(rows, extra_info=lambda r: {**r["extra_info"], "tools_kwargs": "{}"}),
     "column 'extra_info': tools_kwargs has type string"),
]


@pytest.mark.parametrize(("name", "change", "message"), BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_a_column_verl_cannot_read_refuses_the_file(tmp_path: Path, name: str, change: Any, message: str) -> None:
    src = _parquet(tmp_path / f"{name}.parquet", change(_rows(20, "train")))
    with pytest.raises(DataError, match=re.escape(message)) as err:
        preprocess(DataSource.parse(str(src)), {"recipe": "verl"}, tmp_path / "out")
    assert str(err.value).startswith(f"{src}: ") and "Fix: " in str(err.value)
    assert not list((tmp_path / "out").glob("*.partial"))


def test_reward_functions_are_checked_per_data_source(tmp_path: Path) -> None:
    rows = _rows(20, "train", kinds=("multi_turn", "math"))
    src = _parquet(tmp_path / "own.parquet", _with(rows, data_source="my/own"))
    with pytest.raises(ConfigError, match=r"data.data_source='my/own'.*no reward function"):
        preprocess(DataSource.parse(str(src)), {"recipe": "verl"}, tmp_path / "o1")
    # Ground truths stored as numbers: verl's GSM8K scorer compares strings, so it never rewards them.
    src = _parquet(tmp_path / "ints.parquet", _with(_rows(20, "train", kinds=("tool",)),
                                                    reward_model=lambda r: {"style": "rule", "ground_truth": 7}))
    with pytest.raises(DataError, match=r"line 1: .*scores the extracted ground truth 7 0.0 .*openai/gsm8k"):
        preprocess(DataSource.parse(str(src)), {"recipe": "verl"}, tmp_path / "o2")
    # A form of one's own for one data_source; the other keeps the recipe's.
    rows = _rows(20, "train", kinds=("tool", "math"))
    src = _parquet(tmp_path / "mixed.parquet", rows)
    plain = {"recipe": "verl", "check_solution": {"lighteval/MATH": "{ground_truth}"}}
    with pytest.raises(DataError, match=r"lighteval/MATH"):
        preprocess(DataSource.parse(str(src)), plain, tmp_path / "o3")
    boxed = {"recipe": "verl", "check_solution": {"lighteval/MATH": "$\\boxed{{{ground_truth}}}$"}}
    r = preprocess(DataSource.parse(str(src)), boxed, tmp_path / "o4")
    assert r.counts["answer_forms"] == {"lighteval/MATH": "$\\boxed{{{ground_truth}}}$",
                                        "openai/gsm8k": "#### {ground_truth}"}


def test_options_that_map_raw_columns_are_refused(tmp_path: Path) -> None:
    src = _verl_dir(tmp_path / "in")
    for key, value in (("system_prompt", "Be brief."), ("prompt_column", "question"), ("data_source", "x/y")):
        with pytest.raises(ConfigError, match=rf"data.{key}=.*does not apply to recipe verl"):
            preprocess(DataSource.parse(str(src)), {"recipe": "verl", key: value}, tmp_path / "out")
    with pytest.raises(ConfigError, match=r"check_solution.openai/gsm8k='#### 1'.*\{ground_truth\}"):
        preprocess(DataSource.parse(str(src)), {"recipe": "verl", "check_solution": {"openai/gsm8k": "#### 1"}},
                   tmp_path / "out")
    (tmp_path / "rows.jsonl").write_text(json.dumps(_row(1, "train", "tool")) + "\n")
    with pytest.raises(ConfigError, match=r"recipe='verl': reads Parquet files and saved datasets"):
        preprocess(DataSource.parse(str(tmp_path / "rows.jsonl")), {"recipe": "verl"}, tmp_path / "out")
    # The other recipes point a verl parquet at this one.
    with pytest.raises(DataError, match=r"\['answer'\] not found .*already in verl's schema.*take recipe verl"):
        preprocess(DataSource.parse(str(src)), {"recipe": "generic"}, tmp_path / "out")
    with pytest.raises(DataError, match=r"column 'prompt' has type list.*take recipe verl"):
        preprocess(DataSource.parse(str(src)), {"recipe": "generic", "answer_column": "data_source"}, tmp_path / "out")


def test_a_saved_dataset_in_verl_schema(tmp_path: Path) -> None:
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(_rows(30, "train")),
                               "test": datasets.Dataset.from_list(_rows(6, "test", start=1000))})
    dd.save_to_disk(str(tmp_path / "saved"))
    r = preprocess(DataSource.parse(str(tmp_path / "saved")), {"recipe": "verl"}, tmp_path / "out")
    assert (r.counts["train_rows"], r.counts["val_rows"]) == (30, 6)
    assert r.counts["length_filter"].startswith("off") and r.counts["rlhf_dataset"]["length_filter"] is False
    assert pq.read_table(r.train_path).to_pylist() == dd["train"].to_list()


@pytest.mark.integration
def test_multi_turn_and_tool_rows_pass_the_preflight(tmp_path: Path, tiny_model_path: Path, ray_cluster: Any) -> None:
    """The preflight job submitted to a real local Ray cluster, given the preprocessed verl rows: verl's
    config, its RLHFDataset with the run's tokenizer, generation and the reward check all pass."""
    from verl_pipeline import steps
    from verl_pipeline.constants import Mode
    from verl_pipeline.profiles import build_run_spec
    from verl_pipeline.rundir import RunDir
    from verl_pipeline.trainer.render import render_job

    src = _verl_dir(tmp_path / "in", n_train=48, n_test=8, kinds=("multi_turn", "tool"))
    for split in ("train", "test"):  # a parquet without extra_info.index: verl counts it as 0
        path = src / f"{split}.parquet"
        rows = pq.read_table(path).to_pylist()
        _parquet(path, [{**r, "extra_info": {k: v for k, v in r["extra_info"].items() if k != "index"}} for r in rows])
    spec = build_run_spec({"recipe": "verl", "data_source": str(src), "total_training_steps": 3},
                          run_name=f"pytest/verl-rows-preflight-{os.getpid()}")
    data = steps.preprocess(spec, out_root=tmp_path / "data")
    assert data.counts["train_rows"] == 48
    job = render_job(spec, mode=Mode.PREFLIGHT, train_files=data.train_path, val_files=data.val_path,
                     model_path=str(tiny_model_path), length_filter=data.counts["length_filter"])
    client = ray_cluster.client()
    job_id = f"verl-rows-preflight-{os.getpid()}"
    client.submit(entrypoint=job.entrypoint, submission_id=job_id, runtime_env=job.runtime_env)
    deadline = time.monotonic() + 600
    while not (info := client.get_job(job_id)).status.is_terminal():
        assert time.monotonic() < deadline, client.logs(job_id)[-3000:]
        time.sleep(1)
    summary_file = RunDir(spec.run_dir).preflight_file
    assert info.status.value == "SUCCEEDED" and summary_file.is_file(), client.logs(job_id)[-3000:]
    summary = json.loads(summary_file.read_text())
    assert summary["ok"], summary
    train = summary["checks"]["data"]["train"]
    assert train["rlhf_dataset_len"] == 48 and train["first_raw_prompt_messages"] == 4
    assert summary["checks"]["reward"]["train"]["not_one"] == 0


def test_the_example_in_docs_data_md(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """docs/data.md's example as a user runs it: its Python writes the parquet, its command preprocesses it."""
    import shlex

    from verl_pipeline.cli import main

    page = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    section = page.split("## Rows already in verl's schema", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    command = section.split("```bash\n", 1)[1].split("```", 1)[0].strip()
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/data.md", "exec"), {})
    args = [a.replace("$PWD", str(tmp_path)).replace("/tmp/out", str(tmp_path / "out")) for a in shlex.split(command)]
    assert args[0] == "verl-pipeline"
    assert main(args[1:]) == 0
    out = json.loads(capsys.readouterr().out)
    c = out["counts"]
    assert (c["train_rows"], c["val_rows"], c["rejected"], c["agent_names"]) == (64, 8, {}, {"tool_agent": 72})
    assert c["rlhf_dataset"]["train"]["tools_kwargs_rows"] == c["rlhf_dataset"]["train"]["kept"] > 0
    assert pq.read_table(out["train_path"]).equals(pq.read_table(tmp_path / "my-task" / "train.parquet"))
