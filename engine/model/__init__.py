"""The model itself: loading (the embedded default, local folders, hub ids), the lean forward and the
C++ kernels it calls."""
