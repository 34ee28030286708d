"""Built-in synthetic task ``rlfoundry/arithmetic``: integer expressions like ``37+48=`` -> ``85``.

Made for the default demo run: a byte-level tokenizer spends one token per character, so prompts
and answers are a handful of tokens, and checking an answer is one integer comparison
(``rlfoundry.rewards.arithmetic``). Difficulty is set by ``ArithmeticSpec``: operand digits, the
operators drawn from ``+-*``, and the number of operands (usual precedence: ``*`` before ``+ -``).

    python -m rlfoundry.data.preprocess arithmetic --output ~/data/arith --digits 2 --ops +- --seed 0

``generate_problems`` returns (prompt, answer) pairs and ``sft_pairs`` (messages, response) pairs
from the same generator, so SFT warm-up and RL see the same distribution. Test problems are drawn
first and train problems exclude them, so the test set is fixed by (seed, spec, test_size) alone.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

from rlfoundry.data.preprocess.common import PreprocessError, verl_row, write_splits

DATA_SOURCE = "rlfoundry/arithmetic"
OPERATORS = "+-*"


@dataclass(frozen=True)
class ArithmeticSpec:
    """Operands are uniform in [0, 10**digits); ``ops`` is drawn from per operator slot."""

    digits: int = 2
    ops: str = "+-"
    num_operands: int = 2

    def __post_init__(self) -> None:
        if self.digits < 1 or self.num_operands < 2 or not self.ops or set(self.ops) - set(OPERATORS):
            raise ValueError(
                f"invalid {self}: need digits >= 1, num_operands >= 2, ops a non-empty subset of {OPERATORS!r}"
            )

    @property
    def num_distinct(self) -> int:
        """How many different expressions this spec can produce (an upper bound on unique problems)."""
        return (10**self.digits) ** self.num_operands * len(set(self.ops)) ** (self.num_operands - 1)


def evaluate(expression: str) -> int:
    """Value of ``"3+4*5"`` with ``*`` binding tighter than ``+``/``-`` (left to right otherwise)."""
    total, sign, product, number = 0, 1, 1, ""
    for ch in expression + "+":
        if ch.isdigit():
            number += ch
            continue
        product *= int(number)
        number = ""
        if ch == "*":
            continue
        total += sign * product
        sign, product = (1 if ch == "+" else -1), 1
    return total


def make_problem(rng: random.Random, spec: ArithmeticSpec) -> tuple[str, str]:
    """One (prompt, answer) pair, e.g. ``("37+48=", "85")``."""
    operands = [str(rng.randrange(10**spec.digits)) for _ in range(spec.num_operands)]
    expression = operands[0] + "".join(rng.choice(spec.ops) + x for x in operands[1:])
    return expression + "=", str(evaluate(expression))


def generate_problems(
    n: int, seed: int = 0, spec: ArithmeticSpec = ArithmeticSpec(), exclude: set[str] | None = None
) -> list[tuple[str, str]]:
    """``n`` distinct (prompt, answer) pairs, none of whose prompts is in ``exclude``."""
    exclude = set(exclude or ())
    if n > spec.num_distinct - len(exclude):
        raise PreprocessError(
            f"{spec} has only {spec.num_distinct} distinct problems; asked for {n} (+{len(exclude)} excluded)"
        )
    rng, seen, problems = random.Random(seed), set(exclude), []
    # Rejection sampling stalls once most of the space is used; bound the attempts instead of looping forever.
    for _ in range(50 * n + 1000):
        if len(problems) == n:
            break
        prompt, answer = make_problem(rng, spec)
        if prompt not in seen:
            seen.add(prompt)
            problems.append((prompt, answer))
    if len(problems) < n:
        raise PreprocessError(
            f"drew only {len(problems)} of {n} distinct problems from {spec}; use more digits or operands"
        )
    return problems


def generate_splits(
    train_size: int, test_size: int, seed: int = 0, spec: ArithmeticSpec = ArithmeticSpec()
) -> dict[str, list[tuple[str, str]]]:
    """Disjoint train/test problem lists (test drawn first with ``seed``, train with ``seed + 1``)."""
    test = generate_problems(test_size, seed, spec)
    train = generate_problems(train_size, seed + 1, spec, exclude={p for p, _ in test})
    return {"train": train, "test": test}


def sft_pairs(n: int, seed: int = 0, spec: ArithmeticSpec = ArithmeticSpec()) -> list[tuple[list[dict], str]]:
    """(chat messages, response text) pairs for SFT; the trainer appends EOS to the response."""
    return [([{"role": "user", "content": prompt}], answer) for prompt, answer in generate_problems(n, seed, spec)]


def make_row(problem: tuple[str, str], split: str, index: int) -> dict:
    prompt, answer = problem
    extra = {"split": split, "index": index, "expression": prompt.rstrip("="), "answer": answer}
    return verl_row(DATA_SOURCE, prompt, "arithmetic", answer, extra)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--digits", type=int, default=2, help="max digits per operand (operands in [0, 10**digits))")
    parser.add_argument("--ops", default="+-", help=f"operators to draw from, a subset of {OPERATORS!r}")
    parser.add_argument("--num-operands", type=int, default=2)
    parser.add_argument("--train-size", type=int, default=10000)
    parser.add_argument("--test-size", type=int, default=500)


def run(args: argparse.Namespace) -> dict[str, Path]:
    if args.input:
        raise PreprocessError("the arithmetic task is generated from --seed; it takes no --input")
    try:
        spec = ArithmeticSpec(args.digits, args.ops, args.num_operands)
    except ValueError as err:
        raise PreprocessError(str(err)) from err
    splits = generate_splits(args.train_size, args.test_size, args.seed, spec)
    return write_splits(splits, Path(args.output), make_row)
