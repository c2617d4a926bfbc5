"""The `gpudiag` command line: it parses arguments, calls into the package, renders; nothing
else. program.py assembles the commands, one module per family (runs, recorded, profiling,
gating, gatefiles, info); below them edges.py (the consoles, every error as one line and an
exit code) and flags.py (a command's flags from gpudiag.model.options)."""
