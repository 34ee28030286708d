"""A generative reward model: a language model reads each response and writes a judgement.

verl's ``reward.reward_model`` keys (>= 0.7) start the judge on a rollout engine whose weights are
loaded from ``model_path`` and never change (HF on any device, vLLM or SGLang where installed), in the
actor's processes or a pool of its own. What verl leaves to a custom reward function is here:

1. **Template.** ``reward.reward_model.prompt_template`` is a text file, or a packaged template
   (``correctness``: the judge compares the response with the ground truth and answers ``[[YES]]`` or
   ``[[NO]]``; ``rating``: the judge rates the response ``[[1]]`` .. ``[[10]]``). The placeholders
   ``{question}``, ``{response}``, ``{ground_truth}`` and ``{data_source}`` are filled in one pass
   (a response that contains ``{question}`` stays as written); other braces are left alone, so
   LaTeX and code survive. The filled template is one user message in the judge's chat template
   (plain text when it has none), as ``rlfoundry sft`` renders its prompts.
2. **Question.** The prompt's last user message (``raw_prompt``: the trainer keeps the chat when a
   judge is enabled), else ``extra_info["question"]``, else the decoded prompt.
3. **Parser.** ``verdict``: the last ``[[...]]`` in the judgement, looked up (case-insensitively)
   in ``verdicts`` (default ``{YES: 1, NO: 0}``; ``{A: 1, B: 0}`` for a pairwise-style judge); with
   no brackets, the judgement's last word if it is a verdict (``... so: yes``). ``number``: the last
   ``[[n]]``, else the last number in the text, inside ``score_range`` [lo, hi] and mapped to
   (n - lo) / (hi - lo) in [0, 1].
4. **Failure.** A judgement that does not parse, a verdict not in the table, a number outside the
   range, or a judge prompt longer than ``rollout.prompt_length`` (that row is not sent) scores
   ``failure_score`` and is named in ``judge_error``; the reward manager counts it in
   ``reward/errors`` and ``reward/errors/judge``. Nothing a judge writes stops a step.

Output of ``compute_rm_score``: ``judge_scores`` (B, Tr), the judge's score on each response's last
valid token as ``token_level_scores`` holds scores, and the non-tensor columns ``judge_error``
(None or the kind) and ``judge_text`` (the judgement). The reward manager weighs it against the
rule score (``reward.weights``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlfoundry.config.schema import GenerativeRewardModelConfig
from rlfoundry.protocol import DataProto
from rlfoundry.rewards.combine import place_scores
from rlfoundry.rewards.rule import decode_samples, response_lengths
from rlfoundry.utils.tokenizer import pad_id
from rlfoundry.utils.torch_functional import left_padded

TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "assets" / "judge"
DEFAULT_TEMPLATE = {"verdict": "correctness", "number": "rating"}
PLACEHOLDERS = ("question", "response", "ground_truth", "data_source")
KEY = "reward.reward_model"

_PLACEHOLDER = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")
_BRACKETED = re.compile(r"\[\[\s*([^\[\]]*?)\s*\]\]")
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_WORD = re.compile(r"[\w+-]+")


class JudgeConfigError(ValueError):
    """A judge setting that cannot work (bad template, empty verdict table, empty range)."""


# ---- template ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class JudgeTemplate:
    """The judge's prompt with ``{question}``, ``{response}``, ``{ground_truth}``, ``{data_source}``."""

    text: str
    source: str  # the file or packaged name it came from (for messages)

    @classmethod
    def load(cls, spec: str | None, parser: str) -> JudgeTemplate:
        """``spec``: a file path, a packaged template's name, or None (the parser's default)."""
        name = spec or DEFAULT_TEMPLATE[parser]
        packaged = TEMPLATES_DIR / f"{name}.txt"
        path = packaged if packaged.is_file() and "/" not in name else Path(name).expanduser()
        if not path.is_file():
            names = sorted(p.stem for p in TEMPLATES_DIR.glob("*.txt"))
            raise JudgeConfigError(f"{KEY}.prompt_template={name}: no such file, and not a packaged template "
                                   f"(packaged: {', '.join(names)})")
        text = path.read_text()
        if "{response}" not in text:
            raise JudgeConfigError(f"{KEY}.prompt_template={name} ({path}) has no {{response}} placeholder, so the "
                                   f"judge would never see the response; placeholders: "
                                   + ", ".join("{" + p + "}" for p in PLACEHOLDERS))
        return cls(text, str(path))

    def render(self, **values: str) -> str:
        """The template with each placeholder replaced, in one pass (inserted text is not re-read)."""
        return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), ""), self.text)


# ---- parsers (pure) ---------------------------------------------------------------------------


def parse_verdict(text: str, verdicts: Mapping[str, float]) -> tuple[float | None, str | None]:
    """(score, None), or (None, error kind). The last ``[[verdict]]`` decides, in any case; without
    brackets, the last word, where a one-letter verdict must also match its case ("... I prefer a"
    is an article, not verdict ``A``)."""
    table = {str(k).strip().lower(): float(v) for k, v in verdicts.items()}
    bracketed = _BRACKETED.findall(text)
    if bracketed:
        verdict = bracketed[-1].strip().lower()
        return (table[verdict], None) if verdict in table else (None, "unknown_verdict")
    words = _WORD.findall(text)
    if not words or words[-1].lower() not in table:
        return None, "no_verdict"
    if len(words[-1]) == 1 and words[-1] not in {str(k).strip() for k in verdicts}:
        return None, "no_verdict"
    return table[words[-1].lower()], None


