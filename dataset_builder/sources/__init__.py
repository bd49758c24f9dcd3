"""Row sources of the dataset: one module per input (problem folders, verification records,
reference runs, rendered prompts, run folders). Each returns plain dict rows in a fixed order."""
