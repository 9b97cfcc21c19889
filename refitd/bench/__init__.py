"""Benchmarks and test harnesses: each `refitd bench <name>` command and what it drives.

Only the CLI (and the tests) import this package; the product never does.
"""
