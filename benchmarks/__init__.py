"""The benchmarks behind the published numbers; run each as `python -m benchmarks.NAME` from the repository root."""
