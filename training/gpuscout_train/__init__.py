"""The training job: gpuscout's causal-LM fine-tuning benchmark, as the image runs it on every host.

Entry points: ``python -m gpuscout_train.launcher`` (the image's; starts train.py on every GPU) and
``python -m gpuscout_train.train`` (one process; the local runner's).

train.py is the job's story (``main()``); trainer.py holds the timed loop (``Trainer``), which composes the
components built by build.py's ``build_*`` functions:

- arguments: args.py (hyperparameters), distributed.py (ranks and the process group)
- model: model.py (the model, DeepSpeed), packing.py (packed batches and the losses), partial_checkpoint.py
- data: data.py (blocks, sampler, splits; the files are gpuscout_data.dataset's)
- the loop: trainer.py (steps, stop rules), validation.py, state.py (what a checkpoint saves), checkpoints.py
- measurements: metrics.py (step accounting, steady state, GPU sampling), facts.py (hardware and software),
  result.py (benchmark.json), tracking.py (MLflow, W&B)
- the process: launcher.py, topology.py (hosts, torchrun), job_code.py (the user's own script), stop_signal.py,
  startup_gc.py, host_allocator.py, nvidia_versions.py

Importing this package imports nothing else: the SDK (gpuscout_report) imports metrics.py without torch.
"""
