"""Side-by-side benchmarks of ray_titan: ``python -m benchmarks.run [names]`` (docs/benchmarks.md)."""
