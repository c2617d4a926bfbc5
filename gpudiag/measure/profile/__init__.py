"""`gpudiag profile`: the same evidence and rules for an unmodified training script.

Two programs, one per process: launching/ runs in gpudiag's process (starts the command, reads
the parts), inscript/ runs inside every Python interpreter the command starts (the recorder).
protocol.py is all they share: environment variables, file names, the config and the part
record's type. See docs/architecture.md."""
