"""Measuring on the GPU, above the runtime: the one timing routine (``timing``: CUDA graphs over
layers of random K/V, the median of trials), the first-use probes a GPU without a profile is
timed with (``first_use_probes``), the streaming-read probe (``bandwidth_probe``), and random
decode batches on the device with the GPU tests' checks (``test_data``).

It runs kernels through the runtime (a ``BatchDecodeWrapper``, and the thin CuPy calls of
``runtime.cupy_timers``, ``runtime.probe_kernels`` and ``runtime.cupy_arrays``) and never
imports CuPy itself; the runtime never imports it. The bench and the calibration sweep sit on
top of it."""
