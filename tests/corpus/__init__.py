"""The bad-input corpus: malformed and hostile inputs for every stage, and what must become of them.

`bad_inputs.CASES` lists the cases (stage, raw bytes, expected outcome); `tools` and `rewards`
are the misbehaving tools and reward functions some cases need. The suite that runs them is
`tests/integration/test_bad_input_corpus.py`.
"""
