"""What a benchmark is: the manifest, the instance catalog and its price snapshot, model architectures, the FLOPs
convention, GPU SKUs, the names the stack and the runtime share,
one job's spec, the benchmark.json schema, the stdout metric-line format and where experiment tracking goes
(``tracking``: the GPUSCOUT_TRACKING contract between a job and the run).

May import: gpuscout.errors, gpuscout.paths and the standard library, pydantic, PyYAML. Imported by everything above
it and by training/ (inside the training image), so it stays light: no numpy, matplotlib, boto3, rich or torch at
import time.
"""
