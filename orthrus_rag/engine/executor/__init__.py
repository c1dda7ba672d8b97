"""The engine's executor: it runs what the core scheduled. The model runner, CUDA graphs, weight loading, the
step-cost calibration and the step timer."""
