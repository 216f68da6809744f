"""Recipes: how raw records become verl rows (prompt, ground truth, data_source), from ``configs/recipes``.

A recipe is a YAML file (``gsm8k``, ``math``, ``generic``) whose keys any data option of the same
name replaces, so a user's own data needs no code: a prompt column or template, an answer column
and an extraction rule, the ``data_source`` verl scores, optional system prompt and instruction.
A recipe file with ``rows: verl`` (``verl``) reads rows already in verl's schema and keeps them as
they are (:class:`VerlRecipe`): only how a correct answer reads per data_source and the reward
function apply to it.
"""

from __future__ import annotations

import re
import string
from dataclasses import asdict, dataclass, field
from typing import Any

from verl_pipeline.exceptions import ConfigError
from verl_pipeline.paths import configs_dir
from verl_pipeline.trainer.reward import ANSWER_FORM, ANY_DATA_SOURCE, answer_forms

EXTRACTIONS = ("gsm8k", "boxed", "regex", "column")
#: Keys of a recipe that data options may replace.
RECIPE_KEYS = ("data_source", "ability", "prompt_column", "prompt_template", "answer_column", "answer_extraction",
               "answer_regex", "instruction", "system_prompt", "extra_columns", "check_solution",
               "custom_reward_path", "custom_reward_name", "custom_reward_kwargs")
#: The keys a ``rows: verl`` recipe has (data options may replace them); the other recipe keys map raw
#: columns, which rows already in verl's schema do not need.
VERL_RECIPE_KEYS = ("check_solution", "custom_reward_path", "custom_reward_name", "custom_reward_kwargs")
#: The value of a recipe file's ``rows`` key for rows already in verl's schema.
VERL_ROWS = "verl"
GSM8K_PATTERN = r"####\s*(?P<answer>-?[0-9][0-9,]*(?:\.[0-9]+)?)\s*$"
_GSM8K = re.compile(GSM8K_PATTERN)


def list_recipes() -> list[str]:
    folder = configs_dir() / "recipes"
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


@dataclass(frozen=True)
class Recipe:
    name: str
    data_source: str
    ability: str
    prompt_column: str | None
    prompt_template: str | None
    answer_column: str
    answer_extraction: str
    answer_regex: str | None = None
    instruction: str | None = None
    system_prompt: str | None = None
    extra_columns: tuple[str, ...] = field(default_factory=tuple)
    check_solution: str = "{ground_truth}"
    custom_reward_path: str | None = None
    custom_reward_name: str = "compute_score"
    #: Keyword arguments verl passes the function (``reward.custom_reward_function.reward_kwargs``).
    custom_reward_kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["extra_columns"] = list(self.extra_columns)
        return d

    @property
    def template_fields(self) -> list[str]:
        """Columns the prompt is made of (the template's fields, or the prompt column)."""
        if self.prompt_template is not None:
            return [f for _, f, _, _ in string.Formatter().parse(self.prompt_template) if f is not None]
        return [str(self.prompt_column)]


@dataclass(frozen=True)
class VerlRecipe:
    """Rows already in verl's schema, kept as they are: how a correct answer reads for each data_source
    (``check_solution``: ``(data_source or "*", form)`` pairs) and the reward function that scores them."""

    name: str
    check_solution: tuple[tuple[str, str], ...]
    custom_reward_path: str | None = None
    custom_reward_name: str = "compute_score"
    custom_reward_kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "rows": VERL_ROWS, "check_solution": dict(self.check_solution),
                "custom_reward_path": self.custom_reward_path, "custom_reward_name": self.custom_reward_name,
                "custom_reward_kwargs": dict(self.custom_reward_kwargs)}

    def answer_form(self, data_source: str) -> str:
        """How a correct answer to a row of ``data_source`` reads (``{ground_truth}`` in it)."""
        forms = dict(self.check_solution)
        return forms.get(data_source, forms.get(ANY_DATA_SOURCE, "{ground_truth}"))

    def scoring_recipe(self, data_source: str) -> Recipe:
        """The facts the reward check reads (data_source, answer form, reward function) as a :class:`Recipe`."""
        return Recipe(name=self.name, data_source=data_source, ability="", prompt_column="prompt",
                      prompt_template=None, answer_column="reward_model", answer_extraction="column",
                      check_solution=self.answer_form(data_source), custom_reward_path=self.custom_reward_path,
                      custom_reward_name=self.custom_reward_name, custom_reward_kwargs=dict(self.custom_reward_kwargs))


