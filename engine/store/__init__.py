"""The DuckDB run store: the schema and its migrations, shared statements, each run's journal and the
recovery of runs whose process died."""
