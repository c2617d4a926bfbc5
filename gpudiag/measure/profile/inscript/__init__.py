"""`gpudiag profile` inside the user's Python interpreter: installed at start-up by
bootstrap/sitecustomize.py (install.py), it records the script's steps and writes a part per
process for the launching side to read. Never imported by gpudiag's own process (an
import-linter contract)."""
