"""The C++ sources of the engine's CPU extension (layers/cpu_extension.py), one module per kernel family."""
