"""Models the project builds itself for tests, benches and the quick start.

Nothing here is used by the workers: a worker loads whatever folder the
models table names, and these builders only write such folders.
"""
