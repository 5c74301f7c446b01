"""Runs generated programs: the schedulers (sequential, agenda-batched, threaded), batch values and
their rules, level runs, streams."""
