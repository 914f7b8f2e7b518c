"""Programs built on the API: the server, the CLI, benchmarks, the evaluation (with its baselines), AT2,
integrations with other tools."""
