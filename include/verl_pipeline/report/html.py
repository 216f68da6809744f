"""``report.html``: one self-contained page (inline style, no scripts) showing a :class:`Report`.

The plots are referenced by relative file name, so the page works from the report directory
itself, from a copy of it, and when served by the UI plugin under any prefix.
"""

from __future__ import annotations

from html import escape
from typing import Any

from verl_pipeline.jobs.restart_budget import RestartOutcome
from verl_pipeline.jobs.startup.actors import by_class
from verl_pipeline.jobs.startup.phases import PhaseTime
from verl_pipeline.report.build import Report, Series
from verl_pipeline.report.gpu import MIB_PER_GIB, GpuUsage
from verl_pipeline.report.restart_history import RestartSummary
from verl_pipeline.report.scaling_check import MIN_GPU_UTILIZATION_PCT, under_used
from verl_pipeline.trainer import metrics as m

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:70em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
th{background:#f4f4f4}.ok{color:#11772d}.bad{color:#b00020}.flag{background:#fff4e5;padding:.5em 1em;margin:.5em 0}
img{max-width:100%;margin:.5em 0}
"""


def _num(value: float | None, unit: str = "", digits: int = 4) -> str:
    if value is None:
        return "—"
    return f"{value:.{digits}g}{unit}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    hours, rest = divmod(int(seconds + 0.5), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours} h {minutes} m {secs} s" if hours else f"{minutes} m {secs} s"


def _table(rows: list[tuple[str, str]], head: tuple[str, ...] = ()) -> str:
    out = ["<table>"]
    if head:
        out.append("<tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>")
    out += [f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows]
    out.append("</table>")
    return "".join(out)


def _grid(head: tuple[str, ...], rows: list[tuple[Any, ...]]) -> str:
    out = ["<table><tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>"]
    out += ["<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows]
    return "".join(out) + "</table>"


def _series(s: Series | None) -> str:
    if s is None:
        return "—"
    return f"final {s.final:.4g}, best {s.best:.4g} (step {s.best_step}), median {s.median:.4g}"


def _summary(r: Report) -> str:
    rows = [
        ("status", r.status.value), ("mode", r.run.mode or "—"), ("profile", r.run.profile),
        ("steps", f"{r.steps_done} / {r.run.total_steps}"),
        ("training shape", f"{r.run.nnodes} node(s) x {r.run.n_gpus_per_node} GPU(s)"),
        ("wall time", _duration(r.wall_time_s)), ("GPU-hours", _num(r.gpu_hours, digits=3)),
        (m.SCORE, _series(r.score)),
        *[(name, _series(s)) for name, s in r.validation.items()],
        ("response_length/mean", _series(r.response_length)),
        ("throughput per GPU (perf/throughput, median)", _num(r.throughput_per_gpu, " tokens/s")),
        ("throughput, whole run (median)", _num(r.throughput_total, " tokens/s")),
        ("time per step (perf/time_per_step, median)", _num(r.time_per_step_s, " s")),
        ("MFU, actor (perf/mfu/actor, median)", _num(r.mfu_actor)),
        ("peak GPU memory allocated / reserved", f"{_num(r.peak_memory_allocated_gb, ' GB')} / "
                                                  f"{_num(r.peak_memory_reserved_gb, ' GB')}"),
        ("actor/grad_norm (median / highest)", f"{_num(r.grad_norm_median)} / {_num(r.grad_norm_max)}"),
    ]
    if not r.steps_done:  # a run without training steps: only what it has
        rows = [(k, v) for k, v in rows if v.strip("— /")]
    return _table(rows)


def _attempts(r: Report) -> str:
    if not r.attempts:
        return "<p>No attempt was submitted.</p>"
    rows = [(a.attempt, a.submission_id, a.resumed_from_step or "— (from scratch)",
             "—" if a.first_step is None else f"{a.first_step} to {a.last_step}",
             _duration(a.time_to_first_step_s),
             a.segment if a.segment == 1 else f"{a.segment}: merged weights, optimizer state lost")
            for a in r.attempts]
    extra = f"<p>Steps redone after resuming: {r.steps_redone}.</p>" if r.steps_redone else ""
    return (_grid(("attempt", "Ray job", "resumed from step", "steps logged", "submit to first step", "segment"),
                  rows) + extra + "<p>Submit to first step: from the attempt's submission to its first training "
            "step's arrival, as the pipeline's metrics reader saw it (verl's file logger records no time with "
            "a step); — where no reader saw one.</p>")


def _startup(r: Report) -> str:
    """Each attempt's time to its first step, phase by phase: what starting (or a restart) cost, and where."""
    if not r.attempts or r.run.mode == "preflight":  # a preflight job has no such start
        return ""
    phases = [t.phase for t in r.attempts[0].startup]
    rows = [(a.attempt, *(_phase_cell(t) for t in a.startup)) for a in r.attempts]
    return ("<h2>Start-up, phase by phase</h2><p>Seconds each phase of every attempt's start took, from its "
            "submission to its first training step. A phase ends when verl or vLLM printed the line that ends it "
            "(the table of those lines: jobs/startup/markers.py), as the line's stamp says; validation and "
            "the first step, whose lines carry none, end when the pipeline's log reader got them (every 10 s at "
            "the default poll), so those two are good to about 10 s. <i>skipped</i>: the job was rendered "
            "without the phase (validation before training on an attempt that resumes, or with "
            "trainer.val_before_train=false); the phase after it counts from the one before. <i>unknown</i>: the "
            "line was not seen (or it differs); the phase after it is unknown too.</p>"
            + _grid(("attempt", *(p.words for p in phases)), rows))


def _actor_starts(r: Report) -> str:
    """How each Ray actor of every attempt's start came up: where a phase's seconds went."""
    rows = [(a.attempt, g.name, len(g.actors), ", ".join(sorted({x.node for x in g.actors if x.node})) or "—",
             f"{g.first_asked_s:.0f} s", g.cell("waiting_s"), g.cell("process_s"), g.cell("load_s"), g.cell("init_s"),
             "—" if g.last_ready_s is None else f"{g.last_ready_s:.0f} s")
            for a in r.attempts if a.actors for g in by_class(a.actors)]
    if not rows:
        return ""
    return ("<h3>Ray actors of each start</h3><p>Every actor the job created, by class, as Ray recorded it (its "
            "state API, read at the first step): when it was asked for and when the last of the class was "
            "ready, after the submission; between them, <i>waiting</i> for a worker (free resources, the runtime "
            "env), the worker <i>process</i> starting (0 s: a worker already running), <i>class load</i> (for a "
            "class Ray can import, as verl's worker classes: its module and all that module imports, torch, vLLM, "
            "verl) and <i>__init__</i>. Medians, with the slowest "
            "actor where several differ. vLLM's engine processes are not Ray actors: their start shows in the "
            "engine start phase above, not here.</p>"
            + _grid(("attempt", "class", "actors", "nodes", "asked at", "waiting", "process", "class load",
                     "__init__", "ready at"), rows))


def _phase_cell(t: PhaseTime) -> str:
    if t.skipped:
        return "skipped"
    if t.duration_s is not None:
        return f"{t.duration_s:.0f} s"
    return "unknown" if t.ended_after_s is None else f"unknown (done at {t.ended_after_s:.0f} s)"


def _timing(r: Report) -> str:
    if not r.timing_s and not r.timing_outside_step_s:
        return ""
    rows = [(f"{m.TIMING_PREFIX}{k}", f"{v:.4g} s" + (f" ({r.phase_share[k]:.0%} of all step time)"
                                                      if k in r.phase_share else ""))
            for k, v in sorted(r.timing_s.items(), key=lambda kv: -kv[1])]
    out = ("<h2>Time per step by phase</h2><p>Median seconds over the steps that ran each phase; the share is "
           "of all step time, over every step (the phases of a step add up to at most 100%).</p>" + _table(rows))
    if r.timing_outside_step_s:
        apart = [(f"{m.TIMING_PREFIX}{k}" + (" (validation)" if k == "testing" else ""), f"{v:.4g} s")
                 for k, v in sorted(r.timing_outside_step_s.items())]
        out += ("<p>Timed apart from the step (not in timing_s/step, not a share of it), median over the steps "
                "that ran it:</p>" + _table(apart))
    return out


def _critic(r: Report) -> str:
    c = r.critic
    if c is None:
        return ""
    rows = [(name, f"{t.first:.4g} (step {t.first_step}) → {t.final:.4g} (step {t.final_step}), median {t.median:.4g}")
            for name, t in c.trends.items()]
    rows += [(f"{name} (median)", f"{v:.4g} s") for name, v in c.timing_s.items()]
    if c.share_of_step is not None:
        rows.append(("critic's share of step time (values + update_critic)", f"{c.share_of_step:.0%}"))
    return ("<h2>Critic</h2><p>PPO's value function: its loss should fall and the explained variance rise; a "
            "resumed attempt carries on from the critic's checkpoint (see the critic plot).</p>" + _table(rows))


def restarts_html(s: RestartSummary | None) -> str:
    """The restarts section: the budget's headline and each decision (empty for a report without a restart
    record, e.g. rebuilt from old files)."""
    if s is None:
        return ""
    out = f"<h2>Restarts</h2><p>{escape(s.headline())}</p>"
    if not s.decisions:
        return out
    rows = []
    for d in s.decisions:
        did = (f"checkpoint {d.resumed_from} → {d.checkpoint_after}" if d.progressed else
               "no step" if d.last_step is None else f"to step {d.last_step}, no new checkpoint")
        then = "budget used up: run failed" if d.outcome == RestartOutcome.EXHAUSTED.value else \
            f"restarted after {d.delay_s:g} s"
        rows.append((d.attempt, d.reason, did, d.no_progress, d.left, then))
    return out + _grid(("attempt", "failure", "progress", "in a row without progress",
                        "restarts without progress left", "then"), rows)


def _checks(r: Report) -> str:
    if not r.checks:
        return ""
    rows = "".join(f"<tr><td>{escape(c.name)}</td><td class=\"{'ok' if c.ok else 'bad'}\">"
                   f"{'passed' if c.ok else 'FAILED'}</td><td>{escape(c.detail)}</td></tr>" for c in r.checks)
    return f"<h2>Preflight checks</h2><table><tr><th>check</th><th>result</th><th>detail</th></tr>{rows}</table>"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}%"


