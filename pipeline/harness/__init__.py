"""The harness: what proves and measures the pipeline, apart from the product.

    bench/       `rollout bench X` is `bench/X.py`: one JSON object of figures each
    demo/        `make demo`: the whole loop learns arithmetic on a local broker
    chaos/       `rollout chaos`: every stage killed, every sample accounted for
    load/        `rollout load`: the soak at the highest sustained rate
    models/      the project's own tiny models (`rollout model init`) and chat formats
    recipe.py    the demo's recipe (model, warm start, RL settings), which `bench learn`,
                 `bench lend` and `rollout model init --warm-start` use too
    recipe_run.py  one run of a recipe on the local pipeline (its config, model, prompts,
                 stages): the demo's, and `bench learn`'s and `bench lend`'s
    local_run.py the settings every local run of the whole pipeline shares

No stage imports any of it (`tests/unit/test_layering.py`); the CLI calls it.
"""
