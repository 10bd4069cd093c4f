"""Measuring: the five-bucket attribution, what a forward moves and computes, run metrics, and the
hardware's calibration and telemetry."""