def parse_number(text: str, low: float, high: float) -> tuple[float | None, str | None]:
    """(score in [0, 1], None), or (None, error kind): the last ``[[n]]``, else the last number."""
    bracketed = [b for b in _BRACKETED.findall(text) if _NUMBER.fullmatch(b.strip())]
    found = bracketed[-1] if bracketed else (_NUMBER.findall(text) or [None])[-1]
    if found is None:
        return None, "no_verdict"
    value = float(found)
    if not low <= value <= high:
        return None, "out_of_range"
    return (value - low) / (high - low), None


def make_parser(config: GenerativeRewardModelConfig) -> Callable[[str], tuple[float | None, str | None]]:
    """The configured parser as ``text -> (score, error)``; a setting that cannot work raises."""
    if config.parser == "verdict":
        verdicts = dict(config.verdicts or {})
        bad = {k: v for k, v in verdicts.items() if not _finite(v)}
        if not verdicts or bad:
            raise JudgeConfigError(f"{KEY}.verdicts must map each verdict to a finite score, e.g. "
                                   f"{{YES: 1.0, NO: 0.0}}; got {verdicts}")
        return lambda text: parse_verdict(text, verdicts)
    low, high = (list(config.score_range) + [None, None])[:2]
    if len(config.score_range) != 2 or not (_finite(low) and _finite(high)) or float(low) >= float(high):
        raise JudgeConfigError(f"{KEY}.score_range must be [low, high] with low < high; got {list(config.score_range)}")
    return lambda text: parse_number(text, float(low), float(high))


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def check_judge_config(config: GenerativeRewardModelConfig) -> list[str]:
    """Start-up problems with the judge's template and parser settings (messages, not exceptions)."""
    problems = []
    for check in (lambda: JudgeTemplate.load(config.prompt_template, config.parser), lambda: make_parser(config)):
        try:
            check()
        except JudgeConfigError as e:
            problems.append(str(e))
    return problems


# ---- the judge ----------------------------------------------------------------------------------


class GenerativeRewardModel:
    """Renders each row's judge prompt, has ``generate`` write the judgements, parses them.

    ``generate`` is the judge worker group's ``generate_sequences`` (prompts in the rollout contract:
    left-padded ``input_ids``, ``attention_mask``, ``position_ids``); ``tokenizer`` decodes the
    policy's responses, ``judge_tokenizer`` renders and encodes the judge's prompts."""

    def __init__(self, generate: Callable[[DataProto], DataProto], tokenizer: Any, judge_tokenizer: Any,
                 config: GenerativeRewardModelConfig, reward_fn_key: str = "data_source") -> None:
        self.generate, self.tokenizer, self.judge_tokenizer = generate, tokenizer, judge_tokenizer
        self.config, self.reward_fn_key = config, reward_fn_key
        self.template = JudgeTemplate.load(config.prompt_template, config.parser)
        self.parse = make_parser(config)
        self.pad_id = pad_id(judge_tokenizer)

    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``judge_scores`` (B, Tr), ``judge_error`` and ``judge_text`` for each row of ``data``."""
        samples = decode_samples(data, self.tokenizer, self.reward_fn_key)
        prompts = [self._encode(self.template.render(
            question=self._question(data, i), response=s.solution_str,
            ground_truth="" if s.ground_truth is None else str(s.ground_truth), data_source=s.data_source))
            for i, s in enumerate(samples)]
        texts = self._judge(prompts)
        scores, errors = [], []
        for text in texts:
            score, error = (None, "prompt_too_long") if text is None else self.parse(text)
            scores.append(float(self.config.failure_score) if score is None else score)
            errors.append(error)
        width = data.batch["responses"].shape[-1]
        tensor = place_scores(scores, torch.tensor([s.response_length for s in samples]), width)
        return DataProto.from_dict(tensors={"judge_scores": tensor}, non_tensors={
            "judge_error": np.array(errors, dtype=object), "judge_text": np.array(texts, dtype=object)})

    def _question(self, data: DataProto, i: int) -> str:
        nt = data.non_tensor_batch
        if "raw_prompt" in nt:
            users = [m.get("content", "") for m in nt["raw_prompt"][i] if m.get("role") == "user"]
            if users:
                return str(users[-1])
        extra = nt["extra_info"][i] if "extra_info" in nt else None
        if isinstance(extra, dict) and extra.get("question") is not None:
            return str(extra["question"])
        prompt, mask = data.batch["prompts"][i], data.batch["attention_mask"][i, : data.batch["prompts"].shape[-1]]
        return self.tokenizer.decode(prompt[mask.bool()].tolist(), skip_special_tokens=True)

    def _encode(self, text: str) -> list[int]:
        tok = self.judge_tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    def _judge(self, prompts: Sequence[list[int]]) -> list[str | None]:
        """The judgement per prompt (None where the prompt exceeds ``rollout.prompt_length``)."""
        limit = int(self.config.rollout.prompt_length)
        sent = [i for i, ids in enumerate(prompts) if len(ids) <= limit]
        texts: list[str | None] = [None] * len(prompts)
        if not sent:
            return texts
        rows = left_padded([prompts[i] for i in sent], self.pad_id)  # one judgement each
        out = self.generate(DataProto.from_dict(tensors=rows, meta_info={
            "n": 1, "do_sample": bool(self.config.rollout.do_sample)}))
        responses = out.batch["responses"].cpu()  # one copy from the judge's device, not one per row
        for j, (i, n) in enumerate(zip(sent, response_lengths(out).tolist())):
            texts[i] = self.judge_tokenizer.decode(responses[j, :n].tolist(), skip_special_tokens=True)
        return texts