def _gpu_row(g: GpuUsage) -> tuple[str, ...]:
    memory = "—"
    if g.peak_memory_used_mib is not None and g.memory_total_mib:
        memory = (f"{g.peak_memory_used_mib / MIB_PER_GIB:.1f} / {g.memory_total_mib / MIB_PER_GIB:.1f} GiB "
                  f"({_pct(g.peak_memory_pct)})")
    return (g.label, g.uuid or "—", str(len(g.node_ids)), _pct(g.mean_utilization_pct) + (" (low)" if under_used(g)
                                                                                          else ""),
            _pct(g.median_utilization_pct), _pct(g.min_utilization_pct), f"{g.samples_in_window} of {g.samples}",
            memory)


def _gpus(r: Report) -> str:
    out = "<h2>GPU utilisation per GPU</h2>"
    if not r.gpus:
        return out + ("<p>No GPU readings: the run's cluster reported no GPUs (a CPU cluster, or a run from before "
                      "the pipeline recorded them).</p>")
    out += (f"<p>From Ray's node summary, sampled by the waiter; one row per physical GPU (by its UUID: a raylet "
            f"that restarts comes back under a new Ray node id with the same GPUs). Mean, median and lowest are "
            f"over the training window (each attempt's first step to its last; start-up excluded), where the aim "
            f"is above {MIN_GPU_UTILIZATION_PCT:.0f}%. Peak memory is the most the GPU used at any sample.</p>")
    out += _grid(("GPU", "UUID", "Ray node ids", "mean", "median", "lowest", "samples in the training window",
                  "peak memory used / total"), [_gpu_row(g) for g in r.gpus])
    if not any(g.samples_in_window for g in r.gpus):
        out += ("<p>No sample fell in the training window (no attempt's first step was seen before its last, or "
                "the run never trained): utilisation is not judged.</p>")
    out += "".join(f"<img src=\"{escape(name)}\" alt=\"GPU utilisation and memory, host {escape(host)}\">"
                   for host, name in r.gpu_plots.items())
    return out


