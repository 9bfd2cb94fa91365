"""Agent loops: one trajectory's logic (see workers/agent_loop/base.py)."""
