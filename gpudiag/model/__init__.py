"""The leaf layer: run and stage results, configuration, errors, hardware facts. Imports nothing
else of gpudiag, and no torch, so a recorded run.json can be read and diagnosed anywhere."""
