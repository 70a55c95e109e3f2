"""Mode auto's planner: the latency model, profiling, and the choices it makes from them.

latency (the model: measured step costs and acceptance -> predicted tokens/s per strategy), profile (the profile file
format and cache), profiling (measuring a loaded pipeline), placement and threads (which devices and thread split to
load), ar_probe (when plain ar should take over), exit_layer (which early-exit layer pays), auto (the strategy chosen
per step while decoding).
"""
