"""Runs generated programs: the scheduler (frames off the Python stack) and Python-semantics helpers."""
