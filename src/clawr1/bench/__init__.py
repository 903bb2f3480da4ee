"""Benchmarks that measure Claw-R1 against a plain baseline in one run and print the ratios
(`clawr1 bench engine`)."""
