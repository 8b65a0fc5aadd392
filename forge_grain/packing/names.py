"""The packing strategies a config may name: here, apart from the planner, so that a config is
read and checked without loading numba (`forge-grain plan bad.toml` answers at once)."""

STRATEGIES = ("concat", "bos_bestfit", "bestfit")
