"""Calibration: time candidate plans on the GPU (through ``splitkv.runtime``) and fit the
planner's cost model to them (through ``splitkv.planner``). Nothing here touches CuPy itself."""
