"""Served models: the OpenAI-compatible client and its five-bucket split, served records, scraped
/metrics, latency metrics, load sweeps and the vLLM launcher."""
