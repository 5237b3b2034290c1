"""Report a training script's progress to gpuscout: the helper your own code calls (docs/byo.md).

    import gpuscout_report as gs

    for batch in loader:
        loss = train_step(batch)
        if gs.step(samples=len(batch), loss=loss.item()):  # True: gpuscout has measured enough, stop
            break
    gs.done()

Standard library only (plus gpuscout's own stdlib-only statistics and metric-line modules and gpuscout_train's step
accounting, which every gpuscout job can import). It times every optimizer step between two ``step`` calls with
``time.perf_counter`` (call ``step`` after something that waits for the device, e.g. ``loss.item()``, or pass
``sync=torch.cuda.synchronize`` to :func:`configure`), excludes the warm-up steps from every throughput figure,
applies the manifest's stop rule (``max_steps``, or steady state: the 95 % interval of the rate within tolerance) and
writes ``$SM_OUTPUT_DATA_DIR/benchmark.json`` in the schema of gpuscout/domain/benchmark.py. An uncaught exception is
written as a failed benchmark.json with the exception as the reason (so "out of memory" is classified as OOM).

Without calling it, a script may print metric lines instead (``gpuscout_metric step=3 samples=256 loss=0.71``);
``python -m gpuscout_report --from-log LOG`` turns them into the same benchmark.json (the runner does that).
Callbacks for the HF Trainer and PyTorch Lightning: :func:`hf_trainer_callback`, :func:`lightning_callback`.

reporter.py holds the measurement, callbacks.py the framework callbacks, log.py the metric-line reading.
"""

from .callbacks import hf_trainer_callback, lightning_callback
from .log import LOG_LINE_RE, LOG_VALUE_RE, from_log, main, parse_log_lines
from .reporter import SCHEMA_VERSION, Reporter, configure, done, phase, reporter, step

__all__ = [
    "LOG_LINE_RE",
    "LOG_VALUE_RE",
    "SCHEMA_VERSION",
    "Reporter",
    "configure",
    "done",
    "from_log",
    "hf_trainer_callback",
    "lightning_callback",
    "main",
    "parse_log_lines",
    "phase",
    "reporter",
    "step",
]
