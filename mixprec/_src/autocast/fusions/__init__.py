"""The fusions: patterns JAX emits as several equations that a platform runs
as one kernel, each in a folder of its own (its pattern, its rule)."""
