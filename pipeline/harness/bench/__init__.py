"""Benchmarks: each prints one JSON object and compares against a baseline measured in the
same run.
"""