def _scaling(r: Report) -> str:
    parts = ["<h2>Scaling check</h2>"]
    if r.comparisons:
        parts.append(_grid(("earlier run", "its nodes", "its tokens/s/GPU", "this run's nodes",
                            "this run's tokens/s/GPU", "efficiency vs linear"),
                           [(c.other_run_key, c.other_nnodes, f"{c.other_throughput_per_gpu:.4g}", c.nnodes,
                             f"{c.throughput_per_gpu:.4g}", f"{c.efficiency:.0%}") for c in r.comparisons]))
    elif r.scaling_point is not None:
        parts.append("<p>No earlier successful run of this profile at another node count to compare with.</p>")
    else:
        parts.append("<p>Not checked: the run reported no training throughput.</p>")
    return "".join(parts)


def _flags(r: Report) -> str:
    parts = ["<h2>Flags</h2>"]
    parts += [f"<div class=\"flag\"><b>{escape(f.kind.value)}</b>: {escape(f.evidence)}<br>Remedy: "
              f"{escape(f.remedy)}</div>" for f in r.flags]
    if not r.flags:
        parts.append("<p>No flag: generation, memory, per-GPU throughput, GPU utilisation and the gradient are "
                     "within the limits (where the run reported them).</p>" if r.steps_done else
                     "<p>No flag (no training step to judge).</p>")
    return "".join(parts)


