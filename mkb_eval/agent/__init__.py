"""Attempts with local open-weight models: backends, prompts, the attempt loop, arms, run store, runner.

Submodules are imported on use (vLLM and transformers are heavy and live in the ``llm`` extra).
"""
