"""Measuring: the five-bucket attribution, what a forward moves and computes, run metrics, the
hardware's calibration and telemetry, and teacher-forced quality."""
