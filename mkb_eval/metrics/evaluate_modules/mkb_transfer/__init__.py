"""The mkb_transfer Comparison (script: mkb_transfer.py, card: README.md)."""
