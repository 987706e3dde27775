"""The machinery the method stands on: run folders, checkpoints, the process group, files and errors, CLI
parsing, FLOP counting, betons, FID statistics, sample shards, post-hoc EMA, the diffusers format, kernels,
progress lines.

Nothing here imports the method (ddpm.py, unet.py, data.py) or a command: arrows run from the root down into
this package, never back up.
"""
