"""Side-by-side benchmarks of ray_titan: ``python -m benchmarks.run [names]`` (docs/benchmarks.md); every
measurement round and investigation is a dated file in benchmarks/results/."""
