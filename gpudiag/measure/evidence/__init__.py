"""Evidence: what a step did, measured in a short profiler window and charged to source lines.
Its modules are imported by name: trace.py and annotation.py load no torch, so that gpudiag's
own process can analyse a script's window (gpudiag/measure/profile/launching/)."""
