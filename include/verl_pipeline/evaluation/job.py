"""The evaluation job: ``python -m verl_pipeline.evaluation.job --request JSON``, run as a Ray job.

It reads the request (:class:`~verl_pipeline.evaluation.request.EvaluationRequest`), the rows (verl's
RLHF parquet) and their content hash (the file's sha256), picks the engine (vLLM on a node with a GPU and
vLLM: every row; else transformers on a sample, the first ``sample`` rows, a smoke evaluation), loads the
reward function, then for each model: the greedy responses (:mod:`verl_pipeline.evaluation.generate`)
and their scores (:mod:`verl_pipeline.evaluation.score`). A model that fails to load, generate or be
scored becomes one line in the record's ``errors``, and the others are still scored. The record
(:class:`~verl_pipeline.scores.Evaluation`) is printed after :data:`REPORT_MARKER`, as the environment
probe prints its report; :func:`parse_report` finds it in the job's log.

What fails the whole job (exit 2, one line on stderr): a request that does not parse, rows that cannot be
read, a reward function that cannot be loaded, vLLM asked for where it cannot run.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from verl_pipeline.cluster.probe import parse_report as _marked_json
from verl_pipeline.evaluation.generate import choose_engine, responses, visible_gpus, vllm_installed
from verl_pipeline.evaluation.request import EvaluationRequest
from verl_pipeline.evaluation.score import Row, Scorer, model_score, read_rows, reward_function
from verl_pipeline.exceptions import ConfigError, PipelineError
from verl_pipeline.paths import file_sha256
from verl_pipeline.scores import Engine, Evaluation, ModelScore, Role

log = logging.getLogger(__name__)

#: The line prefix the job prints before its record (one line of JSON).
REPORT_MARKER = "VERL_PIPELINE_EVALUATION "
COMMAND = ("python", "-m", "verl_pipeline.evaluation.job")
#: The sampling an evaluation uses: greedy.
TEMPERATURE = 0.0


def one_line(error: BaseException) -> str:
    """An error as one line: its type and its message's first line."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    return first if isinstance(error, PipelineError) else f"{type(error).__name__}: {first}"


def _score_model(request: EvaluationRequest, role: Role, rows: list[Row], engine: Engine, scorer: Scorer) -> ModelScore:
    path = request.models[role]
    t0 = time.monotonic()
    answers = responses(engine, path, [r.messages for r in rows], max_new_tokens=request.max_new_tokens,
                        seed=request.seed, gpu_memory_utilization=request.gpu_memory_utilization)
    scores = scorer.scores(rows, answers, where=f"{role.value} model {path}: {request.data_path}")
    log.info("%s model %s: %d rows generated and scored in %.1fs", role.value, path, len(rows),
             time.monotonic() - t0)
    return model_score(path, rows, answers, scores, run_dir=request.run_dirs.get(role))


def evaluate_models(request: EvaluationRequest) -> Evaluation:
    """Score every model of ``request`` on its rows (runs inside the job)."""
    t0 = time.monotonic()
    rows = read_rows(request.data_path)
    data_hash = file_sha256(Path(request.data_path))
    engine = choose_engine(request.engine, gpus=visible_gpus(), vllm_found=vllm_installed())
    scored = rows if engine is Engine.VLLM else rows[:request.sample]
    scorer = reward_function(request.reward)
    log.info("Evaluating %s on %d of %d rows of %s with %s (reward %s)", sorted(r.value for r in request.models),
             len(scored), len(rows), request.data_path, engine.value, scorer.fn.label)
    models: dict[Role, ModelScore] = {}
    errors: dict[str, str] = {}
    for role in Role:
        if role not in request.models:
            continue
        try:
            models[role] = _score_model(request, role, scored, engine, scorer)
        except Exception as e:  # one model's failure is its line in errors; the others are still scored
            # The traceback of an unforeseen failure goes to the job's log; a known one is its message.
            log.warning("%s model %s was not scored: %s", role.value, request.models[role], e,
                        exc_info=not isinstance(e, PipelineError))
            errors[role.value] = one_line(e)
    sampling = {"temperature": TEMPERATURE, "max_new_tokens": request.max_new_tokens, "seed": request.seed,
                "sample": request.sample if engine is Engine.TRANSFORMERS else None}
    return Evaluation(data_path=request.data_path, data_hash=data_hash, split=request.split, engine=engine,
                      sampling=sampling, models=models, wall_s=round(time.monotonic() - t0, 3),
                      rows_total=len(rows) if engine is Engine.TRANSFORMERS else None, errors=errors)


def parse_report(logs: str) -> Evaluation | None:
    """The record the job printed in ``logs`` (None when it printed none, or a cut one)."""
    data = _marked_json(logs, REPORT_MARKER)
    return None if data is None else Evaluation.from_dict(data)


def read_request(text: str) -> EvaluationRequest:
    """The request in ``--request``'s JSON (a ConfigError naming what is wrong with it)."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ConfigError("--request", text[:80], f"is not JSON ({e})", "EvaluationRequest.to_dict's JSON") from None
    if not isinstance(data, dict):
        raise ConfigError("--request", text[:80], "is not a JSON object", "EvaluationRequest.to_dict's JSON")
    return EvaluationRequest.from_dict(data)


def main(argv: list[str] | None = None) -> int:
    """The job's entrypoint: prints the record after the marker line; exit 2 with one line when it cannot."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="verl_pipeline.evaluation.job")
    parser.add_argument("--request", required=True, help="JSON of an EvaluationRequest")
    args = parser.parse_args(argv)
    try:
        evaluation = evaluate_models(read_request(args.request))
    except PipelineError as e:
        print(f"verl_pipeline.evaluation.job: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(REPORT_MARKER + json.dumps(evaluation.to_dict(), sort_keys=True, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