def _answer_forms(value: Any, key: str) -> dict[str, str]:
    """``check_solution`` of a ``rows: verl`` recipe: a string (every data_source) or a mapping
    ``{data_source: form}`` (``"*"``: the others), each form with ``{ground_truth}``."""
    forms = {ANY_DATA_SOURCE: value} if isinstance(value, str) else value
    if not isinstance(forms, dict) or not forms:
        raise ConfigError(key, value, "must be a string or a mapping of data_source to answer form",
                          "check_solution: {openai/gsm8k: '#### {ground_truth}', '*': '{ground_truth}'}")
    for source, form in forms.items():
        if not isinstance(source, str) or not isinstance(form, str) or "{ground_truth}" not in form:
            raise ConfigError(f"{key}.{source}", form, "must be a string containing {ground_truth}",
                              "'#### {ground_truth}'")
        try:
            form.format(ground_truth="1")
        except (IndexError, KeyError, ValueError) as e:
            raise ConfigError(f"{key}.{source}", form, f"is not a valid format string ({e})",
                              "{{ and }} for literal braces: 'The answer is \\boxed{{{ground_truth}}}.'") from None
    return dict(forms)


def _reward_kwargs(merged: dict[str, Any]) -> dict[str, Any]:
    kwargs = merged.get("custom_reward_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ConfigError("data.custom_reward_kwargs", kwargs, "must be a mapping", "custom_reward_kwargs: {scale: 2}")
    return dict(kwargs)


def _verl_recipe(name: str, raw: dict[str, Any], options: dict[str, Any], path: Any) -> VerlRecipe:
    unknown = sorted(set(raw) - set(VERL_RECIPE_KEYS))
    if unknown:
        raise ConfigError(f"{path}:{unknown[0]}", raw[unknown[0]], "is not a key of a rows: verl recipe",
                          f"one of {VERL_RECIPE_KEYS}")
    mapping = sorted(k for k in options if k in RECIPE_KEYS and k not in VERL_RECIPE_KEYS)
    if mapping:
        raise ConfigError(f"data.{mapping[0]}", options[mapping[0]],
                          f"does not apply to recipe {name}: its rows are already in verl's schema and kept as "
                          "they are", "leave it out (a system message or instruction goes into each row's "
                          "prompt), or use recipe generic for raw columns")
    _answer_forms(raw.get("check_solution") or ANSWER_FORM, f"{path}:check_solution")
    given = options.get("check_solution")
    if given is not None:
        _answer_forms(given, "data.check_solution")
    forms = _answer_forms(answer_forms(raw.get("check_solution"), given), "data.check_solution")
    merged = {**raw, **{k: v for k, v in options.items() if k in VERL_RECIPE_KEYS}}
    for key in ("custom_reward_path", "custom_reward_name"):
        if merged.get(key) is not None and not isinstance(merged[key], str):
            raise ConfigError(f"data.{key}", merged[key], "must be a string or null")
    return VerlRecipe(name=name, check_solution=tuple(sorted(forms.items())),
                      custom_reward_path=merged.get("custom_reward_path") or None,
                      custom_reward_name=str(merged.get("custom_reward_name") or "compute_score"),
                      custom_reward_kwargs=_reward_kwargs(merged))


def load_recipe(name: str, options: dict[str, Any]) -> Recipe | VerlRecipe:
    """The recipe ``name`` from ``configs/recipes`` with ``options`` (same keys) applied, validated."""
    import yaml

    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise ConfigError("data.recipe", name, "is not a recipe name", f"one of {list_recipes()}")
    path = configs_dir() / "recipes" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError("data.recipe", name, f"no such recipe in {path.parent}", f"one of {list_recipes()}")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(str(path), type(raw).__name__, "a recipe must be a YAML mapping")
    raw.pop("description", None)
    rows = raw.pop("rows", None)
    if rows is not None:
        if rows != VERL_ROWS:
            raise ConfigError(f"{path}:rows", rows, "unknown row schema",
                              f"rows: {VERL_ROWS} (rows already in verl's schema), or leave it out")
        return _verl_recipe(name, raw, options, path)
    unknown = sorted(set(raw) - set(RECIPE_KEYS))
    if unknown:
        raise ConfigError(f"{path}:{unknown[0]}", raw[unknown[0]], "unknown recipe key", f"one of {RECIPE_KEYS}")
    merged = {**raw, **{k: v for k, v in options.items() if k in RECIPE_KEYS}}
    if merged.get("prompt_template") is not None:
        merged["prompt_column"] = None if "prompt_column" not in options else merged["prompt_column"]
    for key in ("data_source", "ability", "answer_column"):
        if not isinstance(merged.get(key), str) or not merged[key].strip():
            raise ConfigError(f"data.{key}", merged.get(key), "must be a non-empty string", f"data.{key}: <value>")
    extraction = merged.get("answer_extraction", "column")
    if extraction not in EXTRACTIONS:
        raise ConfigError("data.answer_extraction", extraction, "unknown extraction", f"one of {list(EXTRACTIONS)}")
    template, column = merged.get("prompt_template"), merged.get("prompt_column")
    if (template is None) == (column is None):
        raise ConfigError("data.prompt_column", column, "set exactly one of prompt_column and prompt_template",
                          "prompt_column: question  or  prompt_template: '{title}\\n{body}'")
    if template is not None:
        try:
            fields = [f for _, f, spec, conv in string.Formatter().parse(str(template)) if f is not None]
        except ValueError as e:
            raise ConfigError("data.prompt_template", template, f"is not a valid template ({e})",
                              "'{question}' with {{ and }} for literal braces") from None
        if not fields or any(not f or not re.fullmatch(r"[\w.\- ]+", f) for f in fields):
            raise ConfigError("data.prompt_template", template, "needs one or more {column} fields, plain names only",
                              "'{question}\\n\\nContext: {context}'")
    regex = merged.get("answer_regex")
    if extraction == "regex":
        if not isinstance(regex, str) or not regex:
            raise ConfigError("data.answer_regex", regex, "is required when answer_extraction is regex",
                              "answer_regex: 'Answer: (?P<answer>.+)$'")
        try:
            compiled = re.compile(regex)
        except re.error as e:
            raise ConfigError("data.answer_regex", regex, f"is not a valid regular expression ({e})") from None
        if "answer" not in compiled.groupindex:
            raise ConfigError("data.answer_regex", regex, "needs a named group `answer`", "'#### (?P<answer>\\d+)'")
    extras = merged.get("extra_columns") or []
    if isinstance(extras, str) or not all(isinstance(c, str) and c for c in extras):
        raise ConfigError("data.extra_columns", extras, "must be a list of column names", "extra_columns: [id]")
    reserved = {"split", "index", "answer", "question"}
    if reserved & set(extras):
        raise ConfigError("data.extra_columns", extras, f"must not use the reserved names {sorted(reserved)}",
                          "rename the column or leave it out")
    check = str(merged.get("check_solution") or "{ground_truth}")
    if "{ground_truth}" not in check:
        raise ConfigError("data.check_solution", check, "must contain {ground_truth}", "'#### {ground_truth}'")
    for key in ("instruction", "system_prompt", "custom_reward_path"):
        if merged.get(key) is not None and not isinstance(merged[key], str):
            raise ConfigError(f"data.{key}", merged[key], "must be a string or null")
    return Recipe(
        name=name, data_source=merged["data_source"].strip(), ability=merged["ability"].strip(),
        prompt_column=column, prompt_template=template, answer_column=merged["answer_column"],
        answer_extraction=extraction, answer_regex=regex, instruction=merged.get("instruction") or None,
        system_prompt=merged.get("system_prompt") or None, extra_columns=tuple(extras), check_solution=check,
        custom_reward_path=merged.get("custom_reward_path") or None,
        custom_reward_name=str(merged.get("custom_reward_name") or "compute_score"),
        custom_reward_kwargs=_reward_kwargs(merged),
    )


def extract_gsm8k(answer: str) -> str | None:
    """The number after ``####`` on the answer's last line, commas removed (GSM8K's convention)."""
    m = _GSM8K.search(answer.strip())
    return m.group("answer").replace(",", "") if m else None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}`` (or ``\\fbox{…}``), nested braces handled; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    if text.startswith(" ", i):  # `\boxed 5`: the token after the space
        token = text[i:].split()
        return token[0].split("$")[0] or None if token else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip() or None
    return None
