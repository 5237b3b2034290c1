"""Metric lines on stdout, without the helper: ``python -m gpuscout_report --from-log LOG`` turns a script's printed
``gpuscout_metric`` lines into the same benchmark.json (the runner and the image's launcher do that)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpuscout.domain.metric_lines import PREFIX

from .reporter import Reporter

LOG_LINE_RE = re.compile(rf"^{PREFIX}\b(?P<rest>.*)$")  # docs/byo.md: the regexes the runner applies
LOG_VALUE_RE = re.compile(r" (?P<key>[a-z_]+)=(?P<value>[-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)")


def parse_log_lines(lines: Iterable[str]) -> list[dict[str, float]]:
    """The step lines of a log (LOG_LINE_RE, LOG_VALUE_RE): one dict per ``gpuscout_metric`` line that has a
    ``step``; summary lines and other output are ignored."""
    steps = []
    for line in lines:
        match = LOG_LINE_RE.match(line.strip())
        if not match:
            continue
        values = {m["key"]: float(m["value"]) for m in LOG_VALUE_RE.finditer(" " + match["rest"])}
        if "step" in values:
            steps.append(values)
    return steps


def from_log(lines: Iterable[str], rep: Reporter) -> dict[str, Any]:
    """benchmark.json from printed metric lines: ``samples``/``tokens`` per step, ``loss`` and ``step_time_s`` (the
    script times its own steps: the runner cannot see when a step's device work ended)."""
    steps = parse_log_lines(lines)
    if not steps:
        raise ValueError("no gpuscout_metric step lines in the log (and no benchmark.json from the helper)")
    for values in steps:
        seconds = values.get("step_time_s")
        if seconds is None:
            raise ValueError(f"step {values['step']:g}: the metric line has no step_time_s")
        samples = values.get("samples")
        tokens = values.get("tokens")
        # the helper's own lines carry rates, not counts (a script ended after ignoring "stop" left only those)
        if samples is None and values.get("samples_per_s") is not None:
            samples = round(values["samples_per_s"] * seconds)
        if tokens is None and values.get("tokens_per_s") is not None:
            tokens = round(values["tokens_per_s"] * seconds)
        stop = rep.step(
            samples=int(samples) if samples is not None else None,
            tokens=int(tokens) if tokens is not None else None,
            loss=values.get("loss"),
            seconds=seconds,
        )
        if stop:  # what a script that honoured the stop rule would have measured; later lines are not counted
            break
    return rep.done()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="benchmark.json from a log of gpuscout_metric lines")
    parser.add_argument("--from-log", required=True, type=Path)
    args = parser.parse_args(argv)
    rep = Reporter(reporter_name="stdout", emit=lambda _line: None, measure_usage=False)
    try:
        from_log(args.from_log.read_text(encoding="utf-8", errors="replace").splitlines(), rep)
    except ValueError as err:
        print(f"gpuscout_report: error: {err}", file=sys.stderr)
        return 2
    return 0
