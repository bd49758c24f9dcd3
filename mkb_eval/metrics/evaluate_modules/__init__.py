"""HF `evaluate` modules of MetaKernelBench: load one with `evaluate.load(<path to its folder>)`.

The folders are packages too, so the scripts ship in wheels and the classes can be imported directly.
"""
