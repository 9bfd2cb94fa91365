"""Generated datasets, since none can be downloaded: arithmetic in gsm8k's format.

Each row is a verl-format prompt whose answer the gsm8k scorer checks strictly
(`#### <number>` in the response). Deterministic for a seed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

__all__ = ["arithmetic_rows", "write_rows"]

INSTRUCTION = "Answer with the number after ####."


def arithmetic_rows(
    n: int, *, seed: int = 0, max_operand: int = 20, split: str = "train"
) -> list[dict[str, Any]]:
    """`n` addition/subtraction/multiplication questions with their answers."""
    rng = random.Random(seed)
    rows = []
    for index in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-*")
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        question = f"What is {a} {op} {b}?"
        rows.append(
            {
                "uid": f"arith-{split}-{seed}-{index}",
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": index, "question": question},
            }
        )
    return rows


def write_rows(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write rows as .jsonl or .parquet (by the file's suffix)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with path.open("w") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
    return path
