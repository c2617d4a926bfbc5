"""Measuring: the plan, the runner and its one timed window, telemetry, evidence, workloads and
stages, the DDP launcher, and the profile recorder. Produces results; never diagnoses."""