def _learning(r: Report) -> str:
    """The learning verdict's sentence, first thing under the notes."""
    v = r.learning
    if v is None:
        return ""
    css = "" if v.learned is None else ' class="ok"' if v.learned else ' class="bad"'
    return f"<p{css}><b>{escape(v.words)}</b></p>"


def _evaluation(r: Report) -> str:
    """The models side by side on the evaluation rows, the promotion verdict, a few responses."""
    ev, verdict = r.evaluation, r.promotion
    if ev is None and verdict is None:
        return ""
    parts = ["<h2>Evaluation</h2>"]
    if verdict is not None:
        parts.append(f"<p class=\"{'ok' if verdict.promoted else 'bad'}\"><b>{escape(verdict.line())}</b></p>")
    if ev is None:
        return "".join(parts)
    scored = max((s.n for s in ev.models.values()), default=0)
    how = (f"transformers on CPUs, {scored} of {ev.rows_total} rows: a smoke evaluation, not a measure of quality"
           if ev.smoke else "vLLM")
    parts.append(f"<p>Split <code>{escape(ev.split)}</code> ({escape(ev.data_path)}, content "
                 f"{escape(ev.data_hash[:12])}), generated by {escape(how)}; sampling {escape(str(ev.sampling))}. "
                 "verl's own validation curve is in the validation plot.</p>")
    rows: list[tuple[str, ...]] = [(role.value, _num(s.mean_reward), f"{s.pass_rate:.0%}",
                                    _num(s.mean_response_length, digits=3), str(s.n))
                                   for role, s in ev.models.items()]
    rows += [(role, f"not scored: {err}", "", "", "") for role, err in ev.errors.items()]
    parts.append(_grid(("model", "mean reward", "pass rate", "mean response length (tokens)", "rows"), rows))
    examples = [(role.value, e.prompt[-200:], e.response[:200], e.ground_truth[:80], _num(e.score))
                for role, s in ev.models.items() for e in s.examples]
    if examples:
        parts.append("<h3>Example responses</h3>"
                     + _grid(("model", "prompt (end)", "response", "ground truth", "score"), examples))
    return "".join(parts)


def render_html(r: Report) -> str:
    """The whole page; plots are ``<img src="<file>">`` of the files in ``r.plots``."""
    title = f"Run report — {r.run.run_name}"
    notes = "".join(f"<p><b>{escape(n)}</b></p>" for n in r.notes)
    # Each PNG carries its own title.
    plots = "".join(f"<img src=\"{escape(name)}\" alt=\"{escape(t)}\">" for name, t in r.plots.items())
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body><h1>{escape(title)}</h1>{notes}{_learning(r)}"
            f"{_summary(r)}{_evaluation(r)}"
            f"<h2>Attempts</h2>{_attempts(r)}{_startup(r)}{_actor_starts(r)}{restarts_html(r.restarts)}{_checks(r)}{_critic(r)}"
            f"{_timing(r)}{_gpus(r)}{_scaling(r)}{_flags(r)}"
            + (f"<h2>Plots</h2>{plots}" if plots else "") + "</body></html>\n")
