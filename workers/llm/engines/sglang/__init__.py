"""The `sglang` engine: what is its own only. The shared gate, upstream client, child-server
launcher and served config are in `workers.llm.engines`."""
