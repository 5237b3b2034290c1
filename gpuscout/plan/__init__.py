"""Turning a manifest into jobs: expansion of targets x variants x repetitions, per-job settings, predicted
throughput, time, cost and memory, and the budget and fit checks that refuse a run before anything is launched.

May import: gpuscout.domain, gpuscout.errors, gpuscout.paths.
"""
