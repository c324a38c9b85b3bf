"""Runs in spawned worker processes (importable by name, as spawn requires)."""

import os


def call(job):
    prog, x = job
    return os.getpid(), prog(x)
