"""Preference pairs: `loading` (files, Hub datasets, mixtures, checked as they are read), `lengths` (their token
lengths as TRL tokenizes them: the length report and what the planner measures), `synthetic` (pairs of exact
lengths, and the named workloads the benchmarks run)."""
