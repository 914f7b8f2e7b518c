"""The Python API: explain/stream and Explanation, prompts, models, visualisation, images."""
