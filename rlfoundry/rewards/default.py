"""``default_compute_score``: pick the rule scorer for a sample by its ``data_source``.

Same signature as verl's, so a custom reward function written for verl can wrap or replace it.
Add a data set by adding its name to ``SCORERS``.
"""

from __future__ import annotations

from typing import Any, Callable

from rlfoundry.rewards import arithmetic, code, geo3k, gsm8k
from rlfoundry.rewards import math as math_scorer

ARITHMETIC_DATA_SOURCE = "rlfoundry/arithmetic"
SHAPES_DATA_SOURCE = "rlfoundry/count_shapes"  # data/preprocess/shapes.py: an integer answer, as arithmetic
SHAPE_COLOUR_DATA_SOURCE = "rlfoundry/shape_colour"  # data/preprocess/shapes.py --question colour: a colour's name


def exact_word_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the response is the ground-truth word (surrounding white space and case aside), else 0.0."""
    return float(solution_str.strip().lower() == str(ground_truth).strip().lower())


SCORERS: dict[str, Callable[..., float]] = {
    "openai/gsm8k": gsm8k.compute_score,
    "lighteval/MATH": math_scorer.compute_score,
    "DigitalLearningGmbH/MATH-lighteval": math_scorer.compute_score,
    "HuggingFaceH4/MATH-500": math_scorer.compute_score,
    ARITHMETIC_DATA_SOURCE: arithmetic.compute_score,
    SHAPES_DATA_SOURCE: arithmetic.compute_score,
    SHAPE_COLOUR_DATA_SOURCE: exact_word_score,
    "hiyouga/geometry3k": geo3k.compute_score,
    # programs run against the row's unit tests in the sandbox (rewards/code.py)
    **{source: code.compute_score for source in code.CODE_DATA_SOURCES},
}

# Sources whose scorer finishes in bounded time on any response: string and regex code with no
# nested quantifiers (gsm8k also clips the text to its tail first), no sympy. A scorer process pool
# (~190 MB, seconds to start) would protect against nothing here, so with reward_kwargs.num_workers
# unset the reward manager scores batches made only of these in the driver. MATH is absent on
# purpose: math-verify/sympy can hang on adversarial LaTeX and needs the pool's per-sample timeout.
IN_DRIVER_SOURCES: frozenset[str] = frozenset({ARITHMETIC_DATA_SOURCE, SHAPES_DATA_SOURCE, SHAPE_COLOUR_DATA_SOURCE,
                                                "openai/gsm8k"})


class UnknownDataSourceError(KeyError):
    """No built-in scorer for this data_source; the message lists the known ones."""

    def __str__(self) -> str:  # KeyError would repr() the message and hide the newlines
        return str(self.args[0])


def check_data_sources(data_sources: Any) -> None:
    """Raise UnknownDataSourceError if any of ``data_sources`` has no built-in scorer."""
    unknown = sorted({str(s) for s in data_sources} - SCORERS.keys())
    if unknown:
        raise UnknownDataSourceError(
            f"no built-in reward function for data_source {unknown}; known: {sorted(SCORERS)}. "
            "Point custom_reward_function.path (and .name) at a Python file with your own compute_score"
        )


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    sandbox_fusion_url: str | None = None,
    memory_limit_mb: int | None = None,
    max_concurrent: int = 64,
    **kwargs: Any,
) -> float | dict:
    """Score one response with the built-in scorer of its data set. As in verl, the SandboxFusion
    arguments (``reward_model.sandbox_fusion.*``) reach only the code scorer."""
    check_data_sources([data_source])
    scorer = SCORERS[data_source]
    if scorer is code.compute_score:
        kwargs.update(sandbox_fusion_url=sandbox_fusion_url, memory_limit_mb=memory_limit_mb,
                      max_concurrent=max_concurrent)
    return scorer(solution_str, ground_truth, **kwargs)


def batch_default_compute_score(
    data_sources: list[str],
    solution_strs: list[str],
    ground_truths: list[str],
    extra_infos: list[dict | None],
    **kwargs: Any,
) -> list[float | dict]:
    """``default_compute_score`` over lists: the default scorer of the ``batch`` reward manager."""
    check_data_sources(data_sources)
    return [
        default_compute_score(s, r, g, e, **kwargs)
        for s, r, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos)
    ]
