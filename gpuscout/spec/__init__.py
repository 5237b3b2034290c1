"""What a benchmark is: the manifest, the instance catalog, model architectures, the FLOPs convention, GPU SKUs,
one job's spec, the benchmark.json schema and the stdout metric-line format.

May import: gpuscout.errors, gpuscout.paths and the standard library, pydantic, PyYAML. Imported by everything above
it and by training/ (inside the training image), so it stays light: no numpy, matplotlib, boto3, rich or torch at
import time.
"""
