"""A shard body for tests/test_variant_modules.py: run inside a ShardJob in a fresh process,
it returns what that process has registered (pickled by name, so a module of its own)."""


def registered(folder, index, units, executor):
    import variants

    return {n: variants.origin(n) for n in variants.names(private=True)}
