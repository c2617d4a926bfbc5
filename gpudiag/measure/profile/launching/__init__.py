"""`gpudiag profile`'s own side, in gpudiag's process: start the command with the recorder
injected, track its processes, copy the working directory for a re-run, read what each process
recorded. Never imports torch (an import-linter contract): the script's side reports the
machine."""
