"""The core data of splitkv, pure NumPy: what a decode batch is (``problem``), how it is cut
(``plan``) and run (``execution``), the checks of user input (``validation``), the float64
answer (``reference``, ``cpu_executor``, ``merge``), the kernel's work unit (``geometry``) and
bfloat16 as bits (``bfloat16``). Nothing here imports the GPU runtime."""
