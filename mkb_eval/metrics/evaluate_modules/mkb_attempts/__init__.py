"""The mkb_attempts Metric (script: mkb_attempts.py, card: README.md)."""
